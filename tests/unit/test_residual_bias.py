"""The residual add that also adds a residual projection's bias in bf16 CPU training
(torch.ops.lmlab.add_f32_bf16 with ``bias``; lmlab.nn.ffn.residual_parts, Block.add_ffn): the
float32 formula, its gradients (the branch's as autograd's cast, the bias's against float64),
thread counts, views, zero and second-order gradients, refusals, and whole models against the
path it replaces (the biased addmm, then the add); where it is and is not taken."""

from __future__ import annotations

import pytest
import torch

from lmlab.nn import train_kernel
from tests.helpers import tiny_model_config

needs_kernel = pytest.mark.skipif(not train_kernel.available(), reason=train_kernel.status())


def _run(x, y, b, g):
    x = x.detach().clone().requires_grad_()
    y = y.detach().clone().requires_grad_()
    b = b.detach().clone().requires_grad_()
    out = torch.ops.lmlab.add_f32_bf16(x, y, b)
    out.backward(g)
    return out, x.grad, y.grad, b.grad


@needs_kernel
@pytest.mark.parametrize(
    "shape", [(1, 1), (3, 15), (7, 16), (63, 17), (64, 48), (2, 33, 100), (300, 33), (129, 256)]
)
def test_add_with_bias_is_the_float32_formula_and_its_gradients(shape):
    torch.manual_seed(shape[-1])
    n = shape[-1]
    x, y = torch.randn(shape) * 3, torch.randn(shape).bfloat16()
    b, g = torch.randn(n), torch.randn(shape)
    out, dx, dy, db = _run(x, y, b, g)
    # x + (y + b) in float32, the same two roundings in the same order: the same bits
    assert torch.equal(out, x + (y.float() + b))
    assert torch.equal(dx, g)  # the stream's gradient is g itself
    assert torch.equal(dy, g.bfloat16())  # the branch's: g rounded, as autograd's cast gives it
    ref = g.double().reshape(-1, n).sum(0)  # the bias's: float32 column sums vs float64
    bound = 1e-6 * g.double().abs().reshape(-1, n).sum(0) + 1e-30
    assert db.dtype == torch.float32 and ((db.double() - ref).abs() <= bound).all()


@needs_kernel
def test_add_with_bias_agrees_with_the_path_it_replaces():
    # autograd's x + (addmm's bf16 y + bias): the bias rounded to bf16 and the sum rounded; the
    # operator keeps y + bias in float32: equal to bf16 rounding of the branch
    torch.manual_seed(3)
    x, h, w = torch.randn(40, 64), torch.randn(40, 96), torch.randn(64, 96) * 0.1
    b, g = torch.randn(64), torch.randn(40, 64)
    ref_leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = ref_leaves[0] + torch.nn.functional.linear(h, ref_leaves[1], ref_leaves[2])
    ref.backward(g)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.nn.functional.linear(h, leaves[1])
    out = torch.ops.lmlab.add_f32_bf16(leaves[0], y, leaves[2])
    out.backward(g)
    branch = (ref - x).abs().max().item()
    assert (out - ref).abs().max().item() <= 2 * 2.0**-8 * branch
    assert torch.equal(leaves[0].grad, ref_leaves[0].grad)
    assert torch.equal(leaves[1].grad, ref_leaves[1].grad)  # the same bf16 dy into the mm
    gb = ref_leaves[2].grad
    assert (leaves[2].grad - gb).abs().max().item() <= 2e-2 * gb.abs().max().item()


@needs_kernel
def test_add_with_bias_is_the_same_bits_for_any_thread_count():
    torch.manual_seed(5)
    x, y = torch.randn(1000, 96), torch.randn(1000, 96).bfloat16()
    b, g = torch.randn(96), torch.randn(1000, 96)
    threads = torch.get_num_threads()
    try:
        results = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            results.append(_run(x, y, b, g))
    finally:
        torch.set_num_threads(threads)
    for got in results[1:]:
        for a, want in zip(got, results[0], strict=True):
            assert torch.equal(a, want)


