"""The training fast paths (issue 14): the bf16 CPU causal attention as batched matmuls, q/k/v as
one matmul over their weights concatenated in the graph, q and k rotated as one tensor. Each is
checked against the path it replaces: the same function, gradients reaching the same named
parameters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lmlab.nn.attention as attention_mod
from lmlab.models import build_model
from lmlab.nn.attention import Attention
from lmlab.nn.attention_core import attention_sdpa, bmm_causal_applies, causal_attention_bmm
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
    m = build_model(cfg)
    names = [n for n, _ in m.named_parameters()]
    x = torch.randint(0, V, (2, 10))

    took: list[bool] = []
    original = Attention.train_fused_qkv

    def spy(self: Attention, h: torch.Tensor) -> torch.Tensor | None:
        out = original(self, h)
        took.append(out is not None)
        return out

    monkeypatch.setattr(Attention, "train_fused_qkv", spy)

    def grads(fused: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
        monkeypatch.setattr(attention_mod, "TRAIN_FUSED_QKV", fused)
        took.clear()
        m.zero_grad(set_to_none=True)
        loss = m(x, targets=x).loss
        loss.backward()
        assert took == [fused] * cfg.n_layers  # every layer took (or left) the fused matmul
        return loss.detach(), {n: p.grad for n, p in m.named_parameters()}

    loss_f, g_f = grads(True)
    loss_u, g_u = grads(False)
    torch.testing.assert_close(loss_f, loss_u, atol=1e-6, rtol=1e-6)
    assert list(g_f) == names  # the parameters and their names are unchanged
    for n in names:
        assert g_f[n] is not None and g_u[n] is not None, n
        torch.testing.assert_close(g_f[n], g_u[n], atol=1e-6, rtol=1e-5, msg=n)


def test_fused_qkv_is_off_without_gradients_and_for_hooked_projections():
    torch.manual_seed(0)
    m = build_model(tiny_model_config(V, attention={"n_heads": 4}))
    attn = m.layers[0].attn
    h = torch.randn(2, 5, m.cfg.d_model)
    assert attn.train_fused_qkv(h) is not None
    with torch.no_grad():
        assert attn.train_fused_qkv(h) is None
    seen = []
    handle = attn.k_proj.register_forward_hook(lambda mod, i, o: seen.append(o.shape))
    assert attn.train_fused_qkv(h) is None  # a hooked projection runs as a module
    m(torch.randint(0, V, (2, 5)))
    assert seen  # ...and its hook ran
    handle.remove()
