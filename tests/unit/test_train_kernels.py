"""lmlab's training kernels (lmlab.nn.train_kernel): the causal softmax against the float64
formula (to one rounding of the scores' dtype), its backward likewise, NaN kept to its row,
inputs it cannot read refused; the bf16 batched-matmul attention that takes it; and gradient
clipping in one call (the norm against float64, the scaling against torch's formula)."""

from __future__ import annotations

import math
import warnings

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
@pytest.mark.parametrize("t", [1, 2, 15, 16, 17, 64, 100, 200, 300])  # rows in registers up to 256
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
def test_bmm_attention_operator_is_the_kernel_formula_bit_for_bit(monkeypatch):
    # torch.ops.lmlab.causal_attention_bmm (train_ops.cpp) against the same steps by hand with
    # the ctypes-called kernels: forward and backward equal, bit for bit
    torch.manual_seed(0)
    b, h, t, hd = 2, 3, 40, 16
    q, k, v = (torch.randn(b, h, t, hd).bfloat16().requires_grad_() for _ in range(3))
    g = torch.randn(b, h, t, hd).bfloat16()
    monkeypatch.setattr(core, "TRAIN_SOFTMAX_KERNEL", True)
    out = core.causal_attention_bmm(q, k, v, 0.25)
    grads = torch.autograd.grad(out, (q, k, v), g)
    with torch.no_grad():
        qs = (q * 0.25).reshape(b * h, t, hd)
        k3, v3, g3 = k.reshape(b * h, t, hd), v.reshape(b * h, t, hd), g.reshape(b * h, t, hd)
        p = train_kernel.causal_softmax_(torch.bmm(qs, k3.transpose(1, 2)))
        want = torch.bmm(p, v3).view(b, h, t, hd)
        dv = torch.bmm(p.transpose(1, 2), g3)
        ds = train_kernel.causal_softmax_backward_(p, torch.bmm(g3, v3.transpose(1, 2)))
        dq = torch.bmm(ds, k3).mul_(0.25)
        dk = torch.bmm(ds.transpose(1, 2), qs)
    assert torch.equal(out, want)
    for got, ref in zip(grads, (dq, dk, dv), strict=True):
        assert torch.equal(got, ref.view(b, h, t, hd))
    exact = F.scaled_dot_product_attention(
        *(x.double() for x in (q, k, v)), is_causal=True, scale=0.25
    )
    assert (out.double() - exact).abs().max() < 2e-2


def test_bmm_attention_without_the_kernel_library_is_the_same_function(monkeypatch):
    # the softmax kernel off: the operator runs torch's masked softmax, bit-equal to the Python
    # Function that runs where the library is not compiled; with the kernel on, equal to
    # bf16 rounding
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 3, 33, 16).bfloat16().requires_grad_() for _ in range(3))
    g = torch.randn(2, 3, 33, 16).bfloat16()

    def run() -> list[torch.Tensor]:
        out = core.causal_attention_bmm(q, k, v, 0.25)
        return [out, *torch.autograd.grad(out, (q, k, v), g)]

    monkeypatch.setattr(core, "TRAIN_SOFTMAX_KERNEL", False)
    with train_kernel.disabled():
        python = run()
    if train_kernel.available():
        for a, b in zip(run(), python, strict=True):
            assert torch.equal(a, b)
        monkeypatch.setattr(core, "TRAIN_SOFTMAX_KERNEL", True)
        for a, b in zip(run(), python, strict=True):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


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


# ---- norms straight to bf16 -----------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize(("rms", "bias"), [(False, True), (False, False), (True, False)])
@pytest.mark.parametrize("d", [16, 40, 256])
def test_norm_bf16_is_the_norm_rounded_once_and_its_gradients(rms, bias, d):
    torch.manual_seed(d)
    x = (torch.randn(3, 7, d) * 3 + 1).requires_grad_()
    w = (torch.randn(d) * 0.5 + 1).requires_grad_()
    b = torch.randn(d).requires_grad_() if bias else None
    y = train_kernel.norm_bf16(x, w, b, 1e-5, rms)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    g = torch.randn(3, 7, d).bfloat16()
    y.backward(g)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    bd = None if b is None else b.detach().double().requires_grad_()
    if rms:
        ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * wd
    else:
        ref = F.layer_norm(xd, (d,), wd, bd, 1e-5)
    ref.backward(g.double())
    assert _ulps(y, ref, torch.bfloat16, 1e-2).max() <= 1.0  # one rounding of the float32 value
    for got, want in ((x.grad, xd.grad), (w.grad, wd.grad)) + (
        ((b.grad, bd.grad),) if bias else ()
    ):
        assert got.dtype == torch.float32
        assert ((got.double() - want).abs() <= 1e-5 * want.abs().max()).all()


