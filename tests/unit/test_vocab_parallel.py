"""Single-rank tests of the vocab-parallel log-prob / entropy op and its no-logits twin."""

import math

import pytest
import torch

from megatron_stare.ops.fused_linear import fused_linear_logprobs_entropy
from megatron_stare.ops.vocab_parallel import vocab_parallel_logprobs_entropy


def reference(logits, targets, valid, temperature=1.0):
    """float64 reference over the first ``valid`` columns: (logp, H, sum p^2, sum p^2 log p)."""
    lp = torch.log_softmax(logits[:, :valid].double() / temperature, -1)
    p = lp.exp()
    return (lp.gather(1, targets[:, None]).squeeze(1), -(p * lp).sum(1), (p * p).sum(1),
            (p * p * lp).sum(1))


def _loss(out, g1, g2):
    return (out[0] * g1).sum() + (out[1] * g2).sum()


def test_uniform_logits_hand_case():
    out = vocab_parallel_logprobs_entropy(torch.zeros(3, 4), torch.tensor([0, 1, 3]),
                                          with_sensitivity=True)
    assert torch.allclose(out.entropy, torch.full((3,), math.log(4)))
    assert torch.allclose(out.logprobs, torch.full((3,), -math.log(4)))
    assert torch.allclose(out.sum_p2, torch.full((3,), 0.25))
    assert torch.allclose(out.sum_p2_logp, torch.full((3,), -math.log(4) / 4))
    assert torch.equal(out.surprisal, -out.logprobs)


@pytest.mark.parametrize("valid,temperature,chunk,entropy_grad", [
    (50, 1.0, 1024, False), (43, 0.7, 4, True), (43, 1.3, 7, False), (50, 1.0, 1, True),
])
def test_fp64_matches_reference_values_and_grads(valid, temperature, chunk, entropy_grad):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(13, 50, generator=g, dtype=torch.float64) * 3).requires_grad_()
    t = torch.randint(0, valid, (13,), generator=g)
    out = vocab_parallel_logprobs_entropy(x, t, valid_vocab_size=valid, temperature=temperature,
                                          entropy_grad=entropy_grad, with_sensitivity=True,
                                          chunk_size=chunk)
    ref = reference(x, t, valid, temperature)
    for got, want in zip((out.logprobs, out.entropy, out.sum_p2, out.sum_p2_logp), ref):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want.detach(), atol=1e-10, rtol=0)
    g1, g2 = torch.randn(13, generator=g, dtype=torch.float64), torch.randn(13, generator=g,
                                                                            dtype=torch.float64)
    (gx,) = torch.autograd.grad(_loss((out.logprobs, out.entropy), g1, g2 if entropy_grad else 0),
                                x)
    (rx,) = torch.autograd.grad(_loss(ref, g1, g2 if entropy_grad else 0), x)
    torch.testing.assert_close(gx, rx, atol=1e-10, rtol=0)
    assert torch.all(gx[:, valid:] == 0)


def test_fp32_and_bf16_against_fp64():
    g = torch.Generator().manual_seed(2)
    x64 = torch.randn(37, 300, generator=g, dtype=torch.float64) * 4
    t = torch.randint(0, 300, (37,), generator=g)
    g1, g2 = torch.randn(37, generator=g), torch.randn(37, generator=g)
    for dtype, tol, gtol in ((torch.float32, 1e-6, 1e-6), (torch.bfloat16, 1e-5, 4e-3)):
        x = x64.to(dtype).requires_grad_()
        out = vocab_parallel_logprobs_entropy(x, t, entropy_grad=True, chunk_size=8)
        xr = x.detach().double().requires_grad_()
        ref = reference(xr, t, 300)
        assert out.logprobs.dtype == torch.float32
        # fp32 round-off: 1e-6 absolute plus relative (|log p| reaches ~30 here).
        torch.testing.assert_close(out.logprobs.double(), ref[0].detach(), atol=tol, rtol=1e-6)
        torch.testing.assert_close(out.entropy.double(), ref[1].detach(), atol=tol, rtol=1e-6)
        (gx,) = torch.autograd.grad(_loss((out.logprobs, out.entropy), g1, g2), x)
        (rx,) = torch.autograd.grad(_loss(ref, g1.double(), g2.double()), xr)
        assert gx.dtype == dtype
        # bf16 gradients are rounded once to bf16: compare within bf16 resolution.
        torch.testing.assert_close(gx.double(), rx, atol=gtol * rx.abs().max().item(), rtol=gtol)


def test_padding_columns_are_ignored():
    x = torch.randn(5, 12, dtype=torch.float64)
    x_big = x.clone()
    x_big[:, 9:] = 1e4  # garbage in the padded columns must not leak in
    t = torch.tensor([0, 3, 8, 8, 1])
    a = vocab_parallel_logprobs_entropy(x, t, valid_vocab_size=9)
    b = vocab_parallel_logprobs_entropy(x_big, t, valid_vocab_size=9)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=0, rtol=0)
    torch.testing.assert_close(a.entropy, b.entropy, atol=0, rtol=0)


