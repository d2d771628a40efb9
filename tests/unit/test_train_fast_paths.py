"""The training fast paths (issue 14): the bf16 CPU causal attention as batched matmuls, q/k/v as
one matmul over their weights concatenated in the graph, q and k rotated as one tensor. Each is
checked against the path it replaces: the same function, gradients reaching the same named
parameters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lmlab.nn.attention as attention_mod
from lmlab.models import build_model
from lmlab.nn import rope_kernel
from lmlab.nn.attention import Attention
from lmlab.nn.attention_core import attention_sdpa, bmm_causal_applies, causal_attention_bmm
from lmlab.nn.position import RotaryPosition, _RotateHalf
from tests.helpers import tiny_model_config

V = 37


def _qkv(dtype: torch.dtype, t: int = 12) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(2, 3, t, 8, dtype=dtype, requires_grad=True) for _ in range(3)]


def test_bmm_causal_attention_is_causal_softmax_attention():
    q, k, v = _qkv(torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    out = causal_attention_bmm(q, k, v, 0.3)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b)
    # a future key never moves an earlier output: perturb the last key and value only
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, -1] += 5.0
    v2[:, :, -1] -= 5.0
    out2 = causal_attention_bmm(q.detach(), k2, v2, 0.3)
    torch.testing.assert_close(out2[:, :, :-1], out.detach()[:, :, :-1])


def test_sdpa_backend_takes_the_bmm_path_for_bf16_training_only():
    q, k, v = _qkv(torch.bfloat16)
    assert bmm_causal_applies(q, k, 0.0)
    assert not bmm_causal_applies(q, k, 0.1)  # dropout: the fused kernel
    assert not bmm_causal_applies(q.float(), k.float(), 0.0)  # float32: the fused kernel
    with torch.no_grad():
        assert not bmm_causal_applies(q, k, 0.0)  # inference: the fused kernel's forward
    assert not bmm_causal_applies(q[:, :, :1], k[:, :, :1], 0.0)  # one token
    out, _ = attention_sdpa(q, k, v, None, 0.25, is_causal=True)
    fused = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)
    assert not torch.equal(out, fused)  # it did take the other path...
    torch.testing.assert_close(out, fused, atol=2e-2, rtol=2e-2)  # ...the same to bf16 rounding
    exact = causal_attention_bmm(*(t.double() for t in (q, k, v)), 0.25)
    assert (out.double() - exact).abs().max() < 2e-2


@pytest.mark.parametrize(
    "model",
    [
        {},  # RoPE, biases: q and k rotate as one tensor
        {"position": {"kind": "learned"}, "attention": {"bias": True}},
        {"attention": {"qk_norm": True}},  # head norms: the three views, rotated apart
        {"attention": {"n_kv_heads": 1}},
        {"position": {"kind": "rope", "partial_rotary_factor": 0.5}},
    ],
)
def test_fused_qkv_training_step_equals_three_projections(model, monkeypatch):
    attention = {"n_heads": 4, **model.pop("attention", {})}
    cfg = tiny_model_config(V, attention=attention, **model)
    torch.manual_seed(0)
    m = build_model(cfg).double()  # float64: autocast leaves it as is, so the two compare
    names = [n for n, _ in m.named_parameters()]
    x = torch.randint(0, V, (2, 10))

    took: list[bool] = []
    original = Attention.train_fused_qkv_weights

    def spy(self: Attention, h: torch.Tensor) -> tuple | None:
        out = original(self, h)
        took.append(out is not None)
        return out

    monkeypatch.setattr(Attention, "train_fused_qkv_weights", spy)

    def grads(fused: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
        monkeypatch.setattr(attention_mod, "TRAIN_FUSED_QKV", fused)
        took.clear()
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the fused matmul's condition
            loss = m(x, targets=x).loss
        loss.backward()
        assert took == [fused] * cfg.n_layers  # every layer took (or left) the fused matmul
        return loss.detach(), {n: p.grad for n, p in m.named_parameters()}

    loss_f, g_f = grads(True)
    loss_u, g_u = grads(False)
    torch.testing.assert_close(loss_f, loss_u, atol=1e-12, rtol=1e-12)
    assert list(g_f) == names  # the parameters and their names are unchanged
    for n in names:
        assert g_f[n] is not None and g_u[n] is not None, n
        torch.testing.assert_close(g_f[n], g_u[n], atol=1e-12, rtol=1e-10, msg=n)


def test_fused_qkv_is_off_without_gradients_and_for_hooked_projections():
    torch.manual_seed(0)
    m = build_model(tiny_model_config(V, attention={"n_heads": 4}))
    attn = m.layers[0].attn
    h = torch.randn(2, 5, m.cfg.d_model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attn.train_fused_qkv_weights(h) is not None
        with torch.no_grad():
            assert attn.train_fused_qkv_weights(h) is None
        seen = []
        handle = attn.k_proj.register_forward_hook(lambda mod, i, o: seen.append(o.shape))
        assert attn.train_fused_qkv_weights(h) is None  # a hooked projection runs as a module
        m(torch.randint(0, V, (2, 5)))
        assert seen  # ...and its hook ran
        handle.remove()
    assert attn.train_fused_qkv_weights(h) is None  # float32 training: the three projections


def test_a_float32_forward_has_the_same_bits_with_and_without_gradients():
    torch.manual_seed(0)
    m = build_model(tiny_model_config(V, attention={"n_heads": 4})).eval()
    x = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        ref = m(x).logits
    assert torch.equal(m(x).logits, ref)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_training_rope_equals_the_rolled_formula(dtype):
    cfg = tiny_model_config(V, d_model=128, attention={"n_heads": 2})  # head_dim 64
    torch.manual_seed(0)
    pos = RotaryPosition(cfg).to(dtype)
    hd = cfg.head_dim
    base = torch.randn(2, 7, 3, hd, dtype=dtype).transpose(1, 2)  # (B, N, T, hd), strided
    positions = torch.arange(3, 10)
    x = base.detach().requires_grad_()
    if dtype == torch.float64:  # rotate_heads takes it in bf16 / fp16 only: call it directly
        cos, _, signed = pos._rotation(positions, dtype)
        y = _RotateHalf.apply(x, cos, signed)
    else:
        with rope_kernel.disabled():  # without lmlab's RoPE kernel, training in bf16: _RotateHalf
            y = pos.rotate_heads(x, positions)
        assert "_RotateHalf" in type(y.grad_fn).__name__
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, g)
    with torch.no_grad():  # the reference path: roll and sign-folded sin
        ref = pos.rotate_heads(base, positions)
    cos, sin = pos.rotation(positions, dtype)
    ref2 = base * cos + torch.cat((-base[..., hd // 2 :], base[..., : hd // 2]), -1) * sin
    tol = {"atol": 1e-12, "rtol": 1e-12} if dtype == torch.float64 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(y.detach(), ref, **tol)
    torch.testing.assert_close(y.detach(), ref2, **tol)
    xr = base.detach().requires_grad_()
    yr = xr * cos + torch.cat((-xr[..., hd // 2 :], xr[..., : hd // 2]), -1) * sin
    (dref,) = torch.autograd.grad(yr, xr, g)
    torch.testing.assert_close(dx, dref, **tol)


def test_clip_gradients_without_the_kernel_equals_torch_clip_grad_norm_bit_for_bit(monkeypatch):
    from lmlab.training import guard
    from lmlab.training.guard import clip_gradients

    monkeypatch.setattr(guard, "CLIP_KERNEL", False)

    torch.manual_seed(0)
    a = build_model(tiny_model_config(V, attention={"n_heads": 2}))
    b = build_model(tiny_model_config(V, attention={"n_heads": 2}))
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, V, (2, 6))
    for m in (a, b):
        (m(x, targets=x).loss * 50).backward()
    norm, bad = clip_gradients(a, 0.5)
    ref = torch.nn.utils.clip_grad_norm_(list(b.parameters()), 0.5, foreach=False)
    assert bad is None and norm == float(ref) and norm > 0.5  # it did clip
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa.grad, pb.grad)


def test_bf16_training_with_and_without_the_fast_paths_follows_the_same_losses(monkeypatch):
    import lmlab.nn.attention_core as core
    import lmlab.nn.position as position

    def losses(fast: bool) -> list[float]:
        monkeypatch.setattr(attention_mod, "TRAIN_FUSED_QKV", fast)
        monkeypatch.setattr(core, "BMM_CAUSAL_MAX_T", 256 if fast else 0)
        monkeypatch.setattr(position, "TRAIN_ROTATE_HALF", fast)
        monkeypatch.setattr(position, "TRAIN_ROPE_KERNEL", fast)
        torch.manual_seed(0)
        # head_dim 64: every fast path applies (the RoPE function from 64 up)
        m = build_model(tiny_model_config(V, d_model=128, attention={"n_heads": 2}))
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(1)
        out = []
        for _ in range(25):
            x = torch.randint(0, V, (4, 16), generator=g)
            x[:, 1::2] = x[:, ::2]  # something learnable: every odd token repeats the one before
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = m(x, targets=x.roll(-1, 1)).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(float(loss.detach()))
        return out

    fast, ref = losses(True), losses(False)
    assert fast != ref  # the two paths did differ (bf16 rounding)...
    assert ref[-1] < ref[0] - 0.3  # ...while training actually learned something
    # ...and they follow the same curve. The gap is bf16 rounding compounded over 25 steps: the
    # batched-matmul attention alone reaches 0.015 here, q/k/v fusion alone 0.005, the RoPE kernel
    # alone 0 (bit-equal); all together 0.014
    for a, b in zip(fast, ref, strict=True):
        assert abs(a - b) < 0.02, (fast, ref)


def test_a_decoder_reuses_its_positions_and_rope_tables_across_training_steps(monkeypatch):
    from lmlab.nn import position

    m = build_model(tiny_model_config(V, attention={"n_heads": 2}))
    p1 = m.arange_positions(0, 6, torch.device("cpu"))
    assert m.arange_positions(0, 6, torch.device("cpu")) is p1
    assert torch.equal(p1, torch.arange(6))
    assert m.arange_positions(0, 7, torch.device("cpu")) is not p1  # another length: new
    p2 = m.arange_positions(0, 7, torch.device("cpu"))
    p2.add_(1)  # its values changed in place: never handed out again
    p3 = m.arange_positions(0, 7, torch.device("cpu"))
    assert p3 is not p2 and torch.equal(p3, torch.arange(7))
    with torch.inference_mode():
        assert m.arange_positions(0, 7, torch.device("cpu")) is not p3

    computed = []
    real = position.RotaryPosition._compute_rotation
    monkeypatch.setattr(
        position.RotaryPosition,
        "_compute_rotation",
        lambda self, pos, dtype: computed.append(1) or real(self, pos, dtype),
    )
    x = torch.randint(0, V, (2, 6))
    losses = []
    for _ in range(3):  # three training steps' forwards: the tables once
        loss = m(x, targets=x).loss
        loss.backward()
        losses.append(loss.item())
    assert len(computed) == 1 and losses[0] == losses[1] == losses[2]


def test_residual_dropout_at_p0_skips_the_module_call_unless_it_is_hooked():
    m = build_model(tiny_model_config(V, attention={"n_heads": 2}))
    m.train()
    block = m.layers[0]
    x = torch.randn(2, 3, 32)
    assert block.drop.p == 0.0 and block.dropped(x) is x
    seen = []
    block.drop.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    out = block.dropped(x)
    assert seen == [x.shape] and torch.equal(out, x)


def test_clip_gradients_under_torch_compile_clips_once_and_reports_the_norm():
    """Compiled (a backend that runs the traced graph), clipping is torch's path: a traced
    kernel call would keep its scaling while its answer was fixed at trace time."""
    from lmlab.training.guard import clip_gradients

    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        m(torch.ones(2, 4)).sum().backward()
    torch._dynamo.reset()
    norm, bad = torch.compile(lambda: clip_gradients(a, 0.5), backend="eager")()
    ref = torch.nn.utils.clip_grad_norm_(list(b.parameters()), 0.5)
    assert bad is None and abs(norm - float(ref)) <= 1e-6 * float(ref) and norm > 0.5
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-6, atol=0)


def test_clip_gradients_never_builds_the_kernels_for_gradients_it_would_refuse(monkeypatch):
    from lmlab.nn import train_kernel
    from lmlab.training import guard

    asked = []
    monkeypatch.setattr(train_kernel, "loaded", lambda: False)
    monkeypatch.setattr(train_kernel, "available", lambda: asked.append(1) or False)
    refused = [
        [torch.randn(4, 6).t()],  # not contiguous
        [torch.randn(3, requires_grad=True)],  # records gradients in grad mode
        [torch.randn(3).bfloat16()],
        [torch.randn(3, dtype=torch.float64)],
        [torch.randn(3)._neg_view()],
        [nn.Parameter(torch.randn(3), requires_grad=False)],  # a subclass
        [torch.empty(3, device="meta")],  # not on the CPU
    ]
    flat = torch.randn(8)
    refused.append([flat, flat[2:5]])  # shared memory
    with torch.inference_mode():
        refused.append([torch.randn(3)])
    for grads in refused:
        assert guard._clip_kernel(grads, 1.0) is None
    assert asked == []
    assert guard._clip_kernel([torch.randn(3), torch.randn(2, 2)], 1.0) is None  # asks: none
    assert asked == [1]


def test_clipping_and_adamw_leave_their_work_to_torch_under_a_dispatch_mode():
    """A torch dispatch mode (make_fx, FlopCounterMode ...) sees every op of torch's path; the
    lmlab operators' writes would be invisible to it, so they step aside."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lmlab.training import optim
    from lmlab.training.guard import clip_gradients

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        m(torch.ones(2, 4)).sum().backward()
    seen = Seen()
    with seen:
        norm, _ = clip_gradients(a, 0.5)
    ref = torch.nn.utils.clip_grad_norm_(list(b.parameters()), 0.5)
    assert not any("lmlab" in op for op in seen.ops) and seen.ops
    assert abs(norm - float(ref)) <= 1e-6 * float(ref)
    opt_a = optim.AdamW(a.parameters(), lr=1e-2, fused=True)
    opt_b = optim.AdamW(b.parameters(), lr=1e-2, fused=True)
    for step in range(3):  # the kernel takes steps after the first where it applies
        for m in (a, b):
            for p in m.parameters():
                p.grad = torch.full_like(p, 0.1 * (step + 1))
        seen = Seen()
        with seen:
            opt_a.step()
        opt_b.step()
        assert not any("lmlab" in op for op in seen.ops) and seen.ops
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
