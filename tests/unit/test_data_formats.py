"""Dataset readers and verl's row format: JSONL / JSON / Parquet / Arrow directories, one-line
errors for files that are not their format, chat-message prompts, nested keys, validate_file."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_stare.config.load import DataConfig
from megatron_stare.data import DataError, load_prompts, read_rows, validate_file

ROWS = [
    {"prompt": "what is 1 + 2 ?", "answer": "3", "level": 1},
    {"prompt": "what is 2 + 2 ?", "answer": "4", "level": 2},
    {"prompt": "what is 3 + 3 ?", "answer": "6", "level": 3},
]
VERL = [
    {"data_source": "my_math", "prompt": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "what is 1 + 2 ?"}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "3"},
     "extra_info": {"index": 0, "split": "train"}},
    {"data_source": "other", "prompt": [{"role": "user", "content": "what is 2 + 2 ?"}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "4"},
     "extra_info": {"index": 1, "split": "train"}},
]
VERL_CFG = dict(answer_key="reward_model.ground_truth")


@pytest.fixture(scope="module")
def tokenizer():
    """A whitespace word-level tokenizer with a ChatML-like chat template (offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "[UNK] <|im_start|> <|im_end|> system user assistant be brief what is + ? ok".split()
    vocab = {w: i for i, w in enumerate(words + [str(i) for i in range(100)])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]")
    tok.chat_template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant{% endif %}")
    return tok


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def _arrow_stream(path, rows):
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=1)
    return table.schema


def _arrow_dir(path, rows, files=2):
    """What datasets' Dataset.save_to_disk writes: Arrow IPC streams named in state.json."""
    path.mkdir()
    names = [f"data-{k:05d}-of-{files:05d}.arrow" for k in range(files)]
    per = -(-len(rows) // files)
    for k, name in enumerate(names):
        _arrow_stream(path / name, rows[k * per:(k + 1) * per])
    (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                 "_fingerprint": "x", "_split": "train"}))
    (path / "dataset_info.json").write_text("{}")
    return str(path)


def test_every_reader_gives_the_same_rows(tmp_path):
    paths = {
        "jsonl": _jsonl(tmp_path / "a.jsonl", ROWS[:1] + [""] + ROWS[1:]),
        "json": str(tmp_path / "a.json"),
        "parquet": _parquet(tmp_path / "a.parquet", ROWS),
        "arrow_dir": _arrow_dir(tmp_path / "ds", ROWS),
        "arrow": str(tmp_path / "a.arrow"),
    }
    (tmp_path / "a.json").write_text(json.dumps(ROWS, indent=2))
    _arrow_stream(tmp_path / "a.arrow", ROWS)
    got = {k: list(read_rows(p)) for k, p in paths.items()}
    for k, rows in got.items():
        assert [r for _, r, _ in rows] == ROWS, k
    assert [w for w, _, _ in got["jsonl"]] == [f"{paths['jsonl']}:{i}" for i in (1, 3, 4)]
    assert [w for w, _, _ in got["json"]][2] == f"{paths['json']}:item 3"
    assert [w for w, _, _ in got["arrow_dir"]] == [f"{paths['arrow_dir']}:row {i}" for i in (1, 2, 3)]
    assert got["parquet"][2][0] == f"{paths['parquet']}:row 3"


def test_verl_rows_survive_parquet_and_arrow(tmp_path):
    """Nested columns (messages, reward_model, extra_info) come back as the rows gave them."""
    for path in (_parquet(tmp_path / "v.parquet", VERL), _arrow_dir(tmp_path / "v", VERL, files=1),
                 _jsonl(tmp_path / "v.jsonl", VERL)):
        ds = load_prompts(path, DataConfig(**VERL_CFG))
        assert [p.prompt for p in ds] == [r["prompt"] for r in VERL]
        assert [p.answer for p in ds] == ["3", "4"]
        assert [p.metadata for p in ds] == [{k: v for k, v in r.items() if k != "prompt"} for r in VERL]


def _csv(p):
    p.write_text("question,answer\nwhat is 1?,1\n")


def _cp1252(p):
    p.write_bytes(json.dumps(ROWS[0]).encode() + b"\n" + b'{"prompt": "caf\xe9 \x93quoted\x94", "answer": "1"}\n')


def _truncated_jsonl(p):
    p.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1])[:20])


