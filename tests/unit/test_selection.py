"""Single-process tests of the exact top-k selection (group=None)."""

import math

import pytest
import torch

from megatron_stare.ops.selection import (
    INT64_MAX,
    TopKThreshold,
    kth_largest,
    topk_mask,
    topk_threshold,
    topk_thresholds,
)

INF = math.inf


def reference_mask(values, keys, k):
    """Top-k by (value descending, key ascending), computed with torch.topk on a sort key."""
    order = torch.argsort(keys, stable=True)  # smaller key first among equal values
    v = values[order].double()
    # stable descending sort on the value keeps the key order inside ties
    idx = torch.sort(v, descending=True, stable=True).indices[:k]
    mask = torch.zeros(values.shape, dtype=torch.bool)
    mask[order[idx]] = True
    assert torch.equal(torch.topk(v, k).values.sort().values, v[idx].sort().values)
    return mask


def _random_case(g, n, dtype, kind):
    if kind == "dup":
        v = torch.randint(-3, 4, (n,), generator=g).double() / 2
        v[torch.rand(n, generator=g) < 0.15] = INF
        v[torch.rand(n, generator=g) < 0.15] = -INF
        v[torch.rand(n, generator=g) < 0.15] = -0.0
    elif kind == "wide":  # both signs over the whole exponent range
        v = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(
            -300, 300, (n,), generator=g).double()
    else:
        v = torch.randn(n, generator=g, dtype=torch.float64)
    keys = torch.randperm(10 * n + 1, generator=g)[:n] * 3 - 7 * n
    return v.to(dtype), keys


