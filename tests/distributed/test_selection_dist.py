"""Exact cross-rank top-k on gloo: equals a gathered torch.topk-style reference for groups of 1-4
ranks, for uneven and empty shards and heavy duplicates, and the selected set does not change when
the same tokens are dealt over the ranks (and micro-batches) differently. One spawned run of 4
ranks covers every case; the error cases check that every rank raises, none deadlocks.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_stare.ops.selection import kth_largest, topk_mask, topk_threshold, topk_thresholds
from megatron_stare.testing.distributed import run_on_ranks

pytestmark = pytest.mark.distributed

INF = float("inf")
# Radix passes only / radix then gather / gather / the best 3 items per rank first (decisive for
# small k, else radix or gather). The default here carries every item in the first all-gather.
PATHS = (dict(eager=0, gather_max=0, radix_bits=3), dict(eager=0, gather_max=4, radix_bits=2),
         dict(eager=0, gather_max=0, radix_bits=16), dict(eager=0, gather_max=10 ** 9),
         dict(eager=3, gather_max=0), dict(eager=3))


def _datasets():
    g = torch.Generator().manual_seed(11)
    out = {}
    v = torch.randn(157, generator=g)
    out["normal"] = v
    d = torch.randint(0, 6, (203,), generator=g).double() / 4
    d[torch.rand(203, generator=g) < 0.1] = INF
    d[torch.rand(203, generator=g) < 0.1] = -INF
    d[torch.rand(203, generator=g) < 0.1] = -0.0
    out["dup"] = d.float()
    out["wide64"] = torch.randn(64, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(
        -300, 300, (64,), generator=g).double()
    out["tiny"] = torch.tensor([0.5, 0.5, 0.25])
    # layout-independent global token keys, deliberately not in item order
    keys = {name: torch.randperm(10 * len(v), generator=g)[: len(v)] * 7 + 3
            for name, v in out.items()}
    return out, keys


def _deals(n, m):
    """Several assignments of n items to m ranks: item -> owner (group rank)."""
    g = torch.Generator().manual_seed(n * 10 + m)
    cuts = sorted(torch.randint(0, n + 1, (m - 1,), generator=g).tolist())
    blocks = torch.zeros(n, dtype=torch.long)
    for c in cuts:
        blocks[c:] += 1  # contiguous, uneven, possibly empty blocks
    return {
        "round_robin": torch.arange(n) % m,
        "blocks": blocks,
        "random": torch.randint(0, m, (n,), generator=g),
        "all_on_last": torch.full((n,), m - 1),
    }


def _reference(values, keys, k):
    order = torch.argsort(keys)
    idx = torch.sort(values[order].double(), descending=True, stable=True).indices[:k]
    return sorted(order[idx].tolist())


def _worker(rank, world_size):
    data, keys = _datasets()
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    triple = dist.new_group([0, 1, 2])
    groups = {f"single{rank}": None, f"pair{rank // 2}": pair, "world": dist.group.WORLD}
    if rank < 3:
        groups["triple"] = triple
    out = {}
    for gname, group in groups.items():
        m = 1 if group is None else dist.get_world_size(group)
        me = 0 if group is None else dist.get_rank(group)
        for dname, values in data.items():
            n = len(values)
            ks = sorted({0, 1, -(-n // 10), n // 2, n})
            for deal, owner in _deals(n, m).items():
                idx = torch.nonzero(owner == me).flatten()
                v, kk = values[idx], keys[dname][idx]
                for k in ks:
                    thr = topk_threshold(v, kk, k, group)
                    # Every path gives the same threshold, bit for bit.
                    for kw in PATHS if deal == "random" else ():
                        assert topk_threshold(v, kk, k, group, **kw) == thr, kw
                    mask = thr.select(v, kk)
                    # the same threshold applied per micro-batch selects the same tokens
                    micro = [thr.select(v[i:i + 5], kk[i:i + 5]) for i in range(0, len(v), 5)]
                    assert torch.equal(torch.cat(micro) if micro else mask, mask)
                    if deal == "random":
                        assert torch.equal(topk_mask(v, kk, k, group), mask)
                    kth = kth_largest(v, k, group) if k and deal == "blocks" else None
                    out[(gname, dname, deal, k)] = (idx[mask].tolist(), kth)
        # Both thresholds in shared collectives (STARE C2) equal one call each, on every path.
        pieces = []
        for dname in ("normal", "dup"):
            owner = _deals(len(data[dname]), m)["random"]
            idx = torch.nonzero(owner == me).flatten()
            pieces.append((data[dname][idx], keys[dname][idx]))
        for kw in PATHS:
            items = [(*pieces[0], 16), (*pieces[1], lambda n: n // 3)]
            got = topk_thresholds(items, group, **kw)
            assert got == [topk_threshold(*pieces[0], 16, group),
                           topk_threshold(*pieces[1], len(data["dup"]) // 3, group)], kw
    # Error cases on the whole world: every rank must raise the same ValueError.
    errors = {}
    cases = {
        "nan": (torch.tensor([1.0, float("nan")]) if rank == 2 else torch.tensor([1.0]), 1),
        "k_too_big": (torch.tensor([1.0]), 5),
        "dtype_mix": (torch.tensor([1.0], dtype=torch.float64 if rank else torch.float32), 1),
        "dup_keys": (torch.tensor([1.0]), 1),  # same key 0 on every rank, all tied
    }
    for name, (v, k) in cases.items():
        try:
            topk_mask(v, torch.zeros(len(v), dtype=torch.int64), k, dist.group.WORLD)
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    return out, errors


def test_selection_matches_gathered_reference_and_is_layout_invariant():
    results = run_on_ranks(_worker, 4, timeout=300)
    data, keys = _datasets()
    merged = {}
    for out, _ in results:
        for (gname, dname, deal, k), (sel, kth) in out.items():
            entry = merged.setdefault((gname, dname, deal, k), ([], set()))
            entry[0].extend(sel)
            entry[1].add(kth)
    n_groups = {g for g, *_ in merged}
    assert n_groups == {"single0", "single1", "single2", "single3", "pair0", "pair1", "triple",
                        "world"}
    for (gname, dname, deal, k), (sel, kths) in merged.items():
        values = data[dname]
        want = _reference(values, keys[dname], k)
        assert sorted(sel) == want, (gname, dname, deal, k)  # same set for every layout
        assert len(sel) == k
        if k and deal == "blocks":
            assert kths == {torch.sort(values.double(), descending=True).values[k - 1].item()}
    for rank, (_, errors) in enumerate(results):
        assert "NaN values on rank(s) [2]" in errors["nan"], rank
        assert "k=5 must lie in [0, n=4]" in errors["k_too_big"], rank
        assert "different float widths" in errors["dtype_mix"], rank
        assert "token keys must be unique" in errors["dup_keys"], rank
