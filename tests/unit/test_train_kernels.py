"""lmlab's training kernels (lmlab.nn.train_kernel): bias + GELU and the causal softmax, each
against the float64 formula (to one rounding of the tensor's dtype), their gradients likewise,
NaN kept, the bias gradient the same bits for any thread count; and the model paths that take
them (the MLP's up projection, the bf16 batched-matmul attention) only where they apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lmlab.nn.attention_core as core
import lmlab.nn.ffn as ffn
from lmlab.models import build_model
from lmlab.nn import train_kernel
from tests.helpers import tiny_model_config

needs_kernel = pytest.mark.skipif(not train_kernel.available(), reason=train_kernel.status())
V = 37


def _gelu64(z: torch.Tensor, approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    """gelu(z) and gelu'(z) in float64, from erfc (exact in the far negative tail)."""
    z = z.double()
    if approximate == "tanh":
        k, a = (2 / torch.pi) ** 0.5, 0.044715
        th = torch.tanh(k * (z + a * z**3))
        return 0.5 * z * (1 + th), 0.5 * (1 + th) + 0.5 * z * (1 - th**2) * k * (1 + 3 * a * z**2)
    cdf = 0.5 * torch.special.erfc(-z / 2**0.5)
    pdf = torch.exp(-0.5 * z * z) / (2 * torch.pi) ** 0.5
    return z * cdf, cdf + z * pdf


def _ulps(x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, floor: float) -> torch.Tensor:
    """|x - ref| in units of dtype's relative precision of |ref| (at least ``floor``)."""
    eps = torch.finfo(dtype).eps
    return (x.double() - ref).abs() / (ref.abs().clamp_min(floor) * eps)


@needs_kernel
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize(
    ("dtype", "bias_dtype", "f"),
    [
        (torch.bfloat16, torch.float32, 1024),  # autocast's: bf16 activations, float32 bias
        (torch.bfloat16, torch.float32, 37),  # columns past the last 16-wide block
        (torch.bfloat16, torch.bfloat16, 16),
        (torch.bfloat16, None, 48),
        (torch.float32, torch.float32, 21),
    ],
)
def test_bias_gelu_is_the_formula_forward_and_backward(approximate, dtype, bias_dtype, f):
    torch.manual_seed(0)
    h = (torch.randn(3, 40, f) * 3).to(dtype).requires_grad_()
    b = None if bias_dtype is None else torch.randn(f).to(bias_dtype).requires_grad_()
    y = train_kernel.bias_gelu(h, b, approximate)
    assert y.shape == h.shape and y.dtype == dtype
    g = torch.randn(y.shape).to(dtype)
    y.backward(g)
    z = h.detach().double() + (0 if b is None else b.detach().double())
    ref, dref = _gelu64(z, approximate)
    dh = g.double() * dref
    if dtype == torch.bfloat16:  # float32 arithmetic, then one rounding to bfloat16
        assert _ulps(y, ref, dtype, 1e-3).max() <= 1.0
        assert _ulps(h.grad, dh, dtype, 1e-3).max() <= 1.0
    else:  # float32: the fits' absolute errors (erf 6e-7; tanh's 1 - th^2 cancels for large z)
        grow = (1 + z.abs()) ** (3 if approximate == "tanh" else 1)
        assert ((y.double() - ref).abs() <= 2e-6 * (1 + z.abs())).all()
        assert ((h.grad.double() - dh).abs() <= 2e-6 * g.double().abs() * grow).all()
    if b is not None:
        assert b.grad.dtype == b.dtype
        db = h.grad.double().sum(dim=(0, 1))  # the column sums of dh as stored, in float32
        rounding = torch.finfo(b.dtype).eps / 2 * db.abs()  # then rounded to the bias's dtype
        assert ((b.grad.double() - db).abs() <= rounding + 1e-5 * db.abs().max()).all()


@needs_kernel
def test_bias_gelu_at_the_ends_of_the_line():
    z = torch.tensor([-12.0, -9.0, -6.0, 0.0, 6.0, 12.0, float("inf")])
    y = train_kernel.bias_gelu(z, None)
    assert y[3] == 0 and torch.equal(y[4:], z[4:])  # gelu(0) = 0; Phi(z) = 1 in float32 from 6
    assert (y[:3].abs() <= 6e-7 * z[:3].abs()).all()  # Phi's absolute error, times |z|


@needs_kernel
def test_bias_gelu_keeps_nan_where_it_was():
    h = torch.randn(4, 32).bfloat16().requires_grad_()
    with torch.no_grad():
        h[1, 5] = float("nan")
    b = torch.zeros(32, requires_grad=True)
    y = train_kernel.bias_gelu(h, b)
    assert y[1, 5].isnan() and not y[0].isnan().any() and y.isnan().sum() == 1
    y.sum().backward()
    assert h.grad[1, 5].isnan() and h.grad.isnan().sum() == 1
    assert b.grad[5].isnan() and b.grad.isnan().sum() == 1