@needs_kernel
def test_norm_bf16_parameter_gradients_are_the_same_bits_for_any_thread_count():
    torch.manual_seed(3)
    x, w, b = torch.randn(999, 64), torch.randn(64), torch.randn(64)
    g = torch.randn(999, 64).bfloat16()
    before, grads = torch.get_num_threads(), []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            ps = [t.clone().requires_grad_() for t in (x, w, b)]
            train_kernel.norm_bf16(*ps, 1e-5).backward(g)
            grads.append([p.grad for p in ps])
    finally:
        torch.set_num_threads(before)
    for other in grads[1:]:
        assert all(torch.equal(a, c) for a, c in zip(other, grads[0], strict=True))


@pytest.mark.parametrize(
    ("x", "w", "b", "rms"),
    [
        (torch.ones(4, 8), torch.ones(7), None, False),  # weight one short: a read past it
        (torch.ones(4, 8), torch.ones(8), torch.ones(9), False),
        (torch.ones(4, 8).bfloat16(), torch.ones(8), None, False),
        (torch.ones(4, 8, device="meta"), torch.ones(8), None, False),
        (torch.ones(4, 8), torch.ones(8), torch.ones(8), True),  # RMSNorm has no bias
    ],
)
def test_norm_bf16_refuses_what_the_kernel_cannot_read(x, w, b, rms):
    with pytest.raises(ValueError, match="norm_bf16"):
        train_kernel.norm_bf16(x, w, b, 1e-5, rms)


@needs_kernel
@pytest.mark.parametrize("norm_kind", ["layernorm", "rmsnorm"])
def test_pre_norm_blocks_take_the_norm_kernel_with_the_same_function(norm_kind, monkeypatch):
    import lmlab.nn.norm as norm_mod
    from lmlab.models import build_model
    from tests.helpers import tiny_model_config

    cfg = tiny_model_config(37, attention={"n_heads": 4}, norm={"kind": norm_kind})
    torch.manual_seed(0)
    m = build_model(cfg)
    with torch.no_grad():  # norm parameters off their init, so that they matter
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    x = torch.randint(0, 37, (2, 12))
    took: list[int] = []
    real = train_kernel.norm_bf16_op  # what norm_for_matmuls calls
    monkeypatch.setattr(train_kernel, "norm_bf16_op", lambda *a: took.append(1) or real(*a))

    def step(flag: bool, autocast: bool = True) -> tuple[float, dict[str, torch.Tensor]]:
        monkeypatch.setattr(norm_mod, "TRAIN_NORM_KERNEL", flag)
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = m(x, targets=x).loss
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in m.named_parameters()}

    loss0, g0 = step(False)
    assert not took
    loss1, g1 = step(True)
    assert len(took) == 2 * len(m.layers)  # the two norms of every block; not the final norm
    assert abs(loss1 - loss0) < 2e-3
    top = max(g.abs().max().item() for g in g0.values())
    for name, g in g0.items():  # to bf16 rounding
        assert (g1[name] - g).abs().max() <= 0.06 * g.abs().max() + 1e-3 * top, name
    took.clear()
    step(True, autocast=False)  # float32 training: torch's norm
    assert not took
    handle = m.layers[0].attn_norm.register_forward_hook(lambda *a: None)
    try:  # a hooked norm is called as a module (its hook runs); the other layers' norms fuse
        step(True)
        assert len(took) == 2 * len(m.layers) - 1
    finally:
        handle.remove()
    seen: list[torch.dtype] = []
    handle = m.layers[0].attn.register_forward_pre_hook(
        lambda mod, args: seen.append(args[0].dtype)
    )
    try:  # a hook on the consumer sees the norm's float32 output, as without the kernel
        took.clear()
        step(True)
        assert seen == [torch.float32] and len(took) == 2 * len(m.layers) - 1
    finally:
        handle.remove()


