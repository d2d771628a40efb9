"""lmlab's one-pass silu(gate) * up for gated FFNs in bf16 CPU training
(torch.ops.lmlab.silu_mul_bf16, lmlab.nn.train_kernel.silu_mul): the float64 formula and its
gradients, non-finite values, thread counts, views, zero and second-order gradients,
refusals, whole models against the path it replaces (torch's silu and multiply), where it is
and is not taken, and the one tensor fewer it keeps for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmlab.nn import train_kernel
from tests.helpers import tiny_config, tiny_model_config

needs_kernel = pytest.mark.skipif(
    not train_kernel.available() or train_kernel._build_kind() == "generic",
    reason="the training kernels are not built for AVX-512 here",
)

HALF_ULP = 2.0**-8  # one rounding to bfloat16 moves a value by at most 2^-8 of itself


def _run(gate, up, g):
    gate = gate.detach().clone().requires_grad_()
    up = up.detach().clone().requires_grad_()
    h = torch.ops.lmlab.silu_mul_bf16(gate, up)
    h.backward(g)
    return h, gate.grad, up.grad


def _formula64(gate, up, g):
    z, u, gd = gate.double(), up.double(), g.double()
    s = torch.sigmoid(z)
    return z * s * u, gd * u * s * (1 + z * (1 - s)), gd * z * s


@needs_kernel
@pytest.mark.parametrize("shape", [(1,), (15,), (16,), (17,), (3, 100), (7, 33), (2, 5, 1000)])
def test_silu_mul_is_the_float64_formula_rounded_once(shape):
    torch.manual_seed(sum(shape))
    gate, up = (torch.randn(shape) * 4).bfloat16(), torch.randn(shape).bfloat16()
    g = torch.randn(shape).bfloat16()
    h, dgate, dup = _run(gate, up, g)
    ref_h, ref_dgate, ref_dup = _formula64(gate, up, g)
    # float32 arithmetic (exp fit 2.4e-7, a few roundings) then one rounding to bf16
    slack = 1e-5 * g.double().abs() * up.double().abs() * (1 + gate.double().abs())
    assert ((h.double() - ref_h).abs() <= HALF_ULP * ref_h.abs() + 1e-6 * ref_h.abs()).all()
    assert ((dup.double() - ref_dup).abs() <= HALF_ULP * ref_dup.abs() + 1e-6 * ref_dup.abs()).all()
    assert ((dgate.double() - ref_dgate).abs() <= HALF_ULP * ref_dgate.abs() + slack).all()
    assert h.dtype == dgate.dtype == dup.dtype == torch.bfloat16


@needs_kernel
def test_silu_mul_agrees_with_the_path_it_replaces():
    # torch rounds silu(gate) to bf16 before the product: the two agree to bf16 rounding
    torch.manual_seed(2)
    gate, up, g = (torch.randn(64, 96) * 3).bfloat16(), torch.randn(64, 96).bfloat16(), None
    g = torch.randn(64, 96).bfloat16()
    got = _run(gate, up, g)
    gt, ut = gate.clone().requires_grad_(), up.clone().requires_grad_()
    ref = F.silu(gt) * ut
    ref.backward(g)
    for a, b in zip(got, (ref, gt.grad, ut.grad), strict=True):
        b = b.detach().double()
        assert ((a.double() - b).abs() <= 3 * HALF_ULP * b.abs() + 1e-2 * b.abs().max()).all()


@needs_kernel
def test_silu_mul_keeps_non_finite_values_to_their_element():
    gate = torch.randn(3, 40).bfloat16()
    up = torch.randn(3, 40).bfloat16()
    gate[0, 3], gate[1, 20], up[2, 39] = float("nan"), float("inf"), float("nan")
    h, dgate, dup = _run(gate, up, torch.ones(3, 40).bfloat16())
    ref = F.silu(gate.float()) * up.float()
    finite = ref.isfinite()
    assert torch.equal(h.float().isfinite(), finite)  # what torch's formula gives, element-wise
    assert h.float()[1, 20].item() == ref[1, 20].item()  # silu(+inf) up = +-inf
    assert (~dgate.float().isfinite()).sum() <= 3 and (~dup.float().isfinite()).sum() <= 3


@needs_kernel
def test_silu_mul_is_the_same_bits_for_any_thread_count_and_reads_views_as_their_values():
    torch.manual_seed(5)
    base = torch.randn(200, 192).bfloat16()
    up, g = torch.randn(200, 96).bfloat16(), torch.randn(200, 96).bfloat16()
    threads = torch.get_num_threads()
    try:
        results = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            results.append(_run(base[:, ::2], up, g))  # a strided gate
    finally:
        torch.set_num_threads(threads)
    want = _run(base[:, ::2].contiguous(), up, g)
    for got in results:
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
    neg = _run(torch._neg_view(base[:, :96].contiguous()), up, torch._neg_view(g.clone()))
    pos = _run(-base[:, :96], up, -g)
    for a, b in zip(neg, pos, strict=True):
        assert torch.equal(a, b)


@needs_kernel
def test_silu_mul_zero_gradient_empty_input_and_refusals():
    gate = torch.randn(4, 16).bfloat16().requires_grad_()
    up = torch.randn(4, 16).bfloat16().requires_grad_()
    h = torch.ops.lmlab.silu_mul_bf16(gate, up)
    zero = torch._efficientzerotensor((4, 16), dtype=torch.bfloat16)
    for t in torch.autograd.grad(h, (gate, up), zero):
        assert torch.equal(t, torch.zeros_like(t))
    e = torch.empty(0, 16).bfloat16().requires_grad_()
    out = torch.ops.lmlab.silu_mul_bf16(e, e)
    out.sum().backward()
    assert out.shape == (0, 16)
    b = torch.bfloat16
    for bad in (
        lambda: torch.ops.lmlab.silu_mul_bf16(torch.randn(3), torch.randn(3)),  # float32
        lambda: torch.ops.lmlab.silu_mul_bf16(torch.randn(3).to(b), torch.randn(4).to(b)),
        lambda: torch.ops.lmlab.silu_mul_bf16(
            torch.randn(3, device="meta").to(b), torch.randn(3, device="meta").to(b)
        ),
    ):
        with pytest.raises(RuntimeError, match="lmlab.silu_mul_bf16"):
            bad()


@needs_kernel
def test_silu_mul_second_order_gradients_are_the_aten_formulas():
    torch.manual_seed(7)
    g0, u0 = (torch.randn(6, 32) * 2).bfloat16(), torch.randn(6, 32).bfloat16()
    grads = []
    for fn in (
        torch.ops.lmlab.silu_mul_bf16,
        lambda gate, up: (F.silu(gate.float()) * up.float()).bfloat16(),
    ):
        gate, up = g0.clone().requires_grad_(), u0.clone().requires_grad_()
        (gg,) = torch.autograd.grad(fn(gate, up).float().pow(2).sum(), gate, create_graph=True)
        gg.float().pow(2).sum().backward()
        grads.append((gate.grad, up.grad))
    for x, y in zip(*grads, strict=True):
        assert torch.allclose(x.float(), y.float(), rtol=3e-2, atol=1e-2 * y.abs().max().item())


def _model(kind="swiglu", **ffn):
    from lmlab.models import build_model

    cfg = tiny_model_config(61, d_model=64, attention={"n_heads": 2}, ffn={"kind": kind, **ffn})
    torch.manual_seed(11)
    return build_model(cfg)


def _bf16_step(model, monkeypatch, kernel: bool, autocast: bool = True):
    monkeypatch.setattr(train_kernel, "TRAIN_SILU_KERNEL", kernel)
    model.zero_grad()
    ran = []
    real = torch.ops.lmlab.silu_mul_bf16

    def spy(*a):
        ran.append(1)
        return real(*a)

    monkeypatch.setattr(torch.ops.lmlab, "silu_mul_bf16", spy, raising=False)
    x = torch.randint(0, 61, (3, 21), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(x, targets=x).loss
    loss.backward()
    monkeypatch.setattr(torch.ops.lmlab, "silu_mul_bf16", real, raising=False)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, len(ran)


@needs_kernel
@pytest.mark.parametrize(
    "kind,ffn", [("swiglu", {}), ("swiglu", {"bias": True}), ("gated", {"activation": "silu"})]
)
def test_a_bf16_training_step_takes_the_operator_with_the_same_function(kind, ffn, monkeypatch):
    m = _model(kind, **ffn)
    loss_k, grads_k, calls = _bf16_step(m, monkeypatch, kernel=True)
    loss_t, grads_t, none = _bf16_step(m, monkeypatch, kernel=False)
    assert calls == len(m.layers) and none == 0
    assert abs(loss_k - loss_t) <= 1e-2 * abs(loss_t)
    for name, g in grads_t.items():
        scale = g.abs().max().item() + 1e-12
        assert (grads_k[name] - g).abs().max().item() <= 0.06 * scale, name


@needs_kernel
def test_the_operator_is_not_taken_where_it_does_not_apply(monkeypatch):
    m = _model()
    assert _bf16_step(m, monkeypatch, kernel=True, autocast=False)[2] == 0  # float32
    assert _bf16_step(_model("geglu"), monkeypatch, kernel=True)[2] == 0  # another activation
    assert _bf16_step(_model("gated", activation="relu"), monkeypatch, kernel=True)[2] == 0
    calls = []
    real = torch.ops.lmlab.silu_mul_bf16
    monkeypatch.setattr(
        torch.ops.lmlab, "silu_mul_bf16", lambda *a: calls.append(1) or real(*a), raising=False
    )
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        m(torch.randint(0, 61, (2, 9)))  # evaluation
    assert calls == []


@needs_kernel
def test_the_operator_keeps_one_tensor_fewer_and_the_estimate_counts_it(monkeypatch):
    from lmlab.analysis.contract import saved_activation_bytes
    from lmlab.models import build_model
    from lmlab.training.memory import estimate_training_memory

    cfg = tiny_config(
        model={"d_model": 64, "n_layers": 2, "max_seq_len": 32, "ffn": {"kind": "swiglu"}},
        train={"batch_size": 3, "precision": "bf16", "device": "cpu"},
    )
    cfg.model.vocab_size = 65
    model = build_model(cfg.model)
    x = torch.randint(0, 65, (3, 32))
    saved, estimate = {}, {}
    for on in (True, False):
        monkeypatch.setattr(train_kernel, "TRAIN_SILU_KERNEL", on)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            saved[on] = saved_activation_bytes(model, cfg.model, x)
        estimate[on] = estimate_training_memory(cfg).activations
    f = model.layers[0].ffn.up_proj.out_features
    one_tensor = 2 * len(model.layers) * 3 * 32 * f  # bf16 (B, T, F) per layer
    assert saved[False] - saved[True] == one_tensor
    assert estimate[False] - estimate[True] == one_tensor


@needs_kernel
def test_the_estimate_counts_it_per_expert_and_only_where_it_runs(monkeypatch):
    from lmlab.nn.ffn import FFN, GatedMLP
    from lmlab.training.memory import estimate_training_memory

    def estimate(ffn: dict, **train) -> int:
        cfg = tiny_config(
            model={"d_model": 64, "n_layers": 2, "max_seq_len": 32, "ffn": ffn},
            train={"batch_size": 3, "precision": "bf16", "device": "cpu", **train},
        )
        cfg.model.vocab_size = 65
        return estimate_training_memory(cfg).activations

    def drop(ffn: dict, **train) -> int:
        monkeypatch.setattr(train_kernel, "TRAIN_SILU_KERNEL", False)
        off = estimate(ffn, **train)
        monkeypatch.setattr(train_kernel, "TRAIN_SILU_KERNEL", True)
        return off - estimate(ffn, **train)

    swiglu = {"kind": "swiglu"}
    one = drop(swiglu)
    assert one > 0
    assert drop(swiglu, compile=True) == 0  # compiled: torch's ops keep silu(gate)
    assert drop(swiglu, precision="fp32") == 0
    if not torch.cuda.is_available():  # a CUDA run planned on this machine: torch's ops there
        assert drop(swiglu, device="cuda") == 0
    moe = {"kind": "moe", "n_experts": 4, "top_k": 2, "expert": "swiglu"}
    f_moe = tiny_config(model={"d_model": 64, "ffn": moe}).model.d_ff
    f_dense = tiny_config(model={"d_model": 64, "ffn": swiglu}).model.d_ff
    assert drop(moe) * f_dense == 2 * one * f_moe  # each of the top_k experts it visits

    @FFN.register("test_own_silu", "a SwiGLU that computes its product with torch's ops")
    class OwnSilu(GatedMLP):
        def _hidden(self, x):
            return self.hook_hidden(F.silu(self.gate_proj(x)) * self.up_proj(x))

    try:
        assert drop({"kind": "test_own_silu"}) == 0  # its own _hidden: four tensors
    finally:
        FFN.unregister("test_own_silu")
