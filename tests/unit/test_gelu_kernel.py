"""lmlab's one-pass bias + GELU operator for the MLP's up projection in bf16 CPU training
(torch.ops.lmlab.gelu_bf16, lmlab.nn.train_kernel.gelu_up): the float64 formula, its gradients
and bias gradient, non-finite values, thread counts, second-order gradients, and whole models
against the path it replaces (addmm + torch's gelu)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmlab.nn import train_kernel
from tests.helpers import tiny_model_config

needs_kernel = pytest.mark.skipif(
    not train_kernel.available() or train_kernel._build_kind() == "generic",
    reason="the training kernels are not built for AVX-512 here",
)

HALF_ULP = 2.0**-8  # one rounding to bfloat16 moves a value by at most 2^-8 of itself


def _gelu64(z: torch.Tensor, tanh: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """gelu(z) and gelu'(z) in float64: the exact erf form, or the tanh approximation."""
    z = z.double()
    if tanh:
        k, c = math.sqrt(2.0 / math.pi), 0.044715
        t = torch.tanh(k * (z + c * z**3))
        return 0.5 * z * (1 + t), 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * k * (1 + 3 * c * z * z)
    cdf = 0.5 * (1.0 + torch.erf(z / math.sqrt(2.0)))
    pdf = torch.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return z * cdf, cdf + z * pdf


def _run(u, bias, g, tanh=False):
    u = u.detach().clone().requires_grad_()
    b = None if bias is None else bias.detach().clone().requires_grad_()
    a = torch.ops.lmlab.gelu_bf16(u, b, tanh)
    a.backward(g)
    return a, u.grad, None if b is None else b.grad


@needs_kernel
@pytest.mark.parametrize(
    "m,n,bias",
    [
        (1, 1, True),
        (3, 15, True),
        (7, 16, False),
        (63, 17, True),
        (64, 48, True),
        (65, 100, False),
        (300, 33, True),
        (129, 1024, True),
    ],
)
@pytest.mark.parametrize("tanh", [False, True])
def test_gelu_bf16_is_the_float64_formula_rounded_once(m, n, bias, tanh):
    # forward: gelu(u + bias) in float32, rounded once to bf16; backward: g gelu'(u + bias)
    # rounded once; the bias gradient: the float32 column sums of that gradient before its
    # rounding (the float32 gradient of z = u + bias, as the ATen formula's autograd sums it)
    torch.manual_seed(m * 1000 + n)
    u = (torch.randn(m, n) * 3).bfloat16()
    b = torch.randn(n) * 0.7 if bias else None
    g = torch.randn(m, n).bfloat16()
    a, du, db = _run(u, b, g, tanh)
    z = u.double() + (b.double() if bias else 0.0)
    ref, slope = _gelu64(z, tanh)
    # within half a bf16 spacing of the value, plus the float32 formula's own error
    tol = HALF_ULP * ref.abs() + 1e-6 * (1.0 + z.abs())
    assert ((a.double() - ref).abs() <= tol).all()
    ref_du = g.double() * slope
    tol_du = HALF_ULP * ref_du.abs() + 1e-6 * g.double().abs() * (1.0 + z.abs())
    assert ((du.double() - ref_du).abs() <= tol_du).all()
    assert du.dtype == torch.bfloat16 and a.dtype == torch.bfloat16
    if bias:
        assert db.dtype == torch.float32 and db.shape == (n,)
        # the float64 formula's sum, within the float32 formula's error and the float32 sum's
        slack = (1e-6 * g.double().abs() * (1.0 + z.abs()) + 1e-6 * ref_du.abs()).sum(0)
        assert ((db.double() - ref_du.sum(0)).abs() <= slack).all()


