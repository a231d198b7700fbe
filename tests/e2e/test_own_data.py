"""A new user's first run, end to end on CPU: their own tiny Qwen2 (its own byte-level BPE
tokenizer and ChatML chat template, not the project's fixtures), their data in verl's format
(chat-message prompts with a system turn, nested ground truth, data_source, extra_info) and a
GSM8K file prepared with ``python -m megatron_stare.data.prepare``, and a verl-style
``compute_score(data_source, solution_str, ground_truth, extra_info)``. 2 steps on 2 ranks on each
file: every call's arguments are the rows', and the logged rewards are what the function returned;
on the verl file one data_source is routed to the built-in ``math`` (math-verify) by
``reward.by_source``, in a reward worker process."""

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_stare.config.load import DataConfig
from megatron_stare.data import load_prompts
from megatron_stare.data.prepare import main as prepare_main
from megatron_stare.trainer.metrics import read_metrics
from tests.e2e.harness import _finish, _popen

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5's shape: a default system turn unless the conversation brings its own.
CHATML = ("{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant."
          "<|im_end|>\\n' }}{%- endif %}{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + "
          "m['content'] + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
          "{{- '<|im_start|>assistant\\n' }}{%- endif %}")
STEPS, PROMPTS_PER_STEP, N = 2, 2, 4