@needs_kernel
def test_hooks_inside_the_consumer_or_on_its_backward_keep_the_norm_float32(monkeypatch):
    # a forward hook on a projection the norm feeds saw bf16 input, a full backward hook on the
    # consumer a bf16 grad_input (and one returning a float32 grad, fine without the kernel,
    # raised "hook has changed the type of value")
    from lmlab.models import build_model
    from tests.helpers import tiny_model_config

    torch.manual_seed(0)
    m = build_model(tiny_model_config(37, attention={"n_heads": 4}))
    x = torch.randint(0, 37, (2, 12))
    took: list[int] = []
    real = train_kernel.norm_bf16_op  # what norm_for_matmuls calls
    monkeypatch.setattr(train_kernel, "norm_bf16_op", lambda *a: took.append(1) or real(*a))
    layer, seen = m.layers[0], []
    handles = [
        layer.attn.q_proj.register_forward_pre_hook(lambda mod, a: seen.append(a[0].dtype)),
        layer.ffn.up_proj.register_forward_pre_hook(lambda mod, a: seen.append(a[0].dtype)),
        layer.ffn.register_full_backward_hook(
            lambda mod, gi, go: seen.append(gi[0].dtype) or (gi[0].float(),)
        ),
    ]
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(x, targets=x).loss
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    assert seen == [torch.float32] * 3
    assert len(took) == 2 * len(m.layers) - 2  # layer 0's two norms keep torch's op


@needs_kernel
def test_norm_bf16_writes_its_buffers_on_x_device_whatever_the_default_device():
    # the output, mean, rstd and gradients were allocated on torch's default device: under
    # torch.device("meta") the kernel wrote through a null data pointer (a segfault)
    torch.manual_seed(2)
    x, w, b = (torch.randn(*s, requires_grad=True) for s in ((3, 8), (8,), (8,)))
    with torch.device("meta"):
        y = train_kernel.norm_bf16(x, w, b, 1e-5)
        y.backward(torch.ones(3, 8, dtype=torch.bfloat16, device="cpu"))
    assert y.device.type == "cpu" and x.grad.device.type == "cpu" and w.grad.device.type == "cpu"
    ref = F.layer_norm(x.detach(), (8,), w.detach(), b.detach(), 1e-5)
    assert torch.equal(y, ref.bfloat16()) or (y.float() - ref).abs().max() <= 1e-2
    assert torch.allclose(b.grad, torch.full((8,), 3.0))


@needs_kernel
@pytest.mark.parametrize("rms", [False, True])
def test_norm_bf16_gradients_under_create_graph_are_differentiable(rms):
    # create_graph (a gradient penalty): the kernel's dx and dweight carried no graph, so the
    # second-order terms through the norm were silently missing (or "does not require grad")
    torch.manual_seed(4)
    x = (torch.randn(5, 16) * 2 + 1).requires_grad_()
    w = (torch.randn(16) * 0.5 + 1).requires_grad_()
    b = None if rms else torch.randn(16, requires_grad=True)
    g = torch.randn(5, 16).bfloat16().float().requires_grad_()

    def second_order(norm) -> tuple[torch.Tensor, ...]:
        gx, gw = torch.autograd.grad(norm(), (x, w), g.to(norm().dtype), create_graph=True)
        return torch.autograd.grad(gx.pow(2).sum() + gw.pow(3).sum(), (x, w, g))

    def ref() -> torch.Tensor:
        if rms:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
        return F.layer_norm(x, (16,), w, b, 1e-5)

    got = second_order(lambda: train_kernel.norm_bf16(x, w, b, 1e-5, rms))
    want = second_order(ref)
    for a, c, rtol in zip(got, want, (1e-4, 1e-4, 1e-2), strict=True):  # g's: via a bf16 cast
        torch.testing.assert_close(a, c, rtol=rtol, atol=rtol * c.abs().max().item())


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


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_softmax_gives_a_minus_inf_score_exactly_zero_weight(dtype):
    s = torch.randn(1, 40, 40).to(dtype)
    s[0, 30, 3] = float("-inf")  # below the diagonal: a masked key
    s[0, 35, 20:25] = -200.0  # far below the row's max: e^-200 underflows to 0 in float32 too
    p = train_kernel.causal_softmax_(s.clone())
    assert p[0, 30, 3] == 0 and (p[0, 35, 20:25] == 0).all()
    ref = _masked_softmax64(s)
    assert _ulps(p, ref, dtype, 1e-6).max() <= (1.0 if dtype == torch.bfloat16 else 8.0)