@needs_kernel
@pytest.mark.parametrize("tanh", [False, True])
def test_gelu_bf16_agrees_with_the_path_it_replaces(tanh):
    # torch's path: the bias added inside the bf16 matmul (rounded), then F.gelu on bf16; the
    # operator keeps u + bias in float32, so the two agree to bf16 rounding, not bit for bit
    torch.manual_seed(3)
    u = (torch.randn(256, 512) * 2).bfloat16()
    b = torch.randn(512) * 0.3
    g = torch.randn(256, 512).bfloat16()
    a, du, db = _run(u, b, g, tanh)
    ut = u.detach().clone().requires_grad_()
    bt = b.detach().clone().requires_grad_()
    at = F.gelu(ut + bt.bfloat16(), approximate="tanh" if tanh else "none")
    at.backward(g)
    assert (a.float() - at.float()).abs().max() <= 4 * HALF_ULP * at.float().abs().max()
    assert (du.float() - ut.grad.float()).abs().max() <= 4 * HALF_ULP * ut.grad.float().abs().max()
    assert torch.allclose(db, bt.grad, rtol=2e-2, atol=2e-2 * bt.grad.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("tanh", [False, True])
def test_gelu_bf16_keeps_non_finite_values_to_their_element(tanh):
    # gelu(inf) = inf (the limit; torch's vectorised CPU gelu gives NaN there), gelu(-inf) =
    # -inf * 0 = NaN (as torch), NaN stays NaN; huge finite values: z and -0
    u = torch.zeros(3, 40).bfloat16()
    u[0, 5], u[1, 17], u[2, 33] = float("inf"), float("-inf"), float("nan")
    u[0, 6], u[1, 18] = 1e30, -1e30
    a, du, _ = _run(u, torch.zeros(40), torch.ones(3, 40).bfloat16(), tanh)
    assert a[0, 5].item() == float("inf") and a[0, 6].item() == u[0, 6].item()
    assert a[1, 17].isnan() and a[2, 33].isnan() and a[1, 18].item() == 0.0
    bad = a.float().isnan() | a.float().isinf()
    assert bad.sum() == 3  # nothing spread to the neighbours
    rest = torch.ones_like(bad)
    rest[0, 5:7], rest[1, 17:19], rest[2, 33] = False, False, False
    assert torch.equal(a.float()[rest], torch.zeros(int(rest.sum())))  # gelu(0) = 0 exactly
    # the slope's limits at +-inf and huge z: 1 and 0 (torch's CPU kernels give NaN for inf,
    # and for the tanh form's 1e30), NaN for NaN
    assert du[0, 5].item() == 1.0 and du[1, 17].item() == 0.0 and du[2, 33].isnan()
    assert du[0, 6].item() == 1.0 and du[1, 18].item() == 0.0
    assert du.float().isnan().sum() == 1 and not du.float().isinf().any()


@needs_kernel
def test_gelu_bf16_bias_gradient_is_the_same_bits_for_any_thread_count():
    torch.manual_seed(5)
    u = torch.randn(1000, 96).bfloat16()
    b, g = torch.randn(96), torch.randn(1000, 96).bfloat16()
    threads = torch.get_num_threads()
    try:
        results = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            results.append(_run(u, b, g))
    finally:
        torch.set_num_threads(threads)
    for a, du, db in results[1:]:
        assert torch.equal(a, results[0][0]) and torch.equal(du, results[0][1])
        assert torch.equal(db, results[0][2])


@needs_kernel
def test_gelu_bf16_reads_strided_and_negated_views_as_their_values():
    torch.manual_seed(6)
    base = torch.randn(20, 64).bfloat16()
    b, g = torch.randn(32), torch.randn(20, 32).bfloat16()
    want = _run(base[:, ::2].contiguous(), b, g)
    got = _run(base[:, ::2], b, g)
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x, y)
    neg = _run(torch._neg_view(base[:, :32].contiguous()), torch._neg_view(b), g)
    pos = _run(-base[:, :32], -b, g)
    for x, y in zip(neg, pos, strict=True):
        assert torch.equal(x, y)


@needs_kernel
def test_gelu_bf16_zero_gradient_and_empty_input():
    u = torch.randn(4, 16).bfloat16().requires_grad_()
    b = torch.randn(16).requires_grad_()
    out = torch.ops.lmlab.gelu_bf16(u, b)
    zero = torch._efficientzerotensor((4, 16), dtype=torch.bfloat16)
    du, db = torch.autograd.grad(out, (u, b), zero)
    assert torch.equal(du, torch.zeros_like(du)) and torch.equal(db, torch.zeros_like(db))
    e = torch.empty(0, 16).bfloat16().requires_grad_()
    a = torch.ops.lmlab.gelu_bf16(e, b)
    a.sum().backward()
    assert a.shape == (0, 16) and torch.equal(b.grad, torch.zeros(16))


@needs_kernel
@pytest.mark.parametrize("tanh", [False, True])
def test_gelu_bf16_second_order_gradients_are_the_aten_formulas(tanh):
    # create_graph: the backward runs the formula as ATen ops, so a gradient penalty works
    torch.manual_seed(7)
    u0, b0 = (torch.randn(6, 32) * 2).bfloat16(), torch.randn(32)
    grads = []
    form = "tanh" if tanh else "none"
    for fn in (
        lambda u, b: torch.ops.lmlab.gelu_bf16(u, b, tanh),
        lambda u, b: F.gelu(u.float() + b, approximate=form).bfloat16(),
    ):
        u, b = u0.clone().requires_grad_(), b0.clone().requires_grad_()
        (gu,) = torch.autograd.grad(fn(u, b).float().pow(2).sum(), u, create_graph=True)
        gu.float().pow(2).sum().backward()
        grads.append((u.grad, b.grad))
    for x, y in zip(*grads, strict=True):
        assert torch.allclose(x.float(), y.float(), rtol=3e-2, atol=1e-2 * y.abs().max().item())