VERL_ROWS = [
    {"data_source": ds, "prompt": [{"role": "system", "content": "You are terse."},
                                   {"role": "user", "content": f"What is {a} plus {b}?"}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": gt},
     "extra_info": {"index": i, "split": "train", "level": i + 1}}
    for i, (ds, a, b, gt) in enumerate([("my_math", 17, 31, "\\frac{17}{31}"), ("my_verl", 2, 3, "5"),
                                        ("my_verl", 4, 4, "8"), ("my_math", 9, 1, "\\sqrt{10}")])]
GSM8K_ROWS = [{"question": f"Ann has {a} pens and buys {b}. How many pens?", "answer": f"{a} + {b} = {a + b}\n#### {a + b:,}"}
              for a, b in [(3, 4), (1000, 250), (7, 8), (12, 30)]]

RECORDER = '''
import json, os

def compute_score(data_source, solution_str, ground_truth, extra_info):
    """verl's signature; records every call (one file per process) and returns a dict."""
    score = (len(solution_str) % 3) / 2
    with open(os.path.join(os.environ["OWN_DATA_RECORD"], f"calls_{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps({"rank": int(os.environ["RANK"]), "data_source": data_source, "solution_str": solution_str,
                            "ground_truth": ground_truth, "extra_info": extra_info, "score": score}) + "\\n")
    return {"score": score, "parity": len(solution_str) % 2 == 0, "pred": solution_str[-3:]}
'''


def _tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = [r["prompt"][1]["content"] for r in VERL_ROWS] + [r["question"] + r["answer"] for r in GSM8K_ROWS]
    tk.train_from_iterator(corpus * 3 + ["You are terse. assistant system user think step by step final answer"],
                           trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    tok.save_pretrained(out)
    return tok


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    import torch
    import transformers

    d = tmp_path_factory.mktemp("own_data")
    tok = _tokenizer(d / "model")
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                   bos_token_id=None, tie_word_embeddings=False)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(d / "model", safe_serialization=True)
    transformers.GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).save_pretrained(
        d / "model")
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), str(d / "verl.parquet"))
    (d / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    assert prepare_main(["--format", "gsm8k", str(d / "gsm8k.jsonl"), str(d / "gsm8k.parquet")]) == 0
    (d / "user_code").mkdir()
    (d / "user_code" / "own_reward.py").write_text(RECORDER)
    return d


def _train(assets, run: Path, data: str, *overrides):
    record = run / "calls"
    record.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "megatron_stare.train", "--config", str(ROOT / "examples" / "tiny_cpu.yaml"),
           f"model.path={assets / 'model'}", f"data.train_path={data}", "data.apply_chat_template=true",
           "data.answer_key=reward_model.ground_truth", "data.shuffle=false", "data.max_prompt_length=256",
           f"trainer.total_steps={STEPS}", f"trainer.prompts_per_step={PROMPTS_PER_STEP}", f"rollout.n={N}",
           "rollout.max_new_tokens=6", "reward.fn=own_reward:compute_score", "checkpoint.dir=null", "checkpoint.save_every=0",
           f"logging.dir={run / 'logs'}", "logging.tensorboard=false", *overrides]
    env = {"PYTHONPATH": os.pathsep.join([str(assets / "user_code"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OWN_DATA_RECORD": str(record)}
    _finish(_popen(cmd, run, env), cmd, run, expect=0, timeout=600)
    calls = defaultdict(list)
    for f in sorted(record.iterdir()):
        lines = [json.loads(ln) for ln in f.read_text().splitlines()]
        assert len({c["rank"] for c in lines}) == 1
        calls[lines[0]["rank"]] += lines
    return dict(calls), read_metrics(str(run / "logs" / "metrics.jsonl"))


def _check(rows, calls, metrics, routed_away=()):
    """Every call against the row it scored, in order; the step's logged rewards against the
    returns. Rows are drawn in order (no shuffle), response ``i`` of a step is scored on rank
    ``i % 2`` (rewards/sharded.py), and a rank scores its responses in order."""
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    expected, per_step = defaultdict(list), []
    for step in range(STEPS):
        step_rows = [rows[(step * PROMPTS_PER_STEP + i // N) % len(rows)] for i in range(PROMPTS_PER_STEP * N)]
        counts = {0: 0, 1: 0}
        for i, row in enumerate(step_rows):
            if row["data_source"] not in routed_away:
                expected[i % 2].append(row)
                counts[i % 2] += 1
        per_step.append(counts)
    assert sorted(calls) == [0, 1] and {r: len(c) for r, c in calls.items()} == {r: len(e) for r, e in expected.items()}
    for rank in (0, 1):
        for call, row in zip(calls[rank], expected[rank]):
            assert (call["data_source"], call["ground_truth"], call["extra_info"]) == \
                (row["data_source"], row["reward_model"]["ground_truth"], row["extra_info"])
            # The response alone, decoded without special tokens (as verl passes it).
            assert isinstance(call["solution_str"], str) and "<|im_end|>" not in call["solution_str"]
            assert row["prompt"][-1]["content"] not in call["solution_str"]
    cursor = {0: 0, 1: 0}
    for m, counts in zip(metrics, per_step):
        mine = []
        for rank in (0, 1):
            mine += calls[rank][cursor[rank]:cursor[rank] + counts[rank]]
            cursor[rank] += counts[rank]
        # Rows routed to `math` score 0 here (their answers are out of the untrained model's reach).
        assert m["reward/mean"] == pytest.approx(sum(c["score"] for c in mine) / (PROMPTS_PER_STEP * N), abs=1e-6)
        assert m["reward/parity"] == pytest.approx(
            sum(len(c["solution_str"]) % 2 == 0 for c in mine) / len(mine), abs=1e-9)
        assert "reward/pred" not in m  # not a number: not logged


def test_verl_parquet_with_math_by_source(assets, tmp_path):
    tok_text = load_prompts(str(assets / "verl.parquet"), DataConfig(answer_key="reward_model.ground_truth"),
                            __import__("transformers").AutoTokenizer.from_pretrained(assets / "model"))[0].text
    assert tok_text == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 17 plus 31?"
                        "<|im_end|>\n<|im_start|>assistant\n")  # the row's system turn, not the template's
    calls, metrics = _train(assets, tmp_path, str(assets / "verl.parquet"), "reward.by_source.my_math=math",
                            "reward.num_workers=1")
    _check(VERL_ROWS, calls, metrics, routed_away=("my_math",))


def test_prepared_gsm8k(assets, tmp_path):
    rows = pq.read_table(str(assets / "gsm8k.parquet")).to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "1250", "15", "42"]
    calls, metrics = _train(assets, tmp_path, str(assets / "gsm8k.parquet"))
    _check(rows, calls, metrics)