def _grads(seed: int, shapes: list[tuple[int, ...]], scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * scale for s in shapes]


CLIP_SHAPES = [(300, 70), (7,), (40_000,), (0,), (3, 5, 2), (16_384,), (16_385,)]


@needs_kernel
@pytest.mark.parametrize("max_norm", [0.5, 1e9, 0.0])
def test_clip_grads_norm_is_the_float64_norm_and_scales_as_torch(max_norm):
    grads = _grads(0, CLIP_SHAPES)
    before = [g.clone() for g in grads]
    ref = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    norm, coef = train_kernel.clip_grads_(grads, max_norm)
    assert abs(norm - ref) <= 1e-12 * ref
    total = torch.nn.utils.get_total_norm(before, foreach=False)  # torch's own: float32 norms
    assert abs(norm - float(total)) <= 1e-6 * ref
    if max_norm <= 0 or max_norm > ref:  # nothing clipped: the gradients untouched, bit for bit
        assert coef == 1.0
        assert all(torch.equal(g, b) for g, b in zip(grads, before, strict=True))
        return
    # torch's coefficient from this norm (float32 arithmetic), then torch's products
    want = torch.clamp(max_norm / (torch.tensor(norm, dtype=torch.float32) + 1e-6), max=1.0)
    assert coef == float(want) < 1.0
    for g, b in zip(grads, before, strict=True):
        assert torch.equal(g, b * want)


@needs_kernel
def test_clip_grads_norm_does_not_depend_on_the_thread_count():
    grads = _grads(1, [(200_001,), (3, 77_777), (5,)])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = train_kernel.clip_grads_([g.clone() for g in grads], 0.0)
        torch.set_num_threads(2)
        two, _ = train_kernel.clip_grads_([g.clone() for g in grads], 0.0)
    finally:
        torch.set_num_threads(threads)
    assert one == two


@needs_kernel
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_clip_grads_with_a_non_finite_gradient_scales_nothing(bad):
    grads = _grads(2, [(50,), (4, 4)], scale=100.0)
    grads[1][2, 3] = bad
    before = [g.clone() for g in grads]
    norm, coef = train_kernel.clip_grads_(grads, 1.0)
    assert not math.isfinite(norm) and coef == 1.0
    assert all(torch.equal(g, b) for g, b in zip(grads[:1], before[:1], strict=True))


@needs_kernel
@pytest.mark.parametrize("max_norm", [1.0, 0.0])
def test_clip_grads_norm_past_float32_range_is_inf_and_scales_nothing(max_norm):
    # finite float32 gradients whose global norm overflows float32 (torch's get_total_norm:
    # inf, the step skipped); the float64 norm is finite, and its float32 coefficient
    # max_norm / inf was 0: every gradient zeroed, reported as a finite norm
    grads = [torch.full((2,), 3e38), torch.full((3,), 1e38)]
    before = [g.clone() for g in grads]
    norm, coef = train_kernel.clip_grads_(grads, max_norm)
    assert norm == float(torch.nn.utils.get_total_norm(before)) == math.inf
    assert coef == 1.0
    assert all(torch.equal(g, b) for g, b in zip(grads, before, strict=True))


@needs_kernel
def test_clip_grads_refuses_what_the_kernel_would_misread_and_writes_nothing():
    a = torch.full((10, 10), 3.0)
    assert train_kernel.clip_grads_([a, torch.full((3,), 3.0)], 1.0) is not None
    refused = [
        [a, a[2:5]],  # shared memory: counted (and scaled) twice
        [a, a],
        [torch.full((10, 10), 3.0).t()],  # not contiguous
        [torch.full((3,), 3.0).bfloat16()],
        [torch.full((3,), 3.0, dtype=torch.float64)],
        [torch.full((3,), 3.0, requires_grad=True)],
        [torch.full((3,), 3.0)._neg_view()],
    ]
    with torch.inference_mode():
        refused.append([torch.full((3,), 3.0)])  # an inference tensor: no version to count
    for grads in refused:
        before = [g.detach().clone() for g in grads]
        assert train_kernel.clip_grads_(grads, 1.0) is None
        assert all(torch.equal(g.detach(), b) for g, b in zip(grads, before, strict=True))
    shrunk = torch.full((64,), 3.0)
    shrunk.untyped_storage().resize_(16)  # sizes reach past the storage's end
    assert train_kernel.clip_grads_([shrunk], 1.0) is None
    with warnings.catch_warnings():  # "nested tensors are in prototype stage"
        warnings.simplefilter("ignore", UserWarning)
        nested = torch.nested.nested_tensor([torch.full((2,), 3.0), torch.full((3,), 3.0)])
    assert train_kernel.clip_grads_([nested], 1.0) is None  # refused, not an error
    assert all(torch.equal(t, torch.full_like(t, 3.0)) for t in nested.unbind())


