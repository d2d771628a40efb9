"""lmlab's training kernels (lmlab.nn.train_kernel): the causal softmax against the float64
formula (to one rounding of the scores' dtype), its backward likewise, NaN kept to its row,
inputs it cannot read refused; and the bf16 batched-matmul attention that takes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lmlab.nn.attention_core as core
from lmlab.nn import train_kernel

needs_kernel = pytest.mark.skipif(not train_kernel.available(), reason=train_kernel.status())


def _ulps(x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, floor: float) -> torch.Tensor:
    """|x - ref| in units of dtype's relative precision of |ref| (at least ``floor``)."""
    eps = torch.finfo(dtype).eps
    return (x.double() - ref).abs() / (ref.abs().clamp_min(floor) * eps)


def _masked_softmax64(s: torch.Tensor) -> torch.Tensor:
    t = s.shape[-1]
    above = torch.ones(t, t, dtype=torch.bool).triu(1)
    return torch.softmax(s.double().masked_fill(above, float("-inf")), dim=-1)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t", [1, 2, 15, 16, 17, 64, 100])
def test_causal_softmax_is_masked_softmax_forward_and_backward(dtype, t):
    torch.manual_seed(t)
    s = (torch.randn(3, t, t) * 4).to(dtype)
    ref = _masked_softmax64(s)
    p = train_kernel.causal_softmax_(s.clone())
    assert (p.triu(1) == 0).all()  # nothing above the diagonal, exactly
    assert _ulps(p, ref, dtype, 1e-6).max() <= (1.0 if dtype == torch.bfloat16 else 8.0)  # exp fit
    dp = torch.randn(3, t, t).to(dtype)
    pd = p.double()
    dref = pd * (dp.double() - (pd * dp.double()).sum(-1, keepdim=True))
    ds = train_kernel.causal_softmax_backward_(p, dp.clone())
    assert (ds.triu(1) == 0).all()
    tol = (1 if dtype == torch.bfloat16 else 64) * torch.finfo(dtype).eps
    assert ((ds.double() - dref).abs() <= tol * (dref.abs() + pd * dp.double().abs().max())).all()


@needs_kernel
def test_causal_softmax_keeps_nan_in_its_row():
    s = torch.randn(1, 8, 8).bfloat16()
    s[0, 5, 2] = float("nan")
    p = train_kernel.causal_softmax_(s)
    assert p[0, 5, :6].isnan().all() and not p[0, :5].isnan().any() and not p[0, 6:].isnan().any()


@needs_kernel
def test_bmm_attention_takes_the_softmax_kernel_with_the_same_function(monkeypatch):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 16).bfloat16().requires_grad_() for _ in range(3))
    g = torch.randn(2, 3, 40, 16).bfloat16()
    took: list[int] = []
    real = train_kernel.causal_softmax_
    monkeypatch.setattr(train_kernel, "causal_softmax_", lambda s: took.append(1) or real(s))
    results = []
    for flag in (False, True):
        monkeypatch.setattr(core, "TRAIN_SOFTMAX_KERNEL", flag)
        out = core.causal_attention_bmm(q, k, v, 0.25)
        results.append((out, *torch.autograd.grad(out, (q, k, v), g)))
    assert took == [1]
    exact = F.scaled_dot_product_attention(
        *(x.double() for x in (q, k, v)), is_causal=True, scale=0.25
    )
    for a, b in zip(results[0], results[1], strict=True):  # the same to bf16 rounding
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    assert (results[1][0].double() - exact).abs().max() < 2e-2


@pytest.mark.parametrize(
    "scores",
    [
        torch.ones(2, 4, 5),
        torch.ones(4, 4),
        torch.ones(2, 4, 4).transpose(1, 2),
        torch.ones(2, 4, 4, dtype=torch.int32),
    ],
)
def test_causal_softmax_refuses_what_the_kernel_cannot_read(scores):
    with pytest.raises(ValueError, match="contiguous"):
        train_kernel.causal_softmax_(scores)
    if scores.dim() == 3 and scores.shape[1] == scores.shape[2] and scores.dtype == torch.float32:
        with pytest.raises(ValueError, match="contiguous"):
            train_kernel.causal_softmax_backward_(scores, torch.ones(2, 4, 4))


@needs_kernel
def test_causal_softmax_refuses_tensors_autograd_tracks_and_marks_its_writes():
    # the kernel writes through the data pointer, outside autograd: a tensor that records
    # gradients would keep a graph that no longer describes its values (silently wrong grads)
    x = torch.randn(2, 4, 4, requires_grad=True)
    with pytest.raises(ValueError, match="records gradients"):
        train_kernel.causal_softmax_(x * 2)  # x * 2's backward ignores the softmax
    with pytest.raises(ValueError, match="records gradients"):
        train_kernel.causal_softmax_(x)
    p = train_kernel.causal_softmax_(torch.randn(2, 4, 4))
    with pytest.raises(ValueError, match="records gradients"):
        train_kernel.causal_softmax_backward_(p, x * 2)
    # an in-place write is counted, as torch's own in-place ops count theirs: a graph that saved
    # the tensor before (here: under no_grad it records nothing) sees the change
    s = torch.randn(2, 4, 4)
    before = s._version
    train_kernel.causal_softmax_(s)
    assert s._version > before
    before = p._version
    g = torch.randn(2, 4, 4)
    before_g = g._version
    train_kernel.causal_softmax_backward_(p, g)
    assert g._version > before_g and p._version == before
    y = torch.randn(2, 4, 4, requires_grad=True)
    e = y.exp()  # saves its output
    with torch.no_grad():
        train_kernel.causal_softmax_(e)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        e.sum().backward()


@needs_kernel
def test_bmm_attention_backward_with_create_graph_keeps_torch_softmax_backward(monkeypatch):
    # a gradient that records gradients (create_graph with a differentiable grad_out) reaches
    # the backward: the in-place kernel must not take it (it would refuse it)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8).bfloat16().requires_grad_() for _ in range(3))
    g = torch.randn(1, 2, 6, 8).bfloat16().requires_grad_()
    grads = {}
    for on in (True, False):
        monkeypatch.setattr(core, "TRAIN_SOFTMAX_KERNEL", on)
        out = core.causal_attention_bmm(q, k, v, 0.35)
        grads[on] = torch.autograd.grad(out, (q, k, v), g, create_graph=True)
    for a, b in zip(grads[True], grads[False], strict=True):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@needs_kernel
def test_causal_softmax_backward_refuses_a_grad_overlapping_probs_in_part():
    # rows would read P values the kernel already overwrote with dS: wrong numbers, no error
    buf = torch.rand(40)
    probs, grad = buf[:32].view(2, 4, 4), buf[4:36].view(2, 4, 4)
    with pytest.raises(ValueError, match="overlaps probs"):
        train_kernel.causal_softmax_backward_(probs, grad)
    # the very same tensor is fine (each element is read before it is written)
    p = train_kernel.causal_softmax_(torch.randn(2, 5, 5))
    want = train_kernel.causal_softmax_backward_(p, p.clone())
    assert torch.equal(train_kernel.causal_softmax_backward_(p, p), want)
