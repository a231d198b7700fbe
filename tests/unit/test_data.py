"""Prompt datasets: JSONL/Parquet loading, malformed rows, chat templates, sampler, DP shards, resume."""

import json
import logging

import pytest

from megatron_stare.config.load import DataConfig
from megatron_stare.data import DataError, PromptSampler, load_prompts, shard_for_rank

ROWS = [
    {"prompt": "what is 1 + 2 ?", "answer": "3", "level": 1},
    {"prompt": "what is 2 + 2 ?", "answer": 4, "level": 2, "source": "x"},
    {"prompt": "sort the digits 3 1 2 ascending", "answer": "1 2 3", "level": 1},
]


@pytest.fixture(scope="module")
def tokenizer():
    """A whitespace word-level tokenizer with a BOS post-processor and a chat template (offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = "[UNK] <s> <|user|> <|assistant|> what is + ? sort the digits ascending".split()
    vocab = {w: i for i, w in enumerate(words + [str(i) for i in range(100)])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", bos_token="<s>")
    tok.chat_template = ("{% for m in messages %}<|user|> {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return tok


def _jsonl(path, lines):
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return str(path)


def test_jsonl_and_parquet_load_the_same_rows(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    cfg = DataConfig(max_prompt_length=32)
    pq_path = str(tmp_path / "train.parquet")
    cols = ["prompt", "answer", "level", "source"]  # Parquet: every row has every column (None)
    table = {c: [str(r[c]) if c == "answer" else r.get(c) for r in ROWS] for c in cols}
    pq.write_table(pa.Table.from_pydict(table), pq_path)
    a = load_prompts(_jsonl(tmp_path / "train.jsonl", ROWS[:1] + [""] + ROWS[1:]), cfg, tokenizer)
    b = load_prompts(pq_path, cfg, tokenizer)
    key = lambda p: (p.prompt, p.answer, p.text, p.token_ids, {k: v for k, v in p.metadata.items() if v is not None})
    assert [key(p) for p in a] == [key(p) for p in b]
    assert [p.answer for p in a] == ["3", "4", "1 2 3"]
    assert a[1].metadata == {"level": 2, "source": "x"}
    assert [p.source.rsplit(":", 1)[1] for p in a] == ["1", "3", "4"]  # physical lines; blank skipped
    assert b[2].source.endswith("train.parquet:row 3")


def test_chat_template_applied_when_present(tmp_path, tokenizer):
    path = _jsonl(tmp_path / "t.jsonl", ROWS[:1])
    templated = load_prompts(path, DataConfig(), tokenizer)[0]
    assert templated.text == "<|user|> what is 1 + 2 ? <|assistant|>"
    assert templated.token_ids == tokenizer(templated.text, add_special_tokens=False)["input_ids"]
    raw = load_prompts(path, DataConfig(apply_chat_template=False), tokenizer)[0]
    assert raw.text == "what is 1 + 2 ?" and raw.token_ids[0] == 1  # raw prompts get the BOS
    tokenizer_without = type(tokenizer)(tokenizer_object=tokenizer.backend_tokenizer, bos_token="<s>")
    assert load_prompts(path, DataConfig(), tokenizer_without)[0].text == "what is 1 + 2 ?"
    assert load_prompts(path, DataConfig())[0].token_ids == []  # no tokenizer: inspection only


BAD = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ({"answer": "1"}, "missing key 'prompt'"),
    ({"prompt": 5, "answer": "1"}, "'prompt' must be a string or a list of chat messages, got int"),
    ({"prompt": "  ", "answer": "1"}, "'prompt' is empty"),
    ({"prompt": "what is 1 ?"}, "missing key 'answer'"),
    ({"prompt": "what is 1 ?", "answer": [1]}, "'answer' must be a string or a number, got list"),
    ({"prompt": "what is " + "1 " * 40, "answer": "1"}, "prompt has 44 tokens, over data.max_prompt_length=16"),
]


@pytest.mark.parametrize("bad, problem", BAD, ids=[p for _, p in BAD])
def test_malformed_row_fails_with_file_line(tmp_path, tokenizer, bad, problem):
    path = _jsonl(tmp_path / "train.jsonl", ROWS[:2] + ["", bad, ROWS[2], bad])
    with pytest.raises(DataError) as e:
        load_prompts(path, DataConfig(max_prompt_length=16), tokenizer)
    msg = str(e.value)
    assert msg.startswith(f"data: {path}:4: {problem}") and "(and 1 more;" in msg and "\n" not in msg


def test_malformed_rows_skipped_with_one_warning(tmp_path, tokenizer, caplog):
    lines = list(ROWS)
    for bad, _ in BAD:
        lines.insert(1, bad)
    path = _jsonl(tmp_path / "train.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="megatron_stare.data"):
        ds = load_prompts(path, DataConfig(max_prompt_length=16, on_malformed="skip"), tokenizer)
    assert [p.prompt for p in ds] == [r["prompt"] for r in ROWS] and ds.num_skipped == len(BAD)
    (rec,) = [r for r in caplog.records if r.name == "megatron_stare.data"]
    assert f"skipped {len(BAD)} malformed row(s)" in rec.getMessage()
    assert f"{path}:2: prompt has 44 tokens" in rec.getMessage() and rec.getMessage().endswith("; ...")


def test_empty_or_missing_file(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        load_prompts(str(tmp_path / "nope.jsonl"), DataConfig())
    with pytest.raises(DataError, match="no valid rows"):
        load_prompts(_jsonl(tmp_path / "e.jsonl", [{"x": 1}]), DataConfig(on_malformed="skip"))


def test_sampler_deterministic_and_covers_epochs():
    a, b = PromptSampler(10, 4, seed=7), PromptSampler(10, 4, seed=7)
    batches = [a.next_batch() for _ in range(5)]
    assert batches == [b.next_batch() for _ in range(5)]
    flat = sum(batches, [])
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert flat[:10] != flat[10:20]  # a new permutation per epoch
    assert PromptSampler(10, 4, seed=8).next_batch() != batches[0]
    assert PromptSampler(5, 4, shuffle=False).next_batch() == [0, 1, 2, 3]
    assert PromptSampler(3, 8, shuffle=False).next_batch() == [0, 1, 2, 0, 1, 2, 0, 1]


def test_sampler_resume_reproduces_following_batches():
    ref = PromptSampler(13, 5, seed=1)
    for _ in range(3):
        ref.next_batch()
    state = json.loads(json.dumps(ref.state_dict()))  # as a checkpoint would store it
    expected = [ref.next_batch() for _ in range(6)]
    resumed = PromptSampler(13, 5, seed=1)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(6)] == expected
    with pytest.raises(DataError, match="checkpoint has num_prompts=13, this run has 12"):
        PromptSampler(12, 5, seed=1).load_state_dict(state)


def test_shards_partition_the_batch():
    batch = PromptSampler(50, 12, seed=0).next_batch()
    shards = [shard_for_rank(batch, r, 4) for r in range(4)]
    assert sum(shards, []) == batch and all(len(s) == 3 for s in shards)
    with pytest.raises(DataError, match="does not split over 5 data-parallel ranks"):
        shard_for_rank(batch, 0, 5)