# The paths of the selection: radix passes only; radix passes until few candidates are left, then
# one gather; one gather of everything; (the default for small inputs) everything carried by the
# first all-gather; only the best 4 items carried by the first all-gather (decisive for small k,
# else the radix or the gather takes over).
PATHS = {"radix": dict(eager=0, gather_max=0), "radix+gather": dict(eager=0, gather_max=5),
         "gather": dict(eager=0, gather_max=10 ** 9), "eager": {},
         "eager-cut": dict(eager=4, gather_max=0), "eager-cut+gather": dict(eager=4)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("bits", [1, 3, 8, 16])
@pytest.mark.parametrize("path", list(PATHS))
def test_matches_reference(dtype, bits, path):
    g = torch.Generator().manual_seed(bits)
    for trial in range(12):
        n = int(torch.randint(1, 80, (), generator=g))
        kind = ("dup", "wide", "normal")[trial % 3]
        if kind == "wide" and dtype != torch.float64:
            kind = "normal"
        v, keys = _random_case(g, n, dtype, kind)
        for k in sorted({0, 1, n // 3, n // 2, n - 1, n}):
            kw = dict(radix_bits=bits, **PATHS[path])
            mask = topk_mask(v, keys, k, **kw)
            assert int(mask.sum()) == k
            assert torch.equal(mask, reference_mask(v, keys, k)), (kind, k)
            if k:
                want = torch.sort(v.double(), descending=True).values[k - 1].item()
                assert kth_largest(v, k, **kw) == want


def test_ties_go_to_the_smaller_key():
    v = torch.tensor([1.0, 2.0, 2.0, 2.0, 0.5])
    keys = torch.tensor([10, 30, 5, 20, 0])
    thr = topk_threshold(v, keys, 2)
    assert (thr.value, thr.key, thr.k, thr.n) == (2.0, 20, 2, 5)
    assert thr.select(v, keys).tolist() == [False, False, True, True, False]
    # No tie to break: every item at the threshold is in and the key threshold is the maximum.
    assert topk_threshold(v, keys, 3).key == INT64_MAX
    assert topk_threshold(v, keys, 4) == TopKThreshold(1.0, INT64_MAX, 4, 5)


def test_negative_zero_equals_zero_and_infinities():
    v = torch.tensor([-0.0, 0.0, INF, -INF, -0.0])
    keys = torch.tensor([4, 3, 2, 1, 0])
    assert topk_mask(v, keys, 2).tolist() == [False, False, True, False, True]
    assert topk_mask(v, keys, 5).all()
    assert kth_largest(v, 1) == INF and kth_largest(v, 5) == -INF
    assert topk_threshold(torch.full((3,), -INF), torch.arange(3), 2).select(
        torch.full((3,), -INF), torch.arange(3)).tolist() == [True, True, False]


def test_k_zero_and_k_n_and_empty():
    v, keys = torch.randn(7), torch.arange(7)
    assert not topk_mask(v, keys, 0).any()
    assert topk_mask(v, keys, 7).all()
    empty = topk_mask(torch.empty(0), torch.empty(0, dtype=torch.int64), 0)
    assert empty.shape == (0,)
    thr = topk_threshold(v, keys, 0)
    assert thr.k == 0 and not thr.select(torch.tensor([INF]), torch.tensor([-(2 ** 63)])).any()


def test_threshold_applies_to_micro_batches():
    g = torch.Generator().manual_seed(7)
    v, keys = _random_case(g, 200, torch.float32, "dup")
    thr = topk_threshold(v, keys, 37)
    parts = [thr.select(v[i:i + 23], keys[i:i + 23]) for i in range(0, 200, 23)]
    assert torch.equal(torch.cat(parts), topk_mask(v, keys, 37))
    assert int(torch.cat(parts).sum()) == 37


def test_user_errors():
    v, keys = torch.tensor([1.0, float("nan"), 2.0]), torch.arange(3)
    with pytest.raises(ValueError, match="NaN"):
        topk_mask(v, keys, 1)
    with pytest.raises(ValueError, match="NaN"):
        kth_largest(v, 1)
    v = torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match=r"k=3 must lie in \[0, n=2\]"):
        topk_mask(v, torch.arange(2), 3)
    with pytest.raises(ValueError, match="k=-1"):
        topk_mask(v, torch.arange(2), -1)
    with pytest.raises(ValueError, match="k must be >= 1"):
        kth_largest(v, 0)
    with pytest.raises(ValueError, match="int64"):
        topk_mask(v, torch.arange(2, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="1-D float"):
        topk_mask(v[None], torch.arange(2)[None], 1)
    with pytest.raises(ValueError, match="radix_bits"):
        topk_mask(v, torch.arange(2), 1, radix_bits=0)
    # Duplicate keys are harmless away from the threshold, an error at a tie that needs them.
    assert topk_mask(torch.tensor([3.0, 1.0, 1.0]), torch.tensor([5, 5, 6]), 2).tolist() == [
        True, True, False]
    with pytest.raises(ValueError, match="token keys must be unique"):
        topk_mask(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([5, 5, 6]), 1)


def test_threshold_is_a_plain_dataclass():
    thr = TopKThreshold(1.5, 4, 2, 9)
    assert thr.select(torch.tensor([2.0, 1.5, 1.5, 1.0]), torch.tensor([9, 4, 5, 0])).tolist() == [
        True, True, False, False]


@pytest.mark.parametrize("path", list(PATHS))
def test_duplicate_keys_at_the_threshold_fail_on_every_path(path):
    with pytest.raises(ValueError, match="token keys must be unique"):
        topk_mask(torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([5, 5, 6, 1]), 1, **PATHS[path])
    # Duplicates the threshold does not split are fine.
    assert topk_mask(torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([5, 5, 6, 1]), 2,
                     **PATHS[path]).tolist() == [True, True, False, False]
    # A real key INT64_MAX (the value the tie resolution masks untied items with) is counted
    # exactly: its duplicates split by the threshold fail, a single one is selected.
    with pytest.raises(ValueError, match="2 items share value 1.0 and key"):
        topk_mask(torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([5, INT64_MAX, INT64_MAX, 2]),
                  2, **PATHS[path])
    assert topk_mask(torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([5, INT64_MAX, 6, 2]), 3,
                     **PATHS[path]).tolist() == [True, True, True, False]


@pytest.mark.parametrize("path", list(PATHS))
def test_batched_thresholds_equal_single_calls(path):
    """``topk_thresholds`` (STARE C2's two thresholds in shared collectives) gives what one
    ``topk_threshold`` per problem gives, also with k == 0, an empty problem and callable k."""
    g = torch.Generator().manual_seed(21)
    a, ka = _random_case(g, 60, torch.float32, "dup")
    b, kb = _random_case(g, 45, torch.float64, "wide")
    c, kc = _random_case(g, 30, torch.float32, "normal")
    e = (torch.empty(0), torch.empty(0, dtype=torch.int64))
    odd = (torch.full((7,), 2.5), torch.arange(7) * 5)  # 7 candidates: odd-sized payloads
    items = [(a, ka, 17), (b, kb, lambda n: n // 3), (c, kc, 0), (*e, 0), (*odd, 3), (*odd, 4),
             (a, ka, 60)]
    got = topk_thresholds(items, **PATHS[path])
    want = [topk_threshold(v, kk, k if isinstance(k, int) else k(len(v))) for v, kk, k in items]
    assert got == want
    assert [t.k for t in got] == [17, 15, 0, 0, 3, 4, 60]


def test_first_gather_of_the_best_items_decides_small_k(monkeypatch):
    """With more items than ``eager``, the best ``eager`` items decide the threshold when it lies
    strictly above the cut; otherwise (here: a tie at the cut) the coarse histogram takes over.
    Both give the reference."""
    from megatron_stare.ops import radix_select

    calls = []
    real = radix_select.Problem.advance
    monkeypatch.setattr(radix_select.Problem, "advance",
                        lambda self, *a: calls.append(1) or real(self, *a))
    v = torch.tensor([5.0, 1.0, 4.0, 3.0, 3.0, 2.0, 0.5, 3.0])
    keys = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0])
    for k in range(1, 9):
        calls.clear()
        mask = topk_mask(v, keys, k, eager=3)
        assert torch.equal(mask, reference_mask(v, keys, k)), k
        # The best 3 are 5, 4 and one of the 3.0s: decisive for k <= 2 only.
        assert bool(calls) == (k > 2), k