class _Dispatching(torch.Tensor):
    """A __torch_dispatch__ subclass: its own dispatch must see any operator on it."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise AssertionError(f"{func} reached the subclass")


@needs_kernel
def test_clip_grads_takes_adjacent_views_and_refuses_dispatching_subclasses():
    flat = torch.full((20,), 3.0)  # gradients as views of one buffer (DDP's bucket views)
    norm, coef = train_kernel.clip_grads_([flat[:10], flat[10:17], flat[17:]], 1.0)
    assert abs(norm - math.sqrt(20 * 9.0)) <= 1e-12 * norm and coef < 1.0
    assert torch.equal(flat, torch.full((20,), 3.0) * torch.tensor(coef))
    for data in (torch.full((3,), 3.0), torch.empty(0)):  # real storage, or none to read
        sub = torch.Tensor._make_subclass(_Dispatching, data)
        assert train_kernel.clip_grads_([sub], 1.0) is None
        assert sub._version == 0


@needs_kernel
@pytest.mark.parametrize(("value", "count"), [(1e19, 4), (1.8e19, 1), (1e19, 1), (2e19, 2)])
def test_clip_grads_norm_is_inf_where_torchs_float32_norm_is(value, count):
    # torch's float32 norm overflows with its sum of squares (norms above about 1.8e19), long
    # before the norm itself passes float32's range: the step is skipped either way (a lone
    # one-element gradient is the exception, its float32 norm being its absolute value: not
    # tested, the kernel reports inf there)
    grads = [torch.full((count,), value / 2), torch.full((count,), value / 2)]
    want = float(torch.nn.utils.get_total_norm([g.clone() for g in grads]))
    norm, coef = train_kernel.clip_grads_(grads, 1.0)
    assert math.isinf(norm) == math.isinf(want)
    if math.isinf(want):
        assert coef == 1.0 and torch.equal(grads[0], torch.full((count,), value / 2))
    else:
        assert abs(norm - want) <= 1e-6 * want


@needs_kernel
def test_clip_grads_counts_a_scaled_tensor_in_its_version():
    grads = [torch.full((5,), 3.0), torch.full((4,), 3.0)]
    versions = [g._version for g in grads]
    norm, coef = train_kernel.clip_grads_(grads, 1.0)
    assert coef < 1.0 and all(g._version > v for g, v in zip(grads, versions, strict=True))
    versions = [g._version for g in grads]
    train_kernel.clip_grads_(grads, 1e9)  # nothing scaled: nothing written
    assert [g._version for g in grads] == versions
    # a graph that saved a gradient tensor sees the write, as after torch's mul_
    x = torch.ones(4, requires_grad=True)
    saved = torch.full((4,), 3.0)
    y = (x * saved).sum()
    train_kernel.clip_grads_([saved], 1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@needs_kernel
def test_clip_gradients_takes_the_kernel_and_names_a_nan_gradient(monkeypatch):
    from lmlab.models import build_model
    from lmlab.training import guard
    from tests.helpers import tiny_model_config

    torch.manual_seed(0)
    model = build_model(tiny_model_config(65, attention={"n_heads": 2}))
    x = torch.randint(0, 65, (2, 6))
    (model(x, targets=x).loss * 50).backward()
    calls = []
    real = train_kernel.clip_grads_
    monkeypatch.setattr(train_kernel, "clip_grads_", lambda g, m: calls.append(1) or real(g, m))
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm, bad = guard.clip_gradients(model, 0.5, list(model.parameters()))
    assert calls and bad is None and norm > 0.5
    ref = math.sqrt(sum(float(g.double().pow(2).sum()) for g in before.values()))
    assert abs(norm - ref) <= 1e-12 * ref
    coef = float(torch.clamp(0.5 / (torch.tensor(norm, dtype=torch.float32) + 1e-6), max=1.0))
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, before[n] * torch.tensor(coef))
    name = next(iter(before))
    dict(model.named_parameters())[name].grad.view(-1)[0] = float("nan")
    norm, bad = guard.clip_gradients(model, 0.5)
    assert math.isnan(norm) and bad == name


@needs_kernel
@pytest.mark.parametrize("n", [1, 15, 16, 17, 8192 * 3 + 5])  # a tail; blocks and a tail
def test_residual_add_is_torchs_mixed_add_bit_for_bit(n):
    torch.manual_seed(n)
    x = torch.randn(n, requires_grad=True)
    y = (torch.randn(n) * 3).bfloat16().requires_grad_()
    if n > 2:
        x.data[1], y.data[2] = float("nan"), float("inf")
    out = train_kernel.residual_add(x, y)
    assert "AddF32Bf16" in out.grad_fn.name()
    ref = x + y
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)
    g = torch.randn(n)
    got, want = torch.autograd.grad(out, (x, y), g), torch.autograd.grad(ref, (x, y), g)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_residual_add_leaves_what_it_does_not_take_to_torch():
    x, y = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6).bfloat16()
    cases = [
        (x, y.float()),  # both float32
        (x, y[:, :1]),  # broadcast
        (x.t(), y.t()),  # not contiguous
    ]
    for a, b in cases:
        out = train_kernel.residual_add(a, b)
        assert "AddF32Bf16" not in out.grad_fn.name() and torch.equal(out, a + b)
    with torch.no_grad():  # not training: torch's add
        assert torch.equal(train_kernel.residual_add(x, y), x + y)


@needs_kernel
def test_pre_norm_blocks_add_their_bf16_branches_with_the_kernel():
    from lmlab.models import build_model
    from tests.helpers import tiny_model_config

    torch.manual_seed(0)
    m = build_model(tiny_model_config(37, attention={"n_heads": 2}))
    x = torch.randint(0, 37, (2, 9))
    seen = []
    m.layers[0].hook_resid_mid.fns.append(lambda out, name: seen.append(out.grad_fn.name()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(x, targets=x).loss.backward()
    assert len(seen) == 1 and "AddF32Bf16" in seen[0]


def _bad_operator_calls():
    o = torch.ops.lmlab
    f, b = torch.ones, torch.bfloat16
    return {
        "norm int x": lambda: o.norm_bf16(f(3, 4, dtype=torch.int32), f(4), None, 1e-5, False),
        "norm short weight": lambda: o.norm_bf16(f(3, 4), f(2), None, 1e-5, False),
        "norm rms bias": lambda: o.norm_bf16(f(3, 4), f(4), f(4), 1e-5, True),
        "norm 0-d": lambda: o.norm_bf16(torch.tensor(1.0), f(1), None, 1e-5, False),
        "attention k length": lambda: o.causal_attention_bmm(
            f(2, 2, 4, 8), f(2, 2, 5, 8), f(2, 2, 4, 8), 1.0, True
        ),
        "attention 3-d": lambda: o.causal_attention_bmm(*[f(1, 4, 8)] * 3, 1.0, True),
        "fused float32": lambda: o.causal_attention_bf16(*[f(1, 2, 4, 16)] * 3, 1.0),
        "fused hd 8": lambda: o.causal_attention_bf16(*[f(1, 2, 4, 8, dtype=b)] * 3, 1.0),
        "fused v length": lambda: o.causal_attention_bf16(
            f(1, 2, 4, 16, dtype=b), f(1, 2, 4, 16, dtype=b), f(1, 2, 5, 16, dtype=b), 1.0
        ),
        "rope heads": lambda: o.rope_split(f(1, 3, 5, 8), f(3, 8), f(3, 8), 2, 2, None),
        "rope odd hd": lambda: o.rope_split(f(1, 3, 6, 7), f(3, 7), f(3, 7), 2, 2, None),
        "rope table": lambda: o.rope_split(f(1, 3, 6, 8), f(2, 8), f(3, 8), 2, 2, None),
        "rope bias": lambda: o.rope_split(f(1, 3, 6, 8), f(3, 8), f(3, 8), 2, 2, f(5)),
        "add shapes": lambda: o.add_f32_bf16(f(3), f(4).to(b)),
        "add dtypes": lambda: o.add_f32_bf16(f(3).to(b), f(3)),
        "add strided": lambda: o.add_f32_bf16(f(3, 3).t(), f(3, 3).to(b)),
        "add meta": lambda: o.add_f32_bf16(f(3, device="meta"), f(3, device="meta").to(b)),
        "gelu float32": lambda: o.gelu_bf16(f(3, 4), None),
        "gelu 0-d": lambda: o.gelu_bf16(torch.tensor(1.0, dtype=b), None),
        "gelu bias length": lambda: o.gelu_bf16(f(3, 4, dtype=b), f(5)),
        "gelu bias dtype": lambda: o.gelu_bf16(f(3, 4, dtype=b), f(4, dtype=b)),
        "gelu meta": lambda: o.gelu_bf16(f(3, 4, dtype=b, device="meta"), None),
    }


@needs_kernel
@pytest.mark.parametrize("case", sorted(_bad_operator_calls()))
def test_the_operators_refuse_what_their_kernels_cannot_read(case):
    # torch.ops.lmlab.* are reachable by anyone: a wrong shape, dtype, layout or device is a
    # RuntimeError before any kernel reads or writes through a data pointer
    from lmlab.nn import rope_kernel

    assert rope_kernel.available()
    op = case.split()[0].replace("attention", "causal_attention_bmm")
    op = {"norm": "norm_bf16", "rope": "rope_split", "add": "add_f32_bf16"}.get(op, op)
    op = {"gelu": "gelu_bf16"}.get(op, op)
    op = {"fused": "causal_attention_bf16"}.get(op, op)
    with pytest.raises(RuntimeError, match=rf"^lmlab\.{op}: "):  # one line naming the operator
        _bad_operator_calls()[case]()


_FAKE_CALLS = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from lmlab.nn import rope_kernel, train_kernel
assert train_kernel.available() and rope_kernel.available()
o, f, b = torch.ops.lmlab, torch.randn, torch.bfloat16
calls = {
    "norm": lambda: o.norm_bf16(f(3, 4), f(4), None, 1e-5, False),
    "attention": lambda: o.causal_attention_bmm(*[f(1, 2, 5, 8, dtype=b)] * 3, 0.5, True),
    "fused": lambda: o.causal_attention_bf16(*[f(1, 2, 5, 16, dtype=b)] * 3, 0.5),
    "rope": lambda: o.rope_split(f(1, 3, 4, 8), f(3, 8), f(3, 8), 2, 1, None),
    "add": lambda: o.add_f32_bf16(f(3), f(3, dtype=b)),
    "gelu": lambda: o.gelu_bf16(f(3, 4, dtype=b), f(4)),
}
for name, call in calls.items():
    with FakeTensorMode():
        try:
            call()
        except RuntimeError as e:
            assert "lmlab." in str(e), (name, str(e))
        else:
            raise AssertionError(name + " accepted a fake tensor")
print("refused")
"""