def _truncated_parquet(p):
    _parquet(p, ROWS * 50)
    data = p.read_bytes()
    p.write_bytes(data[:len(data) // 2])


def _truncated_arrow_dir(p):
    _arrow_dir(p, ROWS * 10, files=1)
    f = p / "data-00000-of-00001.arrow"
    data = f.read_bytes()
    f.write_bytes(data[:len(data) * 2 // 3])


def _parquet_named_jsonl(p):
    _parquet(p, ROWS)


def _dataset_dict(p):
    p.mkdir()
    (p / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    _arrow_dir(p / "train", ROWS)
    _arrow_dir(p / "test", ROWS)


FILE_ERRORS = [
    ("csv.parquet", _csv, "not a readable Parquet file: its content is text starting 'question,answer' (CSV?)"),
    ("json.parquet", lambda p: p.write_text(json.dumps(ROWS)), "its content is JSON text"),
    ("cut.parquet", _truncated_parquet, "truncated"),
    ("cp.jsonl", _cp1252, "cp.jsonl:2: not UTF-8 (byte 0xe9 at column 16); re-encode the file as UTF-8"),
    ("cut.jsonl", _truncated_jsonl, "cut.jsonl:2: the file ends mid-row (truncated?)"),
    ("csv.jsonl", _csv, "does not hold JSON lines (line 1 is text starting 'question,answer' (CSV?))"),
    ("pq.jsonl", _parquet_named_jsonl, "is a Parquet file, not JSON lines; name it .parquet"),
    ("empty.jsonl", lambda p: p.write_text("\n\n"), "no rows in"),
    ("empty.parquet", lambda p: pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), str(p)), "no rows in"),
    ("cut_dir", _truncated_arrow_dir, "not a readable Arrow file"),
    ("dd", _dataset_dict, "is a DatasetDict with splits test, train; give one split's directory"),
    ("plain_dir", lambda p: p.mkdir(), "not an Arrow dataset (no state.json or *.arrow files"),
    ("rows.csv", _csv, "unknown format; expected .jsonl"),
]


@pytest.mark.parametrize("name, write, expect", FILE_ERRORS, ids=[n for n, _, _ in FILE_ERRORS])
def test_unreadable_file_is_one_line_naming_it(tmp_path, name, write, expect):
    path = tmp_path / name
    write(path)
    for check in (lambda: load_prompts(str(path), DataConfig(on_malformed="skip")),
                  lambda: validate_file(str(path), DataConfig())):
        with pytest.raises(DataError) as e:
            check()
        msg = str(e.value)
        assert msg.startswith("data: ") and str(path) in msg and "\n" not in msg, msg
        assert expect in msg, msg


def test_no_valid_row_says_so_not_skip(tmp_path, tokenizer):
    long = _jsonl(tmp_path / "long.jsonl", [{"prompt": "what is " + "1 " * 40, "answer": "1"}] * 3)
    with pytest.raises(DataError) as e:
        validate_file(long, DataConfig(max_prompt_length=16), tokenizer)
    assert str(e.value) == (f"data: {long}:1: prompt has 47 tokens, over data.max_prompt_length=16 "
                            f"(and 2 more; no row is valid)")
    empty = _jsonl(tmp_path / "empty_answers.jsonl", [{"prompt": "what is 1 ?", "answer": ""}] * 2)
    with pytest.raises(DataError, match=r"empty_answers.jsonl:1: 'answer' is empty \(and 1 more; no row is valid\)$"):
        load_prompts(empty, DataConfig())
    with pytest.raises(DataError, match=r"no valid rows in .*empty_answers.jsonl \(2 malformed; first: "):
        validate_file(empty, DataConfig(on_malformed="skip"))


def test_nested_keys_and_missing_key_lists_the_columns(tmp_path):
    path = _parquet(tmp_path / "v.parquet", VERL)
    with pytest.raises(DataError) as e:
        load_prompts(path, DataConfig())
    assert str(e.value) == (
        f"data: {path}:row 1: missing key 'answer' (data.answer_key; columns: data_source, prompt, ability, "
        "reward_model{style, ground_truth}, extra_info{index, split}); verl's format: set "
        "data.answer_key=reward_model.ground_truth (and 1 more; no row is valid)")
    deep = _jsonl(tmp_path / "deep.jsonl", [{"q": {"text": "what is 1 ?"}, "a": {"b": {"c": 7}}, "a.b": "dotted"}])
    p = load_prompts(deep, DataConfig(prompt_key="q.text", answer_key="a.b.c"))[0]
    assert (p.prompt, p.answer, p.ground_truth) == ("what is 1 ?", "7", 7)
    assert load_prompts(deep, DataConfig(prompt_key="q.text", answer_key="a.b"))[0].answer == "dotted"


def test_messages_rendered_with_the_template_turns_kept(tmp_path, tokenizer):
    path = _parquet(tmp_path / "v.parquet", VERL)
    ds = load_prompts(path, DataConfig(**VERL_CFG, system_prompt="ignored for messages"), tokenizer)
    assert ds[0].text == ("<|im_start|> system be brief <|im_end|> <|im_start|> user what is 1 + 2 ? <|im_end|> "
                          "<|im_start|> assistant")
    assert ds[1].text == "<|im_start|> user what is 2 + 2 ? <|im_end|> <|im_start|> assistant"
    assert ds[0].token_ids == tokenizer(ds[0].text, add_special_tokens=False)["input_ids"]
    assert ds[0].metadata["data_source"] == "my_math" and ds[0].metadata["extra_info"] == {"index": 0, "split": "train"}


def test_system_prompt_for_string_prompts(tmp_path, tokenizer):
    path = _jsonl(tmp_path / "s.jsonl", ROWS[:1])
    p = load_prompts(path, DataConfig(system_prompt="be brief"), tokenizer)[0]
    assert p.text == ("<|im_start|> system be brief <|im_end|> <|im_start|> user what is 1 + 2 ? <|im_end|> "
                      "<|im_start|> assistant")
    raw = load_prompts(path, DataConfig(system_prompt="be brief", apply_chat_template=False), tokenizer)[0]
    assert raw.text == "be brief\n\nwhat is 1 + 2 ?"


def test_messages_without_a_template_are_refused(tmp_path, tokenizer):
    path = _jsonl(tmp_path / "v.jsonl", VERL)
    no_template = type(tokenizer)(tokenizer_object=tokenizer.backend_tokenizer)
    cases = [(DataConfig(**VERL_CFG, apply_chat_template=False), tokenizer, "data.apply_chat_template=false"),
             (DataConfig(**VERL_CFG, apply_chat_template=False), None, "data.apply_chat_template=false"),
             (DataConfig(**VERL_CFG, on_malformed="skip"), no_template, "the tokenizer has no chat template")]
    for cfg, tok, why in cases:
        for fn in (load_prompts, validate_file):
            with pytest.raises(DataError) as e:
                fn(path, cfg, tok)
            assert str(e.value) == (f"data: {path}:1: prompts are chat messages, which need a chat template, but "
                                    f"{why}; set data.apply_chat_template=true with a tokenizer that has a "
                                    f"chat_template, or give string prompts")
    assert load_prompts(path, DataConfig(**VERL_CFG))[0].text == ""  # no tokenizer: inspection only


BAD_MESSAGES = [
    ([], "'prompt' is an empty list of messages"),
    ([{"role": "user"}], "'prompt' message 1 must be {'role': str, 'content': str}, got ['role']"),
    (["hi"], "'prompt' message 1 must be {'role': str, 'content': str}, got str"),
    ([{"role": "user", "content": " "}], "'prompt': every message is empty"),
]


@pytest.mark.parametrize("prompt, problem", BAD_MESSAGES, ids=[p for _, p in BAD_MESSAGES])
def test_malformed_messages(tmp_path, tokenizer, prompt, problem):
    path = _jsonl(tmp_path / "m.jsonl", VERL + [{**VERL[0], "prompt": prompt}])
    with pytest.raises(DataError) as e:
        load_prompts(path, DataConfig(**VERL_CFG), tokenizer)
    assert str(e.value) == f"data: {path}:3: {problem}"


def test_validate_file_reports_what_load_prompts_does(tmp_path, tokenizer):
    rows = ROWS + [{"prompt": "x"}, "{oops", {"prompt": "what is " + "1 " * 40, "answer": "1"}] + ROWS
    path = _jsonl(tmp_path / "mixed.jsonl", rows)
    skip = DataConfig(max_prompt_length=16, on_malformed="skip")
    report = validate_file(path, skip, tokenizer)
    assert (report.path, report.num_rows, report.num_valid, report.num_bad) == (path, 9, 6, 3)
    assert [w for w, _ in report.first_bad] == [f"{path}:{i}" for i in (4, 5, 6)]
    assert report.first_bad[0][1].startswith("missing key 'answer'")
    assert report.first_bad[2][1] == "prompt has 47 tokens, over data.max_prompt_length=16"
    assert len(load_prompts(path, skip, tokenizer)) == report.num_valid
    for fn in (load_prompts, validate_file):
        with pytest.raises(DataError) as e:
            fn(path, DataConfig(max_prompt_length=16), tokenizer)
        assert str(e.value).startswith(f"data: {path}:4: missing key 'answer'") and "(and 2 more;" in str(e.value)
    assert os.path.getsize(path) > 0
