"""Dataset readers: JSONL / JSON, Parquet and Arrow dataset directories -> rows, streamed.

``read_rows(path)`` yields ``(location, row, problem)`` for every row in file order: ``row`` a
dict (``problem`` None) or a row that did not parse (``row`` None, ``problem`` says why). The
location is ``file:line`` (JSON lines, 1-based physical line; blank lines are skipped),
``file:item N`` (a ``.json`` file holding one JSON array) or ``file:row N`` (Parquet, Arrow;
1-based). Formats, by name:

- ``.jsonl`` / ``.ndjson`` / ``.json``: one JSON object per line, or (``.json``) one array of
  objects; UTF-8 (a leading BOM is accepted).
- ``.parquet``: read one record batch at a time (``pyarrow`` ``iter_batches``).
- a directory written by ``datasets``' ``Dataset.save_to_disk`` (``state.json`` naming its
  ``data-*.arrow`` files, Arrow IPC streams), read with pyarrow alone (``datasets`` is not a
  dependency); ``.arrow``: one such file.

A file that cannot be read as its format - content of another format (CSV text named
``.parquet``, a Parquet file named ``.jsonl``), bytes that are not UTF-8, a file cut off
mid-row - raises one ``DataError`` line naming the file (and the line) and the fix; the reader
never guesses around it. A row-level problem (one line that is not JSON) is the caller's to
report or skip (``data.on_malformed``).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

from megatron_stare.errors import UserError

__all__ = ["DataError", "JSON_SUFFIXES", "read_rows"]

#: File names read as JSON lines (or, ``.json``, one JSON array).
JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
#: Rows per Parquet / Arrow record batch read at once.
BATCH_ROWS = 1024

Row = Tuple[str, Optional[Dict[str, Any]], Optional[str]]


class DataError(UserError):
    """A dataset problem; ``str()`` is one line naming the file and row."""

    def __init__(self, msg: str) -> None:
        super().__init__(f"data: {msg}")


def read_rows(path: str) -> Iterator[Row]:
    """``(location, row, problem)`` of every row of ``path`` (see the module docstring)."""
    if os.path.isdir(path):
        yield from _arrow_dir_rows(path)
        return
    if not os.path.isfile(path):
        raise DataError(f"file not found: {path}")
    lower = path.lower()
    if lower.endswith(".parquet"):
        yield from _parquet_rows(path)
    elif lower.endswith(".arrow"):
        yield from _arrow_file_rows(path, path, 0)
    elif lower.endswith(JSON_SUFFIXES):
        yield from _json_rows(path)
    else:
        raise DataError(f"{path}: unknown format; expected .jsonl, .json, .parquet, .arrow or a directory "
                        f"written by datasets' save_to_disk")


def _sniff(path: str) -> str:
    """What the first bytes of ``path`` look like, for errors about a misnamed file."""
    with open(path, "rb") as f:
        head = f.read(64)
    if head.startswith(b"PAR1"):
        return "a Parquet file"
    if head.startswith(b"ARROW1") or head.startswith(b"\xff\xff\xff\xff"):
        return "an Arrow file"
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if text.startswith((b"{", b"[")):
        return "JSON text"
    if not head:
        return "empty"
    try:
        first = head.decode("utf-8").splitlines()[0]
    except (UnicodeDecodeError, IndexError):
        return "binary data"
    return f"text starting {first[:30]!r}" + (" (CSV?)" if "," in first else "")


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


# ------------------------------------------------------------------------------------------------
def _json_rows(path: str) -> Iterator[Row]:
    kind = _sniff(path)
    if kind in ("a Parquet file", "an Arrow file"):
        raise DataError(f"{path}: is {kind}, not JSON lines; name it .{'parquet' if 'Parquet' in kind else 'arrow'}")
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if path.lower().endswith(".json") and head.startswith(b"["):
        yield from _json_array_rows(path)
        return
    seen_row = False
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = _decode(raw, path, lineno)
            if lineno == 1:
                line = line.lstrip("\ufeff")
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                if not raw.endswith(b"\n") and line.lstrip().startswith(("{", "[")):
                    raise DataError(f"{where}: the file ends mid-row (truncated?): {e.msg}; "
                                    f"copy or write it again") from None
                if not seen_row and not line.lstrip().startswith(("{", "[")):
                    raise DataError(f"{path}: does not hold JSON lines (line {lineno} is {_sniff(path)}); "
                                    f"give .jsonl with one JSON object per line, or .parquet")
                seen_row = True
                yield where, None, f"not valid JSON ({e.msg} at column {e.colno})"
                continue
            seen_row = True
            yield where, *_as_object(row)


def _decode(raw: bytes, path: str, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}:{lineno}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                        f"re-encode the file as UTF-8, e.g. iconv -f cp1252 -t utf-8") from None


def _json_array_rows(path: str) -> Iterator[Row]:
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8").lstrip("\ufeff")
    except UnicodeDecodeError as e:
        lineno = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:{lineno}: not UTF-8 (byte 0x{data[e.start]:02x}); "
                        f"re-encode the file as UTF-8, e.g. iconv -f cp1252 -t utf-8") from None
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        cut = " (truncated?)" if e.pos >= len(text.rstrip()) else ""
        raise DataError(f"{path}:{e.lineno}: not a valid JSON array{cut}: {e.msg} at column {e.colno}") from None
    for i, row in enumerate(items, 1):
        yield f"{path}:item {i}", *_as_object(row)


def _as_object(row: Any) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    if isinstance(row, dict):
        return row, None
    return None, f"expected a JSON object, got {type(row).__name__}"


# ------------------------------------------------------------------------------------------------
def _parquet_rows(path: str) -> Iterator[Row]:
    import pyarrow.parquet as pq  # lazily: pyarrow is only needed for these formats

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for anything unreadable
        kind = _sniff(path)
        why = ("truncated (no Parquet footer); copy or write it again" if kind == "a Parquet file"
               else f"its content is {kind}; give it the name of its format")
        raise DataError(f"{path}: not a readable Parquet file: {why} (pyarrow: {_first_line(e)})") from None
    i = 0
    try:
        for batch in pf.iter_batches(batch_size=BATCH_ROWS):
            for row in batch.to_pylist():
                i += 1
                yield f"{path}:row {i}", row, None
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{path}:row {i + 1}: cannot read the Parquet data (truncated or corrupt?): "
                        f"{_first_line(e)}") from None


def _arrow_file_rows(path: str, name: str, start: int) -> Iterator[Row]:
    """Rows of one Arrow IPC file (stream format, as ``save_to_disk`` writes, or file format)."""
    import pyarrow as pa

    i = start
    try:
        source = pa.memory_map(path)
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            source = pa.memory_map(path)
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(k) for k in range(reader.num_record_batches))
        else:
            batches = iter(reader)
        for batch in batches:
            for k in range(0, batch.num_rows, BATCH_ROWS):
                for row in batch.slice(k, BATCH_ROWS).to_pylist():
                    i += 1
                    yield f"{name}:row {i}", row, None
    except DataError:
        raise
    except Exception as e:
        kind = _sniff(path)
        raise DataError(f"{path}: not a readable Arrow file after row {i - start} (truncated or corrupt? "
                        f"its content is {kind}; pyarrow: {_first_line(e)})") from None


def _arrow_dir_rows(path: str) -> Iterator[Row]:
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        splits = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
        raise DataError(f"{path}: is a DatasetDict with splits {', '.join(splits)}; give one split's "
                        f"directory, e.g. {os.path.join(path, splits[0] if splits else 'train')}")
    files = _arrow_dir_files(path)
    n = 0
    for f in files:
        for where, row, problem in _arrow_file_rows(f, path, n):
            n += 1
            yield where, row, problem


def _arrow_dir_files(path: str) -> List[str]:
    state = os.path.join(path, "state.json")
    if os.path.isfile(state):
        try:
            with open(state, encoding="utf-8") as f:
                names = [d["filename"] for d in json.load(f)["_data_files"]]
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{state}: not a datasets state.json ({_first_line(e)})") from None
        files = [os.path.join(path, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise DataError(f"{path}: state.json names {missing[0]}, which is missing (copy the whole directory)")
        return files
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".arrow"))
    if not files:
        raise DataError(f"{path}: a directory, but not an Arrow dataset (no state.json or *.arrow files; "
                        f"write it with datasets' Dataset.save_to_disk, or give a .jsonl / .parquet file)")
    return files
