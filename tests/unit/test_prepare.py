"""``python -m megatron_stare.data.prepare``: GSM8K, MATH / MATH-500, DAPO-Math-17k and AIME files as
users have them -> verl's format, which load_prompts reads with verl's keys."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_stare.config.load import DataConfig
from megatron_stare.data import DataError, load_prompts
from megatron_stare.data.prepare import DAPO_TEMPLATE, GSM8K_INSTRUCTION, MATH_INSTRUCTION, main, prepare

ROOT = Path(__file__).resolve().parents[2]
VERL_KEYS = DataConfig(answer_key="reward_model.ground_truth")

GSM8K = [
    {"question": "Tom has 3 apples and buys 1,200 more. How many?",
     "answer": "He has 3 + 1200 = <<3+1200=1203>>1203.\n#### 1,203"},
    {"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"},
]
MATH = [
    {"problem": "Simplify $\\frac{2}{4}$.", "solution": "We get $\\boxed{\\frac{1}{2}}$.", "level": "Level 1",
     "type": "Algebra"},
    {"problem": "Find $x$.", "solution": "First \\boxed{3}, no: $x = \\boxed{\\sqrt{\\frac{a}{b}}}$ is it.",
     "level": "Level 5", "type": "Algebra"},
]
MATH500 = [{"problem": "What is $1+1$?", "solution": "It is $\\boxed{2}$.", "answer": "2", "subject": "Prealgebra",
            "level": 1, "unique_id": "test/prealgebra/1.json"}]
DAPO_VERL = [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": "Solve 1+1. Answer: ..."}],
              "ability": "MATH", "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
              "extra_info": {"index": "a1b2"}}]
DAPO_RAW = [{"prompt": "Compute $3 \\cdot 4$.", "solution": "12", "data_source": "math_dapo", "ability": "MATH",
             "extra_info": {"index": "c3"}}]
AIME_RAW = [{"ID": "2024-I-1", "Problem": "Find the remainder.", "Solution": "long ... so 204", "Answer": 204},
            {"ID": "2024-I-2", "Problem": "Find $xy$.", "Solution": "... 25", "Answer": 25}]
AIME_H4 = [{"id": 60, "problem": "Every morning Aya walks.", "solution": "...", "answer": "204", "url": "u",
            "year": "2024"}]


def _write(path, rows):
    path = Path(path)
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), str(path))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:  # an Arrow directory as datasets' save_to_disk writes it
        path.mkdir()
        table = pa.Table.from_pylist(rows)
        with pa.OSFile(str(path / "data-00000-of-00001.arrow"), "wb") as sink, \
                pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    return str(path)


def _prepared(tmp_path, fmt, rows, name, **kw):
    out = str(tmp_path / f"{fmt}_out.parquet")
    n, skipped = prepare(fmt, _write(tmp_path / name, rows), out, **kw)
    assert (n, skipped) == (len(rows), 0)
    return pq.read_table(out).to_pylist(), load_prompts(out, VERL_KEYS)


def test_gsm8k(tmp_path):
    rows, ds = _prepared(tmp_path, "gsm8k", GSM8K, "gsm8k.jsonl", split="test")
    assert rows[0] == {"data_source": "openai/gsm8k",
                       "prompt": [{"role": "user", "content": f"{GSM8K[0]['question']} {GSM8K_INSTRUCTION}"}],
                       "ability": "math", "reward_model": {"style": "rule", "ground_truth": "1203"},
                       "extra_info": {"split": "test", "index": 0, "answer": GSM8K[0]["answer"],
                                      "question": GSM8K[0]["question"]}}
    assert [p.answer for p in ds] == ["1203", "4"] and ds[1].metadata["extra_info"]["index"] == 1


def test_math_nested_boxed_and_math500(tmp_path):
    rows, ds = _prepared(tmp_path, "math", MATH, "math.json")
    assert [p.answer for p in ds] == ["\\frac{1}{2}", "\\sqrt{\\frac{a}{b}}"]  # the LAST box, braces whole
    assert rows[0]["prompt"][0]["content"] == f"{MATH[0]['problem']} {MATH_INSTRUCTION}"
    assert rows[1]["extra_info"] == {"split": "train", "index": 1, "level": "Level 5", "type": "Algebra"}
    assert rows[0]["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    rows, _ = _prepared(tmp_path, "math", MATH500, "math500.parquet", split="test")
    assert rows[0]["reward_model"]["ground_truth"] == "2" and rows[0]["data_source"] == "HuggingFaceH4/MATH-500"
    assert rows[0]["extra_info"] == {"split": "test", "index": 0, "level": 1, "subject": "Prealgebra",
                                     "unique_id": "test/prealgebra/1.json"}


def test_dapo_verl_format_kept_and_raw_columns_wrapped(tmp_path):
    rows, ds = _prepared(tmp_path, "dapo", DAPO_VERL, "dapo.parquet")
    assert rows == DAPO_VERL and ds[0].answer == "2"
    rows, _ = _prepared(tmp_path, "dapo", DAPO_RAW, "dapo_raw.jsonl")
    assert rows[0]["prompt"] == [{"role": "user", "content": DAPO_TEMPLATE.format(problem=DAPO_RAW[0]["prompt"])}]
    assert rows[0]["reward_model"] == {"style": "rule", "ground_truth": "12"}
    assert rows[0]["extra_info"] == {"index": 0, "split": "train"} and rows[0]["data_source"] == "math_dapo"
    # open-r1's processed copy: the bare problem in `prompt` beside a reward_model column.
    rows, _ = _prepared(tmp_path, "dapo", [{**DAPO_RAW[0], "reward_model": {"ground_truth": "12", "style": "rule"}}],
                        "dapo_r1.parquet")
    assert rows[0]["prompt"][0]["content"] == DAPO_TEMPLATE.format(problem=DAPO_RAW[0]["prompt"])
    assert rows[0]["reward_model"]["ground_truth"] == "12" and rows[0]["extra_info"] == {"index": "c3"}


def test_aime_raw_copies_and_data_source_override(tmp_path):
    rows, ds = _prepared(tmp_path, "aime", AIME_RAW, "aime_dir", data_source="aime_2024", split="test")
    assert [p.answer for p in ds] == ["204", "25"] and {r["data_source"] for r in rows} == {"aime_2024"}
    assert rows[1]["prompt"][0]["content"] == DAPO_TEMPLATE.format(problem="Find $xy$.")
    rows, _ = _prepared(tmp_path, "aime", AIME_H4, "aime_h4.jsonl")
    assert rows[0]["reward_model"]["ground_truth"] == "204" and rows[0]["data_source"] == "aime"


def test_bad_rows_are_one_line_or_skipped(tmp_path, capsys):
    src = _write(tmp_path / "g.jsonl", GSM8K + [{"question": "no final line", "answer": "just 5"}])
    out = str(tmp_path / "g.parquet")
    assert main(["--format", "gsm8k", src, out]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: data: {src}:3: the answer has no '#### N' final line "
                   f"(--on-malformed skip drops such rows)\n")
    assert main(["--format", "gsm8k", "--on-malformed", "skip", src, out]) == 0
    assert "wrote 2 rows" in capsys.readouterr().out and pq.read_table(out).num_rows == 2
    with pytest.raises(DataError, match=r"m.jsonl:1: --format math needs a string problem \(problem\); "
                                        r"the row has: question, answer"):
        prepare("math", _write(tmp_path / "m.jsonl", GSM8K), out)


def test_module_entry_point(tmp_path):
    src = _write(tmp_path / "g.jsonl", GSM8K)
    out = tmp_path / "sub" / "g.parquet"
    run = subprocess.run([sys.executable, "-m", "megatron_stare.data.prepare", "--format", "gsm8k", src, str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"prepare: wrote 2 rows to {out}") and pq.read_table(str(out)).num_rows == 2
