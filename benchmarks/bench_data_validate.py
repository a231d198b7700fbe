"""``validate_file`` on a DAPO-Math-17k-sized file: the preflight's data check must take < 10 s.

Setup: ``--rows`` rows (17,000) in verl's format (one user message of DAPO's instruction and a
problem, ~600 characters; nested ``reward_model.ground_truth``; ``extra_info``) written as
Parquet and as JSONL; each validated ``--repeats`` times with the tiny model's byte-level BPE
tokenizer (``megatron_stare.models.tiny``; its 397-token vocabulary makes ~3x more tokens per
character than a real one: a pessimistic case) and the chat template applied, and once without
a tokenizer. Prints the median seconds per file and the goal's verdict; ``--out FILE`` writes
them as JSON. Usage: ``OMP_NUM_THREADS=1 python benchmarks/bench_data_validate.py [--rows 17000]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

GOAL_S = 10.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=17000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from megatron_stare.config.load import DataConfig
    from megatron_stare.data import validate_file
    from megatron_stare.data.prepare import DAPO_TEMPLATE
    from megatron_stare.models.tiny import build_tiny_hf_model

    d = Path(tempfile.mkdtemp(prefix="bench_data_"))
    tok = AutoTokenizer.from_pretrained(build_tiny_hf_model("qwen2", d / "model"))
    rows = [{"data_source": "math_dapo", "ability": "MATH", "extra_info": {"index": i},
             "prompt": [{"role": "user", "content": DAPO_TEMPLATE.format(
                 problem=f"Let x be a real number such that {i} x + 3 = 11. Find x^2 + {i % 97}.")}],
             "reward_model": {"style": "rule", "ground_truth": str(i)}} for i in range(args.rows)]
    pq.write_table(pa.Table.from_pylist(rows), str(d / "train.parquet"))
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(answer_key="reward_model.ground_truth", max_prompt_length=2048)
    results = {}
    for name in ("train.parquet", "train.jsonl"):
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            report = validate_file(str(d / name), cfg, tok)
            times.append(time.perf_counter() - t)
        assert report.num_valid == args.rows
        t = time.perf_counter()
        validate_file(str(d / name), cfg)
        results[name] = {"tokenizer_s": statistics.median(times), "no_tokenizer_s": time.perf_counter() - t}
        r = results[name]
        print(f"{name}: {args.rows} rows, with the chat template and tokenizer {r['tokenizer_s']:.2f} s "
              f"(goal < {GOAL_S:.0f} s: {'met' if r['tokenizer_s'] < GOAL_S else 'MISSED'}), "
              f"without a tokenizer {r['no_tokenizer_s']:.2f} s")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": args.rows, "results": results}, indent=2))


if __name__ == "__main__":
    main()