@needs_kernel
def test_the_operators_refuse_fake_tensors_without_touching_their_data():
    # a fake tensor (FakeTensorMode, torch.compile's tracing) is a strided CPU tensor with no
    # data: its untyped data_ptr() is null, and the attention's and the RoPE split's kernels
    # wrote through it (a segfault, hence the child process)
    import os
    import subprocess
    import sys
    from pathlib import Path

    import lmlab

    src = str(Path(lmlab.__file__).resolve().parents[1])  # this checkout's lmlab in the child
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run(
        [sys.executable, "-c", _FAKE_CALLS], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0 and "refused" in run.stdout, (run.returncode, run.stderr[-2000:])


@pytest.mark.parametrize("library", [True, False])
def test_bmm_attention_refuses_second_order_gradients(library):
    # its saved tensors carry no graph back to q, k and v: create_graph would silently drop the
    # second-order terms (the C++ operator and the Python Function alike), so it raises
    from contextlib import nullcontext

    if library and not train_kernel.available():
        pytest.skip(train_kernel.status())
    q, k, v = (torch.randn(1, 2, 5, 8).bfloat16().requires_grad_() for _ in range(3))
    with nullcontext() if library else train_kernel.disabled():
        out = core.causal_attention_bmm(q, k, v, 0.3)
    with pytest.raises(RuntimeError, match="second-order"):
        torch.autograd.grad(out.float().sum(), (q, k, v), create_graph=True)
    grads = torch.autograd.grad(core.causal_attention_bmm(q, k, v, 0.3).float().sum(), (q, k, v))
    assert all(g.shape == q.shape for g in grads)  # a first-order backward is unaffected