@needs_kernel
def test_bias_gradient_is_the_same_bits_for_any_thread_count():
    torch.manual_seed(1)
    h = torch.randn(999, 96).bfloat16()
    b = torch.randn(96)
    g = torch.randn(999, 96).bfloat16()
    before = torch.get_num_threads()
    grads = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            hh, bb = h.clone().requires_grad_(), b.clone().requires_grad_()
            train_kernel.bias_gelu(hh, bb).backward(g)
            grads.append((hh.grad, bb.grad))
    finally:
        torch.set_num_threads(before)
    for dh, db in grads[1:]:
        assert torch.equal(dh, grads[0][0]) and torch.equal(db, grads[0][1])


def test_bias_gelu_refuses_an_approximation_it_does_not_compute():
    with pytest.raises(ValueError, match="approximate"):
        train_kernel.bias_gelu(torch.ones(2, 3), None, "erf")


def _mlp_model(activation: str = "gelu", bias: bool = True):
    cfg = tiny_model_config(
        V, attention={"n_heads": 4}, ffn={"activation": activation, "bias": bias}
    )
    torch.manual_seed(0)
    m = build_model(cfg)
    with torch.no_grad():  # biases away from 0, so that the fused add is exercised
        for name, p in m.named_parameters():
            if name.endswith("up_proj.bias"):
                p.normal_(0, 0.5)
    return m


def _step(m, flag: bool, monkeypatch, autocast: bool = True, min_elements: int = 0):
    monkeypatch.setattr(ffn, "TRAIN_GELU_KERNEL", flag)
    monkeypatch.setattr(ffn, "TRAIN_GELU_KERNEL_MIN_ELEMENTS", min_elements)  # tiny shapes here
    took: list[int] = []
    real = train_kernel.bias_gelu
    monkeypatch.setattr(train_kernel, "bias_gelu", lambda *a: took.append(1) or real(*a))
    m.zero_grad()
    x = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = m(x, targets=x)
    out.loss.backward()
    return out.loss.item(), {n: p.grad.clone() for n, p in m.named_parameters()}, len(took)


@needs_kernel
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_mlp_training_step_takes_the_kernel_with_the_same_function(activation, monkeypatch):
    m = _mlp_model(activation)
    loss0, grads0, took0 = _step(m, False, monkeypatch)
    loss1, grads1, took1 = _step(m, True, monkeypatch)
    assert took0 == 0 and took1 == len(m.layers)
    assert abs(loss1 - loss0) < 2e-3
    for name, g0 in grads0.items():  # the same gradients, to bf16 rounding
        scale = g0.abs().max().item() + 1e-6
        assert (grads1[name] - g0).abs().max().item() <= 0.06 * scale, name


@needs_kernel
def test_mlp_keeps_torch_ops_where_the_kernel_does_not_apply(monkeypatch):
    m = _mlp_model()
    assert _step(m, True, monkeypatch, autocast=False)[2] == 0  # float32 training
    assert _step(_mlp_model("relu"), True, monkeypatch)[2] == 0  # not a GELU
    hooked = _mlp_model()
    handle = hooked.layers[0].ffn.up_proj.register_forward_hook(lambda *a: None)
    try:  # a hooked up_proj is called as a module (the hook runs), the other layers fuse
        assert 0 < _step(hooked, True, monkeypatch)[2] < len(hooked.layers)
    finally:
        handle.remove()
    with train_kernel.disabled():
        assert _step(m, True, monkeypatch)[2] == 0
    # below the size where the kernel pays (2 x 12 tokens x d_ff here): torch's ops
    assert _step(m, True, monkeypatch, min_elements=2 * 12 * m.cfg.d_ff + 1)[2] == 0
    assert _step(m, True, monkeypatch, min_elements=2 * 12 * m.cfg.d_ff)[2] == len(m.layers)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # inference
        took: list[int] = []
        real = train_kernel.bias_gelu
        monkeypatch.setattr(train_kernel, "bias_gelu", lambda *a: took.append(1) or real(*a))
        m(torch.randint(0, V, (1, 5)))
        assert not took


# ---- causal softmax ---------------------------------------------------------------------


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
    ("h", "bias", "match"),
    [
        (torch.ones(4, 8), torch.ones(7), "bias must have shape"),  # would read past its end
        (torch.ones(4, 8, dtype=torch.float64), None, "float32 or bfloat16"),
        (torch.ones(4, 8, device="meta"), None, "CPU tensor"),  # no CPU pointer to hand over
        (torch.ones(4, 8), torch.ones(8, dtype=torch.float16), "bias must be float32"),
        (torch.ones(4, 0), None, "last dim"),
    ],
)
def test_bias_gelu_refuses_what_the_kernel_cannot_read(h, bias, match):
    with pytest.raises(ValueError, match=match):
        train_kernel.bias_gelu(h, bias)


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