def _model(bias=True, activation="gelu", **overrides):
    from lmlab.models import build_model

    cfg = tiny_model_config(
        61, d_model=64, attention={"n_heads": 2}, ffn={"bias": bias, "activation": activation}
    )
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(11)
    return build_model(cfg)


def _bf16_step(model, monkeypatch, kernel: bool):
    monkeypatch.setattr(train_kernel, "TRAIN_GELU_KERNEL", kernel)
    model.zero_grad()
    ran = []
    real = torch.ops.lmlab.gelu_bf16

    class Spy:
        def __call__(self, *a):
            ran.append(1)
            return real(*a)

    monkeypatch.setattr(torch.ops.lmlab, "gelu_bf16", Spy(), raising=False)
    x = torch.randint(0, 61, (3, 21), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, targets=x).loss
    loss.backward()
    monkeypatch.setattr(torch.ops.lmlab, "gelu_bf16", real, raising=False)
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, len(ran)


@needs_kernel
@pytest.mark.parametrize("bias,activation", [(True, "gelu"), (False, "gelu"), (True, "gelu_tanh")])
def test_a_bf16_training_step_takes_the_operator_with_the_same_function(
    bias, activation, monkeypatch
):
    m = _model(bias=bias, activation=activation)
    loss_k, grads_k, calls = _bf16_step(m, monkeypatch, kernel=True)
    loss_t, grads_t, none = _bf16_step(m, monkeypatch, kernel=False)
    assert calls == len(m.layers) and none == 0  # every layer's MLP took it, and only with it on
    assert abs(loss_k - loss_t) <= 1e-2 * abs(loss_t)
    for name, g in grads_t.items():
        scale = g.abs().max().item() + 1e-12
        assert (grads_k[name] - g).abs().max().item() <= 0.06 * scale, name
    if bias:
        up = m.layers[0].ffn.up_proj.bias.grad
        assert up is not None and up.dtype == torch.float32 and up.abs().sum() > 0


@needs_kernel
def test_the_operator_is_not_taken_where_it_does_not_apply(monkeypatch):
    # float32 training, evaluation, another activation, a hook on up_proj: torch's ops
    m = _model()
    x = torch.randint(0, 61, (2, 9))
    calls = []
    real = torch.ops.lmlab.gelu_bf16
    monkeypatch.setattr(
        torch.ops.lmlab, "gelu_bf16", lambda *a: calls.append(1) or real(*a), raising=False
    )
    m(x, targets=x).loss.backward()  # float32
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        m(x)
    handle = m.layers[0].ffn.up_proj.register_forward_hook(lambda *a: None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(x, targets=x).loss.backward()
    handle.remove()
    assert len(calls) == len(m.layers) - 1  # only the layers without the hook
    calls.clear()
    relu = _model(activation="relu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        relu(x, targets=x).loss.backward()
    assert calls == []


@needs_kernel
@pytest.mark.parametrize("tanh", [False, True])
def test_gelu_bf16_rounds_every_column_alike_subnormals_included(tanh):
    # the last N % 16 columns run the same vector code, masked: a subnormal result is rounded
    # (or flushed, where the CPU's bf16 conversion flushes) the same in every column
    u = torch.full((3, 37), 2e-39).bfloat16()
    a = torch.ops.lmlab.gelu_bf16(u, None, tanh)
    assert torch.equal(a, a[:, :1].expand_as(a))
    u = torch.zeros(3, 37).bfloat16().requires_grad_()
    b = torch.zeros(37, requires_grad=True)
    torch.ops.lmlab.gelu_bf16(u, b, tanh).backward(torch.full((3, 37), 1.5e-38).bfloat16())
    assert torch.equal(u.grad, u.grad[:, :1].expand_as(u.grad))
    assert torch.equal(b.grad, b.grad[:1].expand_as(b.grad))
    # -0 without a bias: every column keeps its sign (nothing adds a +0 bias to the tail)
    a = torch.ops.lmlab.gelu_bf16(torch.full((2, 37), -0.0).bfloat16(), None, tanh)
    bits = a.view(torch.int16)
    assert torch.equal(bits, bits[:, :1].expand_as(bits))