def test_gradcheck_both_paths():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 11, generator=g, dtype=torch.float64, requires_grad=True)
    h = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 4, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 9, (6,), generator=g)
    kw = dict(valid_vocab_size=9, temperature=0.8, entropy_grad=True, chunk_size=4)
    def f(x):
        out = vocab_parallel_logprobs_entropy(x, t, **kw)
        return out.logprobs, out.entropy

    def f2(h, w):
        out = fused_linear_logprobs_entropy(h, w, t, vocab_chunk_size=3, **kw)
        return out.logprobs, out.entropy

    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradcheck(f2, (h, w))


def _saved_numels(fn):
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


def test_saved_for_backward_is_small():
    x = torch.randn(64, 100, requires_grad=True)
    t = torch.randint(0, 100, (64,))
    f = vocab_parallel_logprobs_entropy
    # Entropy as a metric: the caller's logits (a reference), the targets and lse [T] only.
    assert sorted(_saved_numels(lambda: f(x, t, with_entropy=True))) == [64, 64, 6400]
    # Entropy with gradient adds H [T].
    assert sorted(_saved_numels(lambda: f(x, t, entropy_grad=True))) == [64, 64, 64, 6400]
    # No gradient needed: nothing saved at all.
    assert _saved_numels(lambda: f(x.detach(), t)) == []
    with torch.no_grad():
        assert _saved_numels(lambda: f(x, t)) == []
    out = f(x, t)
    assert not out.entropy.requires_grad and out.logprobs.requires_grad


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_fused_path_equals_logits_path(dtype, tol):
    g = torch.Generator().manual_seed(4)
    h = torch.randn(21, 16, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(70, 16, generator=g, dtype=dtype) * 0.5).requires_grad_()
    t = torch.randint(0, 66, (21,), generator=g)
    kw = dict(valid_vocab_size=66, temperature=0.9, entropy_grad=True, with_sensitivity=True,
              chunk_size=8)
    a = fused_linear_logprobs_entropy(h, w, t, vocab_chunk_size=9, **kw)
    b = vocab_parallel_logprobs_entropy(h @ w.T, t, **kw)
    for name in ("logprobs", "entropy", "sum_p2", "sum_p2_logp"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=tol, rtol=0)
    g1, g2 = torch.randn(21, generator=g, dtype=dtype), torch.randn(21, generator=g, dtype=dtype)
    ga = torch.autograd.grad(_loss((a.logprobs, a.entropy), g1, g2), (h, w))
    gb = torch.autograd.grad(_loss((b.logprobs, b.entropy), g1, g2), (h, w))
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, atol=tol, rtol=0)


def test_fused_bf16_close_to_logits_path():
    g = torch.Generator().manual_seed(5)
    h = torch.randn(9, 32, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(40, 32, generator=g) * 0.3).bfloat16().requires_grad_()
    t = torch.randint(0, 40, (9,), generator=g)
    a = fused_linear_logprobs_entropy(h, w, t, vocab_chunk_size=16)
    b = vocab_parallel_logprobs_entropy(h @ w.T, t)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    ga = torch.autograd.grad(a.logprobs.sum(), (h, w))
    gb = torch.autograd.grad(b.logprobs.sum(), (h, w))
    for x, y in zip(ga, gb):
        assert x.dtype == torch.bfloat16
        torch.testing.assert_close(x.float(), y.float(), atol=3e-2 * y.abs().max().item(),
                                   rtol=2e-2)


def test_non_contiguous_logits():
    x = torch.randn(30, 7, dtype=torch.float64).T  # [7, 30] view with column-major strides
    t = torch.randint(0, 30, (7,))
    out = vocab_parallel_logprobs_entropy(x, t, chunk_size=3)
    torch.testing.assert_close(out.logprobs, reference(x, t, 30)[0], atol=1e-12, rtol=0)


def test_user_errors():
    x, t = torch.randn(4, 10), torch.tensor([0, 1, 2, 3])
    f = vocab_parallel_logprobs_entropy
    with pytest.raises(ValueError, match="target ids"):
        f(x, torch.tensor([0, 1, 2, 9]), valid_vocab_size=9)
    with pytest.raises(ValueError, match="target ids"):
        f(x, torch.tensor([0, -1, 2, 3]))
    with pytest.raises(ValueError, match="temperature"):
        f(x, t, temperature=0.0)
    with pytest.raises(ValueError, match="logits"):
        f(x[0], t)
    with pytest.raises(ValueError, match="targets"):
        f(x, t[:3])
    with pytest.raises(ValueError, match="entropy_grad"):
        f(x, t, with_entropy=False, entropy_grad=True)
    with pytest.raises(ValueError, match="valid_vocab_size"):
        f(x, t, valid_vocab_size=11)
    with pytest.raises(ValueError, match="share a floating dtype"):
        fused_linear_logprobs_entropy(torch.randn(4, 3), torch.randn(10, 3).double(), t)