@needs_kernel
def test_add_with_bias_reads_strided_and_negated_biases_and_gradients_as_their_values():
    torch.manual_seed(6)
    x, y = torch.randn(20, 32), torch.randn(20, 32).bfloat16()
    base, g = torch.randn(64), torch.randn(20, 64)
    want = _run(x, y, base[::2].contiguous(), g[:, ::2].contiguous())
    got = _run(x, y, base[::2], g[:, ::2])  # a strided bias; a strided output gradient
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    neg = _run(x, y, torch._neg_view(base[:32].contiguous()), torch._neg_view(g[:, :32]))
    pos = _run(x, y, -base[:32], -g[:, :32])
    for a, b in zip(neg, pos, strict=True):
        assert torch.equal(a, b)


@needs_kernel
def test_add_with_bias_zero_gradient_empty_input_and_no_bias():
    x = torch.randn(4, 16, requires_grad=True)
    y = torch.randn(4, 16).bfloat16().requires_grad_()
    b = torch.randn(16, requires_grad=True)
    out = torch.ops.lmlab.add_f32_bf16(x, y, b)
    zero = torch._efficientzerotensor((4, 16))
    dx, dy, db = torch.autograd.grad(out, (x, y, b), zero)
    for t in (dx, dy, db):
        assert torch.equal(t, torch.zeros_like(t))
    e = torch.empty(0, 16, requires_grad=True)
    out = torch.ops.lmlab.add_f32_bf16(e, torch.empty(0, 16).bfloat16(), b)
    out.sum().backward()
    assert out.shape == (0, 16) and torch.equal(b.grad, torch.zeros(16))
    # bias None: the plain add, as before
    x.grad = None
    out = torch.ops.lmlab.add_f32_bf16(x, y)
    assert torch.equal(out, x + y.float())
    out.backward(torch.ones(4, 16))
    assert torch.equal(x.grad, torch.ones(4, 16))


