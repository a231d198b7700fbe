"""Time and peak memory of the vocab-parallel log-prob/entropy op against slime's (or naive fp32).

The anchor is slime's ``calculate_log_probs_and_entropy`` (``slime/utils/ppo_utils.py`` of the
public THUDM/slime repository), loaded at run time from ``--slime-path`` (that file, or a slime
checkout); no slime code is part of this project. Without ``--slime-path`` the reference is the
naive fp32 path (upcast the whole shard, ``log_softmax``, gather, entropy from the full
probabilities) and the output says so.

Rows (one rank, ``tp_group=None``: no communication is timed; forward + backward of
``sum(g * logp) [+ sum(g * H)]``):

- ``logits {fp32,bf16} T=2048 V=32768 H-grad|H-metric``: reference vs ours
  (``vocab_parallel_logprobs_entropy``);
- ``no-logits fp32 T=2048 h=1024 V=32768 H-metric``: ``hidden @ weight.T`` + ours on the logits
  (reference) vs ``fused_linear_logprobs_entropy`` (never builds the logits).

Timing: each variant runs in its own process (built and warmed up once), ``--repeats`` interleaved
rounds, one thread per process; the ratio is the median over rounds of ours / reference (< 1:
ours is faster). Peak: the peak of live torch CPU allocations during one forward + backward above
the level at its start (inputs excluded, the ``[T, V]`` logits gradient included), from
``torch.profiler`` allocator events. For the no-logits row each variant is also profiled once
(seconds and GFLOP in matrix multiplies against the rest). The ratios go to
``benchmarks/results/vocab_parallel.json``.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/bench_vocab_parallel.py --slime-path
/path/to/slime [--repeats 5] [--quick] [--tile-sweep 131072 262144 524288]``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._C._profiler as _P
from torch.profiler import ProfilerActivity, profile

from bench_common import Variant, interleaved_times, machine, paired_ratio, start

RESULTS = Path(__file__).resolve().parent / "results" / "vocab_parallel.json"


def slime_file(path: str) -> Path:
    """``path`` itself if it is a file, else ``path/slime/utils/ppo_utils.py``."""
    p = Path(path)
    f = p if p.is_file() else p / "slime" / "utils" / "ppo_utils.py"
    if not f.is_file():
        raise SystemExit(f"--slime-path {path}: no slime/utils/ppo_utils.py there; pass the file "
                         "or a checkout of github.com/THUDM/slime")
    return f


def load_slime(path: str):
    """slime's ``calculate_log_probs_and_entropy``, imported from its file at run time.

    The module's other imports are torch only (megatron/slime imports are inside functions we do
    not call); a checkout root is put on ``sys.path`` in case a later version imports siblings.
    """
    f = slime_file(path)
    root = f.parents[2]
    if (root / "slime").is_dir() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    spec = importlib.util.spec_from_file_location("slime_anchor_ppo_utils", f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.calculate_log_probs_and_entropy


def naive_logits(x, t, entropy_grad):
    lp = torch.log_softmax(x.float(), -1)
    logp = lp.gather(1, t[:, None]).squeeze(1)
    with torch.set_grad_enabled(entropy_grad):
        ent = -(lp.exp() * lp).sum(-1)
    return logp, ent


def ours_logits(x, t, entropy_grad):
    from megatron_stare.ops.vocab_parallel import vocab_parallel_logprobs_entropy

    out = vocab_parallel_logprobs_entropy(x, t, entropy_grad=entropy_grad)
    return out.logprobs, out.entropy


def make_logits_fn(kind: str, slime_path):
    if kind == "ours":
        return ours_logits
    if kind == "naive":
        return naive_logits
    slime = load_slime(slime_path)

    def fn(x, t, entropy_grad):
        lp, ent = slime(x, t, None, with_entropy=True, with_entropy_grad=entropy_grad)
        return lp.reshape(-1), ent
    return fn


def peak_bytes(fn) -> int:
    """Peak of live torch CPU allocations while ``fn`` runs, above the level at its start."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    nodes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        n = stack.pop()
        nodes.append(n)
        stack.extend(n.children)
    allocs = sorted((n for n in nodes if n.tag == _P._EventType.Allocation),
                    key=lambda n: n.start_time_ns)
    cur = peak = 0
    for n in allocs:
        cur += n.extra_fields.alloc_size
        peak = max(peak, cur)
    return peak


