"""The one bucket format and wire protocol (``megatron_stare.weight_sync``), and the rule that no
module outside the package defines its own bucket, header or collective plumbing."""

from __future__ import annotations

import ast
import json
import pickle
from pathlib import Path

import pytest
import torch

from megatron_stare.weight_sync import (ALIGN_BYTES, HEADER_VERSION, Assembler, FlatBucket, StagingBuffer,
                                        TensorMeta, assemble, decode_header, encode_header, pack_stream,
                                        recv_bucket, send_bucket, send_end)

ROOT = Path(__file__).resolve().parents[2]


def _mixed():
    g = torch.Generator().manual_seed(1)
    return [
        ("w.bf16", torch.randn(5, 3, generator=g).to(torch.bfloat16)),
        ("w.f16", torch.randn(7, generator=g).to(torch.float16)),
        ("scalar.f32", torch.tensor(-2.25)),
        ("empty.f32", torch.empty(0, 3)),
        ("ids.i64", torch.arange(9, dtype=torch.int64).reshape(3, 3)),
        ("mask.bool", torch.tensor([[True, False], [False, True]])),
        ("scalar.bf16", torch.tensor(1.5, dtype=torch.bfloat16)),
        ("big.f64", torch.randn(40, 10, generator=g, dtype=torch.float64)),   # 3200 B
        ("t.f32", torch.arange(12.0).reshape(3, 4).t()),                        # non-contiguous
    ]