@needs_kernel
def test_add_with_bias_second_order_gradients_are_the_aten_formulas():
    # create_graph: the backward records ATen ops, so a gradient of a gradient works
    torch.manual_seed(7)
    x0, y0, b0 = torch.randn(6, 32), torch.randn(6, 32).bfloat16(), torch.randn(32)
    results = []
    for fn in (
        lambda x, y, b: torch.ops.lmlab.add_f32_bf16(x, y, b),
        lambda x, y, b: x + (y.float() + b),
    ):
        x, y, b = (t.clone().requires_grad_() for t in (x0, y0, b0))
        out = fn(x, y, b)
        (gx,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
        gx.pow(2).sum().backward()
        results.append((x.grad, y.grad.float(), b.grad))
    for a, want in zip(*results, strict=True):
        assert torch.allclose(a, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@needs_kernel
def test_add_with_bias_refuses_what_it_cannot_read():
    x, y = torch.randn(3, 8), torch.randn(3, 8).bfloat16()
    bad = {
        "bias dtype": torch.randn(8).bfloat16(),
        "bias length": torch.randn(7),
        "bias rank": torch.randn(1, 8),
        "bias meta": torch.randn(8, device="meta"),
    }
    for what, b in bad.items():
        with pytest.raises(RuntimeError, match="lmlab.add_f32_bf16"):
            torch.ops.lmlab.add_f32_bf16(x, y, b)
        assert what


@needs_kernel
def test_add_with_bias_rounds_every_column_alike_subnormals_included():
    # the last N % 16 columns run the same vector code, masked
    x = torch.zeros(3, 37, requires_grad=True)
    y = torch.zeros(3, 37).bfloat16().requires_grad_()
    b = torch.zeros(37, requires_grad=True)
    torch.ops.lmlab.add_f32_bf16(x, y, b).backward(torch.full((3, 37), 1.5e-39))
    assert torch.equal(y.grad, y.grad[:, :1].expand_as(y.grad))
    assert torch.equal(b.grad, b.grad[:1].expand_as(b.grad))


# ------------------------------------------------------------------------------ in a model


def _model(ffn=None, **overrides):
    from lmlab.models import build_model

    cfg = tiny_model_config(
        61, d_model=64, attention={"n_heads": 2}, ffn=ffn or {"bias": True}, **overrides
    )
    torch.manual_seed(11)
    model = build_model(cfg)
    with torch.no_grad():  # biases off their zero init, so that where they are added matters
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    return model


def _bf16_step(model, monkeypatch, on: bool, autocast: bool = True):
    """loss, gradients and how many residual adds took a bias, of one step."""
    monkeypatch.setattr(train_kernel, "TRAIN_RESIDUAL_BIAS", on)
    model.zero_grad()
    took = []
    real = train_kernel.residual_add

    def spy(x, y, bias=None):
        took.append(bias is not None)
        return real(x, y, bias)

    monkeypatch.setattr(train_kernel, "residual_add", spy)
    x = torch.randint(0, 61, (3, 21), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(x, targets=x).loss
    loss.backward()
    monkeypatch.setattr(train_kernel, "residual_add", real)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, sum(took)


@needs_kernel
@pytest.mark.parametrize(
    "ffn", [{"bias": True}, {"bias": True, "activation": "relu"}, {"kind": "swiglu", "bias": True}]
)
def test_a_bf16_training_step_adds_the_down_bias_in_the_residual_add(ffn, monkeypatch):
    m = _model(ffn)
    loss_k, grads_k, folded = _bf16_step(m, monkeypatch, on=True)
    loss_t, grads_t, none = _bf16_step(m, monkeypatch, on=False)
    assert folded == len(m.layers) and none == 0  # every layer's FFN, and only with it on
    assert abs(loss_k - loss_t) <= 1e-2 * abs(loss_t)
    assert grads_k.keys() == grads_t.keys()
    top = max(g.abs().max().item() for g in grads_t.values())
    for name, g in grads_t.items():  # to bf16 rounding (tiny gradients: of the largest one)
        bound = 0.06 * g.abs().max().item() + 1e-3 * top
        assert (grads_k[name] - g).abs().max().item() <= bound, name
    down = m.layers[0].ffn.down_proj.bias.grad
    assert down is not None and down.dtype == torch.float32 and down.abs().sum() > 0
    # the bias's value counts: the same step without it is another loss
    for layer in m.layers:
        layer.ffn.down_proj.bias.data.zero_()
    assert abs(_bf16_step(m, monkeypatch, on=True)[0] - loss_k) > 1e-3


@needs_kernel
def test_a_frozen_bias_gets_no_gradient():
    x = torch.randn(8, 16, requires_grad=True)
    y = torch.randn(8, 16).bfloat16().requires_grad_()
    b = torch.randn(16)  # requires_grad False
    out = torch.ops.lmlab.add_f32_bf16(x, y, b)
    assert torch.equal(out, x + (y.float() + b))
    out.backward(torch.ones(8, 16))
    assert b.grad is None and torch.equal(y.grad, torch.ones(8, 16).bfloat16())


@needs_kernel
def test_the_down_bias_stays_in_the_projection_where_the_fold_does_not_apply(monkeypatch):
    from lmlab.hooks import hooks

    def folds(model, autocast=True) -> int:
        return _bf16_step(model, monkeypatch, on=True, autocast=autocast)[2]

    m = _model()
    n = len(m.layers)
    assert folds(m) == n
    assert folds(m, autocast=False) == 0  # float32 training
    assert folds(_model({"bias": False})) == 0  # no bias to add
    assert folds(_model(dropout=0.1)) == 0  # residual dropout between the projection and add
    assert folds(_model(block={"parallel": True})) == 0  # its two branches are summed first
    assert folds(_model(block={"kind": "post"})) == 0
    seen = []
    with hooks(m, {"layers.0.ffn.hook_out": lambda t, name: seen.append(t.dtype)}):
        assert folds(m) == n - 1  # a hooked output sees the biased projection
    assert seen == [torch.bfloat16]
    handle = m.layers[1].ffn.register_forward_hook(lambda *a: None)
    try:  # a torch hook on the FFN module: it is called as a module
        assert folds(m) == n - 1
    finally:
        handle.remove()
    handle = m.layers[0].ffn.down_proj.register_forward_pre_hook(lambda *a: None)
    try:
        assert folds(m) == n - 1
    finally:
        handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:  # a global module hook sees every module call
        assert folds(m) == 0
    finally:
        handle.remove()
    m.eval()  # dropout idle, gradients still recorded: it applies
    assert folds(m) == n
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        m(torch.randint(0, 61, (2, 5)))  # evaluation: the projection's own bias