MATMULS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::matmul", "aten::bmm"}


def _gemm_flops(op: str, shapes) -> float:
    """``2*M*K*N`` of one mm / addmm call from its input shapes (``aten::matmul`` is a wrapper
    around ``aten::mm``: not counted twice)."""
    mats = [sh for sh in shapes if isinstance(sh, list) and len(sh) == 2]
    if op == "aten::mm":
        (m, k), (_, n) = mats[0], mats[1]
    elif op in ("aten::addmm", "aten::addmm_"):
        (m, k), (_, n) = mats[1], mats[2]
    else:
        return 0.0
    return 2.0 * m * k * n


def op_profile(fn) -> dict:
    """One call under ``torch.profiler``: seconds and GFLOP (from the operand shapes) in matrix
    multiplies, seconds in the rest, and the three most expensive other operators (self time)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    mm_s = mm_flops = other_s = 0.0
    others = {}
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key in MATMULS:
            mm_s += e.self_cpu_time_total / 1e6
            mm_flops += e.count * _gemm_flops(e.key, e.input_shapes) / 1e9
        else:
            other_s += e.self_cpu_time_total / 1e6
            others[e.key] = others.get(e.key, 0.0) + e.self_cpu_time_total / 1e6
    top = sorted(others.items(), key=lambda kv: -kv[1])[:3]
    return {"matmul_s": mm_s, "matmul_gflop": mm_flops, "other_s": other_s,
            "matmul_share": mm_s / (mm_s + other_s), "top_other": top}


def _runner(call, outputs):
    call()  # warm-up

    def run(cmd):
        if cmd == "time":
            s = time.perf_counter()
            call()
            return time.perf_counter() - s
        if cmd == "peak":
            return peak_bytes(call)
        if cmd == "profile":
            return op_profile(call)
        if cmd == "outputs":
            return outputs()
        raise ValueError(cmd)
    return run


def setup_logits(rank, world_size, kind, T, V, dtype, entropy_grad, slime_path, tile_elems):
    """A variant on logits ``[T, V]``: ``kind`` in {ours, slime, naive}."""
    import megatron_stare.ops.vocab_parallel as vp

    if tile_elems:
        vp.TILE_ELEMS = tile_elems
    torch.manual_seed(0)
    x = (torch.randn(T, V) * 2).to(getattr(torch, dtype)).requires_grad_()
    t = torch.randint(0, V, (T,))
    g = torch.randn(T)
    fn = make_logits_fn(kind, slime_path)

    def call():
        logp, ent = fn(x, t, entropy_grad)
        loss = (logp * g).sum() + ((ent * g).sum() if entropy_grad else 0.0)
        return torch.autograd.grad(loss, x)

    def outputs():
        with torch.no_grad():
            logp, ent = fn(x.detach(), t, False)
        return logp.float(), ent.float()
    return _runner(call, outputs)


def setup_linear(rank, world_size, kind, T, H, V, tiles=None):
    """The no-logits case: ``kind`` in {fused, matmul+ours}; entropy as a metric. ``tiles``:
    ``(chunk_size, vocab_chunk_size)`` of the fused path (default: its defaults)."""
    from megatron_stare.ops.fused_linear import fused_linear_logprobs_entropy

    torch.manual_seed(0)
    h = torch.randn(T, H).requires_grad_()
    w = (torch.randn(V, H) / H ** 0.5).requires_grad_()
    t = torch.randint(0, V, (T,))
    g = torch.randn(T)

    def fn(h, w):
        if kind == "fused":
            kw = {} if tiles is None else dict(chunk_size=tiles[0], vocab_chunk_size=tiles[1])
            out = fused_linear_logprobs_entropy(h, w, t, **kw)
            return out.logprobs, out.entropy
        return ours_logits(h @ w.T, t, False)

    def call():
        logp, _ = fn(h, w)
        return torch.autograd.grad((logp * g).sum(), (h, w))

    def outputs():
        with torch.no_grad():
            return fn(h, w)
    return _runner(call, outputs)


def measure(ref: Variant, ours: Variant, repeats: int, with_profile: bool = False) -> dict:
    worlds = start([ref, ours])
    try:
        times = interleaved_times(worlds, [ref.name, ours.name], repeats)
        peaks = {v.name: worlds.ask(v.name, "peak")[0] for v in (ref, ours)}
        (lr, er), (lo, eo) = (worlds.ask(v.name, "outputs")[0] for v in (ref, ours))
        profiles = {v.name: worlds.ask(v.name, "profile")[0] for v in (ref, ours)} \
            if with_profile else None
    finally:
        worlds.close()
    tr, to = times[ref.name], times[ours.name]
    extra = {} if profiles is None else {"profile": profiles}
    return {**extra,
        "ref_s": statistics.median(tr), "ours_s": statistics.median(to),
        "time_ratio": paired_ratio(to, tr),
        "ref_times_s": tr, "ours_times_s": to,
        "ref_peak_mib": peaks[ref.name] / 2 ** 20, "ours_peak_mib": peaks[ours.name] / 2 ** 20,
        "mem_ratio": peaks[ours.name] / peaks[ref.name],
        "max_abs_diff_logprobs": float((lr - lo).abs().max()),
        "max_abs_diff_entropy": float((er - eo).abs().max()),
    }


def _goal_text(row):
    parts = []
    for key, goal in (("time_ratio", row.get("time_goal")), ("mem_ratio", row.get("mem_goal"))):
        if goal is not None:
            row[key.replace("ratio", "met")] = row[key] <= goal
            parts.append(f"{key.split('_')[0]} <= {goal}: {'met' if row[key] <= goal else 'MISSED'}")
    return "; ".join(parts)


def write(path: Path, record: dict, partial: bool) -> None:
    """Write ``record``; a partial run (``--only``) replaces only its own rows of the file."""
    if partial and path.exists():
        old = json.loads(path.read_text())
        mine = {r["name"] for r in record["rows"]}
        record["rows"] = [r for r in old["rows"] if r["name"] not in mine] + record["rows"]
        for key in ("tile_sweep", "linear_sweep"):
            if key not in record and key in old:
                record[key] = old[key]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slime-path", help="slime's ppo_utils.py or a slime checkout (the anchor)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small shapes; does not write results")
    ap.add_argument("--only", nargs="*", default=None, help="run only rows whose name contains "
                    "one of these words")
    ap.add_argument("--tile-sweep", type=int, nargs="*", default=[],
                    help="also time ours at these TILE_ELEMS values against the default")
    ap.add_argument("--linear-sweep", nargs="*", default=[], metavar="CHUNK:VCHUNK",
                    help="also time the no-logits path at these tile shapes")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's start/stop lines are noise
    torch.manual_seed(0)
    div = 8 if args.quick else 1
    ref_kind = "slime" if args.slime_path else "naive"
    record = {"machine": machine(), "repeats": args.repeats, "reference": ref_kind, "rows": []}
    if args.slime_path:
        f = slime_file(args.slime_path)
        record["slime_file_sha256"] = hashlib.sha256(f.read_bytes()).hexdigest()
        print(f"reference: slime calculate_log_probs_and_entropy from {f} (sha256 "
              f"{record['slime_file_sha256'][:12]}), its default chunk_size=-1")
    else:
        print("reference: NAIVE fp32 path (no --slime-path given): these are not the slime "
              "anchor's numbers")
    print(f"{args.repeats} interleaved repeats, each variant in its own process, 1 thread; "
          "ratio = median over repeats of ours/ref (< 1: ours faster / smaller)")
    T, V = 2048 // div, 32768
    rows = []
    for dtype in ("float32", "bfloat16"):
        for eg in (True, False):
            name = f"logits {dtype} T={T} V={V} {'H-grad' if eg else 'H-metric'}"
            rows.append((name, "setup_logits", (T, V, dtype, eg), 1.0, 0.6 if eg else None))
    rows.append((f"no-logits float32 T={T} h=1024 V={V} H-metric", "setup_linear",
                 (T, 1024, V), 1.2, 0.3))
    for name, setup, case, time_goal, mem_goal in rows:
        if args.only is not None and not any(w in name for w in args.only):
            continue
        if setup == "setup_logits":
            ref = Variant(ref_kind, setup_logits, (ref_kind, *case, args.slime_path, 0))
            ours = Variant("ours", setup_logits, ("ours", *case, None, 0))
        else:
            ref = Variant("matmul+ours", setup_linear, ("matmul+ours", *case))
            ours = Variant("fused", setup_linear, ("fused", *case))
        r = {"name": name, "ref": ref.name, "ours": ours.name, "time_goal": time_goal,
             "mem_goal": mem_goal,
             **measure(ref, ours, args.repeats, with_profile=setup == "setup_linear")}
        verdict = _goal_text(r)
        print(f"{name:<44} {ref.name} {r['ref_s']:6.3f}s vs ours {r['ours_s']:6.3f}s "
              f"(x{r['time_ratio']:4.2f})  peak {r['ref_peak_mib']:7.1f} vs {r['ours_peak_mib']:7.1f}"
              f" MiB (x{r['mem_ratio']:4.2f})  max|d logp| {r['max_abs_diff_logprobs']:.1e} "
              f"max|d H| {r['max_abs_diff_entropy']:.1e}  "
              f"[{verdict}]", flush=True)
        record["rows"].append(r)
        for who, prof in r.get("profile", {}).items():
            print(f"  profile {who:<12} matmul {prof['matmul_s']:.2f}s for "
                  f"{prof['matmul_gflop']:.0f} GFLOP ({prof['matmul_share']:.0%} of the op time), "
                  f"the rest {prof['other_s']:.2f}s, top: " + ", ".join(
                      f"{k} {v:.2f}s" for k, v in prof["top_other"]))
    for dtype in ("float32", "bfloat16") if args.tile_sweep else ():
        case = (T, V, dtype, True)
        default = Variant("tile=default", setup_logits, ("ours", *case, None, 0))
        others = [Variant(f"tile={te}", setup_logits, ("ours", *case, None, te))
                  for te in args.tile_sweep]
        worlds = start([default, *others])
        try:
            names = [v.name for v in (default, *others)]
            times = interleaved_times(worlds, names, args.repeats)
        finally:
            worlds.close()
        sweep = {n: {"median_s": statistics.median(times[n]),
                     "ratio_to_default": paired_ratio(times[n], times[names[0]])} for n in names}
        record.setdefault("tile_sweep", {})[dtype] = sweep
        print(f"tile sweep {dtype} H-grad: " + "  ".join(
            f"{n} {s['median_s']:.3f}s (x{s['ratio_to_default']:.2f})" for n, s in sweep.items()))
    if args.linear_sweep:
        case = (T, 1024, V)
        ref = Variant("matmul+ours", setup_linear, ("matmul+ours", *case))
        others = [Variant(f"fused {sw}", setup_linear,
                          ("fused", *case, tuple(int(x) for x in sw.split(":"))))
                  for sw in args.linear_sweep]
        worlds = start([ref, *others])
        try:
            names = [v.name for v in (ref, *others)]
            times = interleaved_times(worlds, names, args.repeats)
            peaks = {n: worlds.ask(n, "peak")[0] / 2 ** 20 for n in names}
        finally:
            worlds.close()
        sweep = {n: {"median_s": statistics.median(times[n]), "peak_mib": peaks[n],
                     "ratio_to_ref": paired_ratio(times[n], times[names[0]])} for n in names}
        record["linear_sweep"] = sweep
        for n, r in sweep.items():
            print(f"linear sweep {n:<20} {r['median_s']:.3f}s (x{r['ratio_to_ref']:.2f})  peak "
                  f"{r['peak_mib']:.1f} MiB")
    if not args.quick:
        write(Path(args.out), record, partial=args.only is not None)


if __name__ == "__main__":
    main()
