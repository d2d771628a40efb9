"""lmlab's RoPE kernel (lmlab.nn.rope_kernel): bit-equal to the rolled eager formula, forward and
backward, in float32 and bfloat16; taken by RotaryPosition in training only; without the compiled
kernel (LMLAB_NO_CPP_KERNELS=1, a failed build) RoPE runs as torch ops with the same values."""

from __future__ import annotations

import pytest
import torch

import lmlab.nn.position as position
from lmlab.models import build_model
from lmlab.nn import rope_kernel
from lmlab.nn.position import RotaryPosition
from tests.helpers import tiny_model_config

V = 37
needs_kernel = pytest.mark.skipif(not rope_kernel.available(), reason=rope_kernel.status())


def _rolled(x: torch.Tensor, cos: torch.Tensor, signed: torch.Tensor) -> torch.Tensor:
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd", [2, 8, 32, 64])
def test_kernel_is_the_rolled_formula_bit_for_bit(dtype, hd):
    torch.manual_seed(0)
    b, n, t = 2, 3, 5
    proj = torch.randn(b, t, n + 2, hd, dtype=dtype) * 3  # a projection's output, strided heads
    cos, signed = torch.randn(t, hd).to(dtype), torch.randn(t, hd).to(dtype)
    leaf_ref, leaf = proj.clone().requires_grad_(), proj.clone().requires_grad_()
    ref = _rolled(leaf_ref[:, :, :n].transpose(1, 2), cos, signed)
    out = rope_kernel.rope(leaf[:, :, :n].transpose(1, 2), cos, signed)
    assert torch.equal(out, ref) and out.stride() == ref.stride()
    g = torch.randn(b, n, t, hd, dtype=dtype)
    if hd > 2:  # a gradient whose last dim is strided (as a transposed matmul's can be)
        g = torch.randn(b, n, hd, t, dtype=dtype).transpose(2, 3)
    ref.backward(g)
    out.backward(g)
    assert torch.equal(leaf.grad, leaf_ref.grad)
    assert leaf.grad[:, :, n:].abs().sum() == 0  # nothing leaked into the other heads
    # the rotation is a rotation: with cos/sin of real angles it keeps each pair's norm
    ang = torch.rand(t, hd // 2, dtype=torch.float64) * 6
    c = torch.cat((ang.cos(), ang.cos()), -1)
    s = torch.cat((-ang.sin(), ang.sin()), -1)
    x = torch.randn(b, n, t, hd)
    y = rope_kernel.rope(x, c.float(), s.float())
    pair = lambda z: z[..., : hd // 2] ** 2 + z[..., hd // 2 :] ** 2  # noqa: E731
    torch.testing.assert_close(pair(y), pair(x), atol=1e-4, rtol=1e-4)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_position_takes_the_kernel_in_training_only(dtype):
    cfg = tiny_model_config(V, d_model=64, attention={"n_heads": 2})
    pos = RotaryPosition(cfg)
    positions = torch.arange(2, 9)
    x = torch.randn(2, 7, 2, cfg.head_dim, dtype=dtype).transpose(1, 2).requires_grad_()
    y = pos.rotate_heads(x, positions)
    assert type(y.grad_fn).__name__ == "RopeFunctionBackward"
    with rope_kernel.disabled():
        ref = pos.rotate_heads(x, positions)
    assert "Rope" not in type(ref.grad_fn).__name__
    assert torch.equal(y, ref)
    g = torch.randn_like(y)
    assert torch.equal(*(torch.autograd.grad(z, x, g)[0] for z in (y, ref)))
    with torch.no_grad():  # no gradients: torch ops (decoding, evaluation)
        assert pos.rotate_heads(x, positions).grad_fn is None
    per_row = torch.stack([positions, positions + 1])  # (B, T) positions: torch ops
    assert "Rope" not in type(pos.rotate_heads(x, per_row).grad_fn).__name__


@needs_kernel
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_training_step_with_the_kernel_has_the_same_loss_and_gradients(precision, monkeypatch):
    torch.manual_seed(0)
    m = build_model(tiny_model_config(V, d_model=64, attention={"n_heads": 2}))
    x = torch.randint(0, V, (2, 11))

    def run(kernel: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        monkeypatch.setattr(position, "TRAIN_ROPE_KERNEL", kernel)
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = m(x, targets=x).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters()]

    (loss, grads), (ref_loss, ref_grads) = run(True), run(False)
    assert torch.equal(loss, ref_loss)
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.equal(a, b)


def test_without_the_compiled_kernel_rope_runs_as_torch_ops(monkeypatch):
    monkeypatch.setattr(rope_kernel._kernel, "lib", None)
    monkeypatch.setattr(rope_kernel._kernel, "_status", None)
    monkeypatch.setenv("LMLAB_NO_CPP_KERNELS", "1")
    assert not rope_kernel.available()
    assert "LMLAB_NO_CPP_KERNELS=1" in rope_kernel.status()
    cfg = tiny_model_config(V, d_model=64, attention={"n_heads": 2})
    pos = RotaryPosition(cfg)
    x = torch.randn(1, 2, 5, cfg.head_dim, requires_grad=True)
    y = pos.rotate_heads(x, torch.arange(5))
    assert "Rope" not in type(y.grad_fn).__name__
    cos, _, signed = pos._rotation(torch.arange(5), x.dtype)
    assert torch.equal(y, _rolled(x, cos, signed))
    with pytest.raises(RuntimeError, match="not available"):
        rope_kernel.rope(x, cos, signed)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("h", "kv"), [(3, 3), (4, 2)])
def test_split_rotates_q_and_k_and_passes_v_from_one_projection(dtype, h, kv):
    torch.manual_seed(1)
    b, t, hd = 2, 6, 16
    proj = torch.randn(b, t, h + 2 * kv, hd, dtype=dtype)
    cos, signed = torch.randn(t, hd).to(dtype), torch.randn(t, hd).to(dtype)
    a, r = proj.clone().requires_grad_(), proj.clone().requires_grad_()
    q, k, v = rope_kernel.rope_split(a, cos, signed, h, kv)
    heads = r.transpose(1, 2)
    ref = (
        _rolled(heads[:, :h], cos, signed),
        _rolled(heads[:, h : h + kv], cos, signed),
        heads[:, h + kv :],
    )
    for out, want in zip((q, k, v), ref, strict=True):
        assert torch.equal(out, want) and out.is_contiguous()
    gs = [torch.randn_like(z) for z in ref]
    torch.autograd.backward(ref, gs)
    torch.autograd.backward((q, k, v), [g.transpose(2, 3).contiguous().transpose(2, 3) for g in gs])
    assert torch.equal(a.grad, r.grad)
    (dk,) = torch.autograd.grad(rope_kernel.rope_split(a, cos, signed, h, kv)[1].sum(), a)
    assert dk[:, :, :h].abs().sum() == 0 and dk[:, :, h + kv :].abs().sum() == 0  # k only


@needs_kernel
def test_bf16_training_takes_the_split_and_hooks_see_the_same_q_k_v(monkeypatch):
    torch.manual_seed(0)
    m = build_model(tiny_model_config(V, d_model=64, attention={"n_heads": 2}))
    x = torch.randint(0, V, (2, 9))
    attn = m.layers[0].attn
    seen: list[torch.Tensor] = []
    kinds: set[str] = set()

    def record(out: torch.Tensor, name: str) -> None:
        seen.append(out.detach())
        kinds.add("RopeSplit" if "RopeSplit" in out.grad_fn.name() else out.grad_fn.name())

    for point in (attn.hook_q, attn.hook_k, attn.hook_v):  # lmlab's hook points (lmlab.hooks)
        point.fns.append(record)

    def run(kernel: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(position, "TRAIN_ROPE_KERNEL", kernel)
        m.zero_grad(set_to_none=True)
        seen.clear()
        kinds.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(x, targets=x).loss
        assert ("RopeSplit" in kinds) == kernel, kinds
        loss.backward()
        return [*seen, loss.detach(), *(p.grad.clone() for p in m.parameters())]

    for a, b in zip(run(True), run(False), strict=True):
        assert torch.equal(a, b)


@needs_kernel
@pytest.mark.parametrize(
    ("dtype", "bias_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
    ],
)
@pytest.mark.parametrize("hd", [32, 40, 8])  # whole vectors; vectors and a tail; a tail only
def test_split_adds_the_bias_first_and_sums_its_gradient(dtype, bias_dtype, hd):
    torch.manual_seed(2)
    b, t, h, kv = 2, 7, 4, 2
    proj = torch.randn(b, t, h + 2 * kv, hd, dtype=dtype)  # a bias-free matmul's output
    proj[1, 3, 2, 5] = float("nan")  # a NaN sum stays NaN, in its own channel
    bias = torch.randn((h + 2 * kv) * hd).to(bias_dtype)
    cos, signed = torch.randn(t, hd).to(dtype), torch.randn(t, hd).to(dtype)
    a, bb = proj.clone().requires_grad_(), bias.clone().requires_grad_()
    q, k, v = rope_kernel.rope_split(a, cos, signed, h, kv, bb)
    # the reference: the bias added in float32 and rounded once to the projection's dtype
    # (a biased matmul's output), then the bias-free split, which is bit-exact
    biased = (proj.float() + bias.float().view(h + 2 * kv, hd)).to(dtype)
    r = biased.clone().requires_grad_()
    ref = rope_kernel.rope_split(r, cos, signed, h, kv)
    for out, want in zip((q, k, v), ref, strict=True):
        torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
    assert q[1, 2, 3].isnan().sum() == 2  # channel 5 and its partner, 5 + hd / 2
    gs = [torch.randn_like(z) for z in ref]
    torch.autograd.backward(ref, gs)
    torch.autograd.backward((q, k, v), gs)
    assert torch.equal(a.grad, r.grad)  # the projection's gradient is unchanged by the bias
    db = r.grad.float().sum(dim=(0, 1)).flatten()  # the bias gradient: its column sums
    assert bb.grad.dtype == bias_dtype
    tol = torch.finfo(bias_dtype).eps * db.abs() + 1e-5 * db.abs().max()
    assert ((bb.grad.float() - db).abs() <= tol).all()


@needs_kernel
def test_training_with_attention_biases_folds_them_into_the_split(monkeypatch):
    torch.manual_seed(0)
    cfg = tiny_model_config(V, d_model=64, attention={"n_heads": 2, "bias": True})
    m = build_model(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "_proj.bias" in name:
                p.normal_(0, 0.5)  # biases away from 0: the fold is exercised
    x = torch.randint(0, V, (2, 9))

    def run(kernel: bool) -> tuple[float, dict[str, torch.Tensor], set[str]]:
        monkeypatch.setattr(position, "TRAIN_ROPE_KERNEL", kernel)
        m.zero_grad(set_to_none=True)
        kinds: set[str] = set()
        m.layers[0].attn.hook_q.fns.append(
            lambda out, name: kinds.add("RopeSplit" if "RopeSplit" in out.grad_fn.name() else "")
        )
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = m(x, targets=x).loss
        finally:
            m.layers[0].attn.hook_q.fns.clear()
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in m.named_parameters()}, kinds

    loss1, g1, kinds1 = run(True)
    loss0, g0, kinds0 = run(False)
    assert "RopeSplit" in kinds1 and "RopeSplit" not in kinds0
    assert abs(loss1 - loss0) < 2e-3
    top = max(g.abs().max().item() for g in g0.values())
    for name, g in g0.items():  # to bf16 rounding (the bias is now rounded with the sum once)
        assert (g1[name] - g).abs().max() <= 0.06 * g.abs().max() + 1e-3 * top, name
    assert g1["layers.0.attn.q_proj.bias"].abs().sum() > 0


def test_split_refuses_what_the_kernel_cannot_read():
    qkv, cs = torch.ones(1, 3, 4, 8), torch.ones(3, 8)
    with pytest.raises(ValueError, match="bias must be"):
        rope_kernel.rope_split(qkv, cs, cs, 2, 1, torch.ones(31))  # one short: a read past it
    with pytest.raises(ValueError, match="qkv must be"):
        rope_kernel.rope_split(qkv, cs, cs, 2, 2)  # heads do not add up
    with pytest.raises(ValueError, match="h and kv must be"):
        rope_kernel.rope_split(torch.ones(1, 3, 2, 8), cs, cs, 4, -1)  # 4 + 2 (-1) adds up
    with pytest.raises(ValueError, match="h and kv must be"):
        rope_kernel.rope_split(torch.ones(1, 3, 1, 8), cs, cs, -1, 1)
    trainable = cs.clone().requires_grad_()  # the kernel would drop its gradient
    with pytest.raises(ValueError, match="must not record gradients"):
        rope_kernel.rope_split(qkv, trainable, cs, 2, 1)
    with pytest.raises(ValueError, match="cos and signed"):
        rope_kernel.rope_split(qkv, cs[:2], cs, 2, 1)


@needs_kernel
def test_the_split_operator_refuses_tables_that_record_gradients():
    # torch.ops.lmlab.rope_split, reachable without rope_split's checks: its backward returns
    # no gradient for the tables, so one that records a graph was silently left without it
    qkv, cs = torch.randn(1, 3, 4, 8), torch.randn(3, 8)
    trainable = cs.clone().requires_grad_()
    for cos, sgn in ((trainable, cs), (cs, trainable)):
        with pytest.raises(RuntimeError, match="must not require grad"):
            torch.ops.lmlab.rope_split(qkv, cos, sgn, 2, 1, None)
    with torch.no_grad():  # nothing recorded: nothing lost
        q, _, _ = torch.ops.lmlab.rope_split(qkv, trainable, cs, 2, 1, None)
    assert q.shape == (1, 2, 3, 8)


@needs_kernel
def test_a_trainable_frequency_table_gets_its_gradient_with_the_kernel_on(monkeypatch):
    # the kernel returns no gradient for cos and signed: tables that record one keep torch's ops
    torch.manual_seed(0)
    m = build_model(tiny_model_config(V, attention={"n_heads": 4, "bias": True}))
    m.position.inv_freq.requires_grad_(True)
    x = torch.randint(0, V, (2, 9))
    grads = {}
    for on in (True, False):
        monkeypatch.setattr(position, "TRAIN_ROPE_KERNEL", on)
        m.position.inv_freq.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m(x, targets=x).loss.backward()
        grads[on] = m.position.inv_freq.grad
    assert grads[False] is not None and grads[False].abs().sum() > 0
    assert grads[True] is not None
    torch.testing.assert_close(grads[True], grads[False], atol=1e-5, rtol=0.05)


@needs_kernel
@pytest.mark.parametrize("split", [False, True])
def test_a_create_graph_backward_through_the_kernel_keeps_second_order_gradients(split):
    """A gradient penalty differentiates the backward itself: the kernel's backward carries no
    graph, so under create_graph the functions run their gradient as torch ops (the same values),
    and the second-order gradients equal those of the rolled formula."""
    torch.manual_seed(4)
    b, t, h, kv, hd = 2, 5, 2, 1, 8
    cos, signed = torch.randn(t, hd), torch.randn(t, hd)
    proj = torch.randn(b, t, h + 2 * kv, hd, dtype=torch.float64).float()
    bias = torch.randn((h + 2 * kv) * hd)
    w = [torch.randn(b, n, t, hd) for n in (h, kv, kv)]  # a loss that weights q, k and v

    def penalty(kernel: bool) -> list[torch.Tensor]:
        a, bb = proj.clone().requires_grad_(), bias.clone().requires_grad_()
        if split and kernel:
            outs = rope_kernel.rope_split(a, cos, signed, h, kv, bb)
        else:
            heads = (a + bb.view(h + 2 * kv, hd)).transpose(1, 2)
            rot = rope_kernel.rope if kernel else _rolled
            outs = (rot(heads[:, :h], cos, signed), rot(heads[:, h : h + kv], cos, signed),
                    heads[:, h + kv :])  # fmt: skip
        loss = sum(((o * o) * wi).sum() for o, wi in zip(outs, w, strict=True))
        ga, gb = torch.autograd.grad(loss, (a, bb), create_graph=True)
        (ga.square().sum() + gb.square().sum()).backward()  # through the backward
        return [a.grad, bb.grad]

    for got, want in zip(penalty(True), penalty(False), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