def _check_same(got, want):
    assert [n for n, _ in got] == [n for n, _ in want]
    for (n, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, n
        assert torch.equal(a, b), n


def test_pack_header_bytes_round_trip_is_bit_exact():
    named = _mixed()
    packed = FlatBucket.pack(named)
    # What a receiver sees: header bytes and a byte copy of the buffer, nothing else.
    metas = decode_header(bytes(packed.header()), packed.nbytes)
    rebuilt = FlatBucket(metas, packed.buffer.clone())
    _check_same(list(rebuilt), named)
    assert all(m.offset % ALIGN_BYTES == 0 for m in metas)
    assert json.loads(packed.header())["v"] == HEADER_VERSION


@pytest.mark.parametrize("bucket_bytes", [512, 1024, 4096, 1 << 20])
def test_pack_stream_round_trip_and_size_bound(bucket_bytes):
    named = _mixed()
    largest = max(t.numel() * t.element_size() for _, t in named)
    got, sizes = [], []
    for b in pack_stream(iter(named), bucket_bytes, torch.device("cpu")):
        sizes.append(b.nbytes)
        assert b.nbytes <= max(bucket_bytes, largest)
        assert decode_header(b.header(), b.nbytes) == b.metas
        got += [(n, t.clone()) for n, t in b]
        del b
    _check_same(got, named)
    if bucket_bytes < largest:
        assert len(sizes) > 1  # the bound actually split the stream


def test_wire_round_trip_over_a_recording_link():
    named = _mixed()
    sent = []
    for b in pack_stream(iter(named), 1024, torch.device("cpu")):
        send_bucket(lambda t: sent.append(t.clone()), b, torch.device("cpu"))
    send_end(lambda t: sent.append(t.clone()), torch.device("cpu"))
    replay = iter(sent)
    link = lambda t: t.copy_(next(replay))  # noqa: E731
    got, staging = [], StagingBuffer(torch.device("cpu"))
    while (b := recv_bucket(link, torch.device("cpu"), staging)) is not None:
        got += [(n, t.clone()) for n, t in b]
        del b
    _check_same(got, named)
    assert next(replay, None) is None  # the end marker was the last transfer


def _header(rows, v=HEADER_VERSION):
    return json.dumps({"v": v, "tensors": rows}).encode()


@pytest.mark.parametrize("data,match", [
    (_header([], v=0), "version 0, expected"),
    (json.dumps([["a", "float32", [1], 0, 4]]).encode(), "no version field"),
    (pickle.dumps([("a", "float32", (1,), 0, 4)]), "not JSON"),          # the old pickle header
    (_header([["a", "float32", [2]]]), "entry 0 is not"),
    (_header([["a", "complex64", [1], 0, 8]]), "unsupported tensor dtype"),
    (_header([["a", "bfloat16", [3], 0, 4]]), "do not hold a bfloat16 tensor of shape"),
    (_header([["a", "float32", [1], 0, 4], ["b", "float32", [1], 0, 4]]), "overlaps"),
    (_header([["a", "float32", [1], 8, 4]]), "aligned"),
    (_header([["a", "float32", [100], 0, 400]]), "outside the 256-byte buffer"),
])
def test_bad_headers_fail_in_one_line(data, match):
    with pytest.raises(ValueError, match=match) as e:
        decode_header(data, 256)
    assert "\n" not in str(e.value) and str(e.value).startswith("weight bucket header rejected: ")


def test_header_encodes_the_metas_exactly():
    metas = [TensorMeta("x", "bfloat16", (2, 0), 0, 0), TensorMeta("y", "float32", (), 256, 4),
             TensorMeta("z", "float32", (2, 3), 512, 24, (5, 6), (1, 3))]  # a piece
    assert decode_header(encode_header(metas), 768) == metas
    assert [m.is_piece for m in metas] == [False, False, True]


@pytest.mark.parametrize("row,match", [
    (["a", "float32", [2, 3], 0, 24, [5, 6], [4, 0]], "does not lie inside"),   # rows 4..6 of 5
    (["a", "float32", [2, 3], 0, 24, [5, 6], [0, 4]], "does not lie inside"),   # cols 4..7 of 6
    (["a", "float32", [2, 3], 0, 24, [6], [0]], "does not lie inside"),         # rank differs
    (["a", "float32", [2, 3], 0, 24, [5, 6]], "entry 0 is not"),               # 6 fields
    (["a", "float32", [2, 3], 0, 24, [5, 6], [0, -1]], "entry 0 is not"),
])
def test_bad_piece_headers_fail_in_one_line(row, match):
    with pytest.raises(ValueError, match=match):
        decode_header(_header([row]), 256)


def _pieces(whole: torch.Tensor, name: str, cuts):
    """``whole`` as pieces ``[(rows, cols)]`` blocks, packed one bucket per entry of ``cuts``
    (a list of lists of ((r0, r1), (c0, c1)))."""
    buckets = []
    for blocks in cuts:
        metas, offset, parts = [], 0, []
        for (r0, r1), (c0, c1) in blocks:
            part = whole[r0:r1, c0:c1].contiguous()
            nb = part.numel() * part.element_size()
            metas.append(TensorMeta(name, "float32", tuple(part.shape), offset, nb, tuple(whole.shape), (r0, c0)))
            parts.append((offset, part))
            offset = (offset + nb + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES
        buf = torch.zeros(offset, dtype=torch.uint8)
        for off, part in parts:
            buf[off:off + part.numel() * 4] = part.reshape(-1).view(torch.uint8)
        buckets.append(FlatBucket(metas, buf))
    return buckets


def test_assemble_joins_pieces_across_buckets_and_passes_whole_tensors_as_views():
    w = torch.arange(30.0).reshape(5, 6)
    small = FlatBucket.pack([("s", torch.tensor([1.0, 2.0]))])
    # column blocks (a dim-1 TP split), rows cut across two buckets, in no particular order
    pieces = _pieces(w, "w", [[((0, 3), (3, 6)), ((0, 2), (0, 3))], [((2, 5), (0, 3)), ((3, 5), (3, 6))]])
    got = list(assemble([small, *pieces, small]))
    assert [n for n, _ in got] == ["s", "w", "s"]
    assert torch.equal(got[1][1], w)
    assert got[0][1].data_ptr() == small.buffer.data_ptr()  # whole tensors: no copy
    with pytest.raises(ValueError, match="holds pieces"):
        list(pieces[0])


@pytest.mark.parametrize("order,match", [
    ("interleaved", "arrived while 'w' was incomplete"),
    ("truncated", "the end of the stream arrived while 'w' was incomplete"),
    ("overlap", "overlap"),
])
def test_assemble_refuses_broken_piece_streams(order, match):
    w = torch.arange(30.0).reshape(5, 6)
    other = FlatBucket.pack([("s", torch.tensor([1.0]))])
    first = _pieces(w, "w", [[((0, 2), (0, 6))]])[0]
    rest = {"interleaved": [other], "truncated": [],
            "overlap": _pieces(w, "w", [[((1, 5), (0, 6))]])}[order]
    with pytest.raises(ValueError, match=match):
        list(assemble([first, *rest]))
    asm = Assembler()  # the same object is what the receiver and the trainer's checksum use
    assert list(asm.feed(_pieces(w, "w", [[((0, 5), (0, 6))]])[0]))[0][0] == "w"
    asm.close()


def test_staging_buffer_is_reused_only_when_nobody_holds_a_view():
    s = StagingBuffer(torch.device("cpu"))
    a = s.get(1000)
    ptr = a.data_ptr()
    del a
    b = s.get(800)
    assert b.data_ptr() == ptr and b.numel() == 800  # reused, trimmed to the request
    view = b[:10]
    del b
    c = s.get(800)
    assert c.data_ptr() != ptr  # a view of the old buffer survives: fresh buffer
    assert view.data_ptr() == ptr


# ---------------------------------------------------------------- one package, no copies of it
_PACKAGE = "megatron_stare/weight_sync/"


def _sources():
    for pkg in ("megatron_stare", "checkpoints_convert"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(_PACKAGE) and not rel.startswith("megatron_stare/testing/"):
                yield rel, ast.parse(path.read_text())


def test_no_module_outside_the_package_defines_a_bucket_or_header():
    offenders = []
    for rel, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(w in node.name for w in ("Bucket", "Header", "TensorMeta")):
                offenders.append(f"{rel}: class {node.name}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [node.module or ""] if isinstance(node, ast.ImportFrom) \
                    else [a.name for a in node.names]
                if "pickle" in names:
                    offenders.append(f"{rel}: imports pickle")
    assert not offenders, offenders


TRANSPORT_MODULES = ("bucket", "wire", "transport", "checksum", "groups")


def test_engines_and_exports_use_only_the_packages_public_api():
    """Rollout engines and the exports move weights only through ``megatron_stare.weight_sync``'s
    public names: no imports of the transport's submodules (the export plan's modules, ``export``,
    ``export_pieces`` and ``hf_export``, are public modules of their own), no underscore names from
    other modules, no collectives of their own."""
    scoped = ("megatron_stare/rollout/", "megatron_stare/weight_sync/export.py", "megatron_stare/weight_sync/hf_export.py",
              "checkpoints_convert/")
    offenders = []
    for rel, tree in _sources():
        if not rel.startswith(scoped):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                mod = ("." * node.level) + (node.module or "")
                if any(f"weight_sync.{sub}" in mod for sub in TRANSPORT_MODULES):
                    offenders.append(f"{rel}: from {mod} import (use megatron_stare.weight_sync)")
                if node.level or mod.startswith(("megatron_stare", "checkpoints_convert")):
                    offenders += [f"{rel}: imports private {a.name} from {mod}" for a in node.names
                                  if a.name.startswith("_")]
            if isinstance(node, ast.Attribute) and node.attr in ("broadcast", "send", "recv", "isend", "irecv") \
                    and isinstance(node.value, ast.Name) and node.value.id in ("dist", "group"):
                offenders.append(f"{rel}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not offenders, offenders


def test_adjacent_row_pieces_of_one_tensor_are_sent_as_one_entry():
    """The piece export joins back-to-back full-width row pieces (a dim-0 split's ranks) into one
    entry, and one that covers its tensor becomes whole (a view for the receiver, no join)."""
    from megatron_stare.weight_sync.export_pieces import _merged

    def piece(name, rows, r0, off, full=(4, 8), cols=(8, 0)):
        return TensorMeta(name, "float32", (rows, cols[0]), off, rows * cols[0] * 4, full, (r0, cols[1]))

    whole = _merged([piece("a", 2, 0, 0), piece("a", 2, 2, 64)])
    assert whole == [TensorMeta("a", "float32", (4, 8), 0, 128)]
    part = _merged([piece("a", 1, 0, 0), piece("a", 2, 1, 32)])  # rows 0-2 of 4: still a piece
    assert part == [piece("a", 3, 0, 0)]
    gap = [piece("a", 2, 0, 0), piece("a", 2, 2, 256)]            # not back to back
    cols = [piece("b", 4, 0, 0, cols=(4, 0)), piece("b", 4, 0, 64, cols=(4, 4))]  # column blocks
    other = [piece("a", 2, 0, 0), piece("c", 2, 2, 64)]           # another tensor
    for metas in (gap, cols, other):
        assert _merged(metas) == metas
