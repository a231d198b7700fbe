"""Tool use at CPU scale: multiplication a tiny model cannot do in its head, and a calculator.

``python -m megatron_stare.demo.tool_use --out runs/tool_use [--seed 0] [--quick]`` prepares a
run of ``examples/tool_use_cpu.yaml`` (``launch/train_tool_use_cpu.sh`` does both):

1. a tiny Qwen2-style model and byte-level BPE tokenizer, built offline (``<out>/base``);
2. ``mul`` prompts (``What is 347 * 28? Answer:``, ``rewards.synthetic``): ``<out>/data``;
3. a supervised warm start on correct tool-using trajectories (``<out>/sft``): the model's turn
   ``<calc>347*28</calc>`` + EOS, the calculator's observation ``<result>9716</result>`` (the
   real tool's answer, as the environment's token ids; not trained), then the model's turn
   ``<answer>9716</answer>`` + EOS. It stops at a partial sampled accuracy (``study.sft``), read
   from real multi-turn rollouts: ``generate_multiturn`` through the ``hf`` engine with the
   ``calculator`` environment, as the trainer samples them.

The RL run (STARE, the calculator environment, reward = the environment's verdict) then raises
the tool-use accuracy from that start.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from megatron_stare import REPO_ROOT as ROOT
from megatron_stare.study.sft import PolicyStats, SftSettings, train_sft
from megatron_stare.envs import make_env
from megatron_stare.models.tiny import build_tiny_hf_model
from megatron_stare.rewards.synthetic import make_task, write_jsonl
from megatron_stare.rollout import SamplingParams
from megatron_stare.rollout.engines.hf.engine import HFEngine
from megatron_stare.rollout.multiturn import MultiTurnLimits, generate_multiturn

CONFIG = ROOT / "examples" / "tool_use_cpu.yaml"
OPERANDS = re.compile(r"What is (\d+) \* (\d+)\?")
MAX_NEW_TOKENS, MAX_TURNS, MAX_TOTAL_TOKENS = 24, 2, 64
"""The rollout limits of ``examples/tool_use_cpu.yaml`` (the warm start's probe samples alike)."""


@dataclass
class ToolUseSettings:
    out: str = "runs/tool_use"
    seed: int = 0
    sft_rows: int = 2000
    rl_rows: int = 256
    sft: SftSettings = None

    def __post_init__(self):
        if self.sft is None:
            self.sft = SftSettings(max_steps=2000, stop_accuracy=0.4, eval_every=50, probe_prompts=32,
                                   max_new_tokens=MAX_NEW_TOKENS)


def tool_trajectory(tok, row: dict) -> tuple:
    """``(token ids, labels)`` of a correct tool-using trajectory for a ``mul`` row: labels on
    the model's turns (EOS included), -100 on the prompt and on the calculator's observation,
    which comes from the real ``calculator`` environment as token ids."""

    a, b = OPERANDS.search(row["prompt"]).groups()
    prompt = tok(row["prompt"])["input_ids"]
    env = make_env("calculator", tok, {})
    env.reset(prompt, row["answer"])
    call = tok(f"<calc>{a}*{b}</calc>")["input_ids"] + [tok.eos_token_id]
    obs = env.step(call).observation
    answer = tok(f"<answer>{row['answer']}</answer>")["input_ids"] + [tok.eos_token_id]
    seq = prompt + call + obs + answer
    return seq, [-100] * len(prompt) + call + [-100] * len(obs) + answer


def multiturn_probe(base_dir: str):
    """A ``train_sft`` probe: the sampled tool-use accuracy of the model being trained, from
    multi-turn rollouts (temperature 1, the ``calculator`` environment) through an ``hf``
    engine that receives the model's weights at each probe."""

    engine = HFEngine(base_dir)

    def probe(model, tok, rows, seed) -> PolicyStats:
        engine.update_weights(model.state_dict().items())
        prompts = [tok(r["prompt"])["input_ids"] for r in rows]

        def new_env(p):
            env = make_env("calculator", tok, {})
            env.reset(prompts[p], rows[p]["answer"])
            return env

        trajs = generate_multiturn(engine, prompts, SamplingParams(n=1, max_new_tokens=MAX_NEW_TOKENS, seed=seed),
                                   MultiTurnLimits(MAX_TURNS, MAX_TOTAL_TOKENS), new_env)
        k = max(len(trajs), 1)
        return PolicyStats(accuracy=sum(t.env_reward for t in trajs) / k, entropy=float("nan"),
                           mean_length=sum(sum(t.loss_mask) for t in trajs) / k)

    return probe


def prepare(s: ToolUseSettings, log=print) -> PolicyStats:
    """Base model, ``<out>/data/train.jsonl`` and the warm start ``<out>/sft``; its probe stats."""

    out = Path(s.out)
    base = build_tiny_hf_model("qwen2", out / "base", seed=s.seed)
    sft_rows = make_task("mul", s.sft_rows, seed=1000 + s.seed)
    probe_rows = make_task("mul", s.sft.probe_prompts, seed=2000 + s.seed)
    write_jsonl(make_task("mul", s.rl_rows, seed=3000 + s.seed), str(out / "data" / "train.jsonl"))
    stats = train_sft(str(base), str(out / "sft"), sft_rows, probe_rows, s.sft, seed=s.seed, log=log,
                      encode=tool_trajectory, probe=multiturn_probe(str(base)))
    log(f"[tool_use] warm start: sampled tool-use accuracy {stats.accuracy:.2f} -> {out / 'sft'}")
    return stats


def trainer_overrides(out: str) -> List[str]:
    """The paths ``examples/tool_use_cpu.yaml`` needs from ``prepare``."""
    return [f"model.path={Path(out) / 'sft'}", f"data.train_path={Path(out) / 'data' / 'train.jsonl'}"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_stare.demo.tool_use", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=ToolUseSettings.out)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    prepare(ToolUseSettings(out=a.out, seed=a.seed))
    print(" ".join(trainer_overrides(a.out)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