@pytest.mark.parametrize("dtype,temperature", [
    (torch.float32, 1.0),   # read in place, gradient written straight into its slice
    (torch.float32, 0.7),   # tile copied (temperature), gradient in place
    (torch.bfloat16, 1.0),  # tile upcast, gradient rounded from an fp32 tile buffer
    (torch.float64, 1.3),
])
def test_multi_row_tiles_and_partial_tiles(monkeypatch, dtype, temperature):
    """Several tiles per chunk, a partial last tile and a partial last chunk, against fp64."""
    import megatron_stare.ops.vocab_parallel as vp

    monkeypatch.setattr(vp, "TILE_ELEMS", 3 * 40)  # 3 rows of 40 columns per tile
    g = torch.Generator().manual_seed(6)
    x64 = torch.randn(23, 45, generator=g, dtype=torch.float64) * 3
    t = torch.randint(0, 40, (23,), generator=g)
    g1, g2 = torch.randn(23, generator=g, dtype=torch.float64), torch.randn(
        23, generator=g, dtype=torch.float64)
    x = x64.to(dtype).requires_grad_()
    out = vocab_parallel_logprobs_entropy(x, t, valid_vocab_size=40, temperature=temperature,
                                          entropy_grad=True, with_sensitivity=True, chunk_size=8)
    xr = x.detach().double().requires_grad_()
    ref = reference(xr, t, 40, temperature)
    tol = 1e-10 if dtype == torch.float64 else 2e-6
    for got, want in zip((out.logprobs, out.entropy, out.sum_p2, out.sum_p2_logp), ref):
        torch.testing.assert_close(got.double(), want.detach(), atol=tol, rtol=tol)
    (gx,) = torch.autograd.grad(_loss((out.logprobs, out.entropy), g1.to(out.logprobs),
                                      g2.to(out.logprobs)), x)
    (rx,) = torch.autograd.grad(_loss(ref, g1, g2), xr)
    gtol = {torch.bfloat16: 4e-3, torch.float32: 1e-6, torch.float64: 1e-10}[dtype]
    torch.testing.assert_close(gx.double(), rx, atol=gtol * rx.abs().max().item(), rtol=gtol)
    assert torch.all(gx[:, 40:] == 0)


def test_entropy_only_gradient_and_calls_with_different_shapes():
    """Backward with only the entropy term (no log-prob gradient), and calls whose shapes differ
    (the tile buffers are per call) give the reference every time."""
    g = torch.Generator().manual_seed(8)
    for T, V in ((9, 31), (17, 5), (9, 31), (1, 1)):
        x = torch.randn(T, V, generator=g, dtype=torch.float64, requires_grad=True)
        t = torch.randint(0, V, (T,), generator=g)
        gh = torch.randn(T, generator=g, dtype=torch.float64)
        out = vocab_parallel_logprobs_entropy(x, t, entropy_grad=True, chunk_size=4)
        (gx,) = torch.autograd.grad((out.entropy * gh).sum(), x)
        ref = reference(x, t, V)
        (rx,) = torch.autograd.grad((ref[1] * gh).sum(), x)
        torch.testing.assert_close(out.logprobs, ref[0].detach(), atol=1e-12, rtol=0)
        torch.testing.assert_close(gx, rx, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_calls_on_the_same_logits_accumulate_their_gradients(dtype):
    """Two graphs over the same tensor: each backward recomputes from the caller's logits, so
    the gradient of the sum is twice the gradient of one call (nothing is overwritten)."""
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(11, 70, generator=g) * 2).to(dtype).requires_grad_()
    t = torch.randint(0, 70, (11,), generator=g)
    x0 = x.detach().clone()
    a = vocab_parallel_logprobs_entropy(x, t, entropy_grad=True, chunk_size=4)
    b = vocab_parallel_logprobs_entropy(x, t, entropy_grad=True, chunk_size=4)
    (one,) = torch.autograd.grad(a.logprobs.sum() + a.entropy.sum(), x, retain_graph=True)
    (two,) = torch.autograd.grad(a.logprobs.sum() + a.entropy.sum() + b.logprobs.sum()
                                 + b.entropy.sum(), x)
    assert torch.equal(x.detach(), x0)  # the caller's logits are never written
    torch.testing.assert_close(two.float(), 2 * one.float(), atol=1e-2 if dtype == torch.bfloat16
                               else 1e-6, rtol=0)
