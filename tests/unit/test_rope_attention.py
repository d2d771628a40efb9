"""RoPE inside the fused bf16 causal attention (torch.ops.lmlab.rope_causal_attention_bf16,
attention_kernels.cpp; lmlab.nn.attention.SoftmaxAttention.fused_rope_attention): the fused
q/k/v projection's output read as it is, q and k rotated in the kernel, the projection's
gradient written by its backward. It must be the path it replaces bit for bit (the RoPE split
kernel, torch.ops.lmlab.rope_split, then torch.ops.lmlab.causal_attention_bf16), output and
gradient, at every head layout and thread count; a training step must take it exactly where
that path ran and leave every other case to it."""

from __future__ import annotations

import pytest
import torch

import lmlab.nn.attention as attention_mod
from lmlab.models import build_model
from lmlab.nn import rope_kernel, train_kernel
from lmlab.nn.attention import SoftmaxAttention
from tests.helpers import tiny_model_config

needs_fused = pytest.mark.skipif(
    not (
        train_kernel.available()
        and train_kernel.attention_bf16_available()
        and rope_kernel.available()
    ),
    reason="lmlab's fused bf16 attention is built on CPUs with AVX512-BF16 only",
)
preferred = pytest.mark.skipif(
    not (train_kernel.available() and train_kernel.attention_bf16_preferred()),
    reason="training takes the fused attention on AVX512-BF16 CPUs without AMX only",
)
OP = "rope_causal_attention_bf16"


def _tables(t: int, hd: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed) (T, hd) bf16: RoPE's half-split tables, sin's first half negated."""
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).double() / hd)
    ang = torch.outer(torch.arange(t).double(), inv)
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    return cos, torch.cat([-sin[:, : hd // 2], sin[:, hd // 2 :]], -1)


def _fused(qkv, cos, sgn, h, kv, scale, g):
    x = qkv.detach().clone().requires_grad_()
    y = torch.ops.lmlab.rope_causal_attention_bf16(x, cos, sgn, h, kv, scale)
    return y.detach(), torch.autograd.grad(y, x, g)[0]


def _split(qkv, cos, sgn, h, kv, scale, g):
    x = qkv.detach().clone().requires_grad_()
    q, k, v = torch.ops.lmlab.rope_split(x, cos, sgn, h, kv, None)
    y = torch.ops.lmlab.causal_attention_bf16(q, k, v, scale)
    return y.detach(), torch.autograd.grad(y, x, g)[0]


def _inputs(b, t, h, kv, hd, seed=0):
    torch.manual_seed(seed)
    qkv = (torch.randn(b, t, h + 2 * kv, hd) * 2).bfloat16()
    return qkv, torch.randn(b, h, t, hd).bfloat16(), *_tables(t, hd)


@needs_fused
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("b", "t", "h", "kv", "hd"),
    [
        (12, 64, 4, 4, 32),  # nanoGPT's shape
        (2, 256, 4, 4, 64),  # the Mini-GPT shape
        (2, 7, 2, 2, 32),  # an odd row block and row pair
        (1, 33, 6, 2, 128),  # GQA, three query heads a kv head, a wide head
        (1, 100, 4, 1, 64),  # MQA at batch 1: the backward splits the heads over threads
        (3, 2, 2, 1, 32),
        (1, 1, 2, 2, 32),  # one token
    ],
)
def test_rope_in_attention_is_the_split_then_the_attention_bit_for_bit(b, t, h, kv, hd, threads):
    qkv, g, cos, sgn = _inputs(b, t, h, kv, hd, seed=t + hd)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _fused(qkv, cos, sgn, h, kv, hd**-0.5, g)
        want = _split(qkv, cos, sgn, h, kv, hd**-0.5, g)
    finally:
        torch.set_num_threads(before)
    assert got[0].shape == (b, h, t, hd) and got[1].shape == qkv.shape
    assert got[0].transpose(1, 2).is_contiguous()  # token-major: the heads' concatenation
    for a, w in zip(got, want, strict=True):
        assert torch.equal(a, w)
    # it did rotate: with the tables of position 0 everywhere (no rotation) the output moves
    flat = [x[:1].expand(t, hd).contiguous() for x in (cos, sgn)]
    still = _fused(qkv, *flat, h, kv, hd**-0.5, g)
    assert t == 1 or not torch.equal(still[0], got[0])


@needs_fused
def test_rope_in_attention_reads_strided_and_misaligned_qkv_as_a_contiguous_one():
    qkv, g, cos, sgn = _inputs(2, 21, 2, 1, 32, seed=3)
    want = _fused(qkv, cos, sgn, 2, 1, 0.3, g)
    buf = torch.zeros(qkv.numel() + 1).bfloat16()
    odd = buf[1:].view(qkv.shape)
    odd.copy_(qkv)
    assert odd.data_ptr() % 4 != 0
    strided = qkv.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    for x in (odd, strided, torch._neg_view(-qkv)):
        for a, w in zip(_fused(x, cos, sgn, 2, 1, 0.3, g), want, strict=True):
            assert torch.equal(a, w)


@needs_fused
def test_rope_in_attention_takes_a_zero_tensor_gradient_as_zeros_and_refuses_create_graph():
    qkv, _, cos, sgn = _inputs(1, 5, 2, 2, 32)
    x = qkv.clone().requires_grad_()
    y = torch.ops.lmlab.rope_causal_attention_bf16(x, cos, sgn, 2, 2, 0.3)
    zero = torch._efficientzerotensor((1, 2, 5, 32), dtype=torch.bfloat16)
    (dx,) = torch.autograd.grad(y, x, zero, retain_graph=True)
    assert torch.equal(dx, torch.zeros_like(qkv))
    with pytest.raises(RuntimeError, match="second-order"):
        torch.autograd.grad(y.float().sum(), x, create_graph=True)


@needs_fused
def test_rope_in_attention_keeps_its_own_rotated_copy_for_the_backward():
    # the backward reads the forward's rotated q and k and copy of v (what the split kept), not
    # qkv: a qkv changed in place after the forward leaves the gradient as it was
    qkv, g, cos, sgn = _inputs(1, 5, 2, 2, 32)
    want = _fused(qkv, cos, sgn, 2, 2, 0.3, g)[1]
    x = qkv.clone().requires_grad_()
    y0 = x * 1
    y = torch.ops.lmlab.rope_causal_attention_bf16(y0, cos, sgn, 2, 2, 0.3)
    with torch.no_grad():
        y0.add_(1)
    assert torch.equal(torch.autograd.grad(y, x, g)[0], want)


def _bad_calls():
    q = torch.ones(1, 4, 6, 32).bfloat16()  # (B, T, h + 2 kv, hd) with h = kv = 2
    cos, sgn = _tables(4, 32)
    return [
        ((q.float(), cos, sgn, 2, 2), "bfloat16"),  # float32
        ((torch.ones(1, 4, 6, 16).bfloat16(), *_tables(4, 16), 2, 2), "multiple of 32"),
        ((torch.ones(1, 4, 6, 48).bfloat16(), *_tables(4, 48), 2, 2), "multiple of 32"),
        ((q, cos, sgn, 3, 1), "bfloat16"),  # h + 2 kv = 5 heads, qkv has 6
        ((torch.ones(1, 4, 7, 32).bfloat16(), cos, sgn, 3, 2), "kv dividing h"),
        ((q, cos, sgn, 0, 3), "bfloat16"),  # no query heads
        ((torch.ones(1, 0, 6, 32).bfloat16(), *_tables(0, 32), 2, 2), "T >= 1"),
        ((q[0], cos, sgn, 2, 2), "bfloat16"),  # 3-d
        ((q, cos[:3], sgn[:3], 2, 2), "cos and signed"),  # tables for another length
        ((q, cos.float(), sgn.float(), 2, 2), "cos and signed"),
        ((q, cos.requires_grad_(), sgn, 2, 2), "require grad"),
        ((q.to("meta"), cos, sgn, 2, 2), "dense CPU tensor|no data"),
    ]


@needs_fused
@pytest.mark.parametrize(("args", "match"), _bad_calls())
def test_rope_in_attention_refuses_what_it_cannot_read(args, match):
    with pytest.raises(RuntimeError, match=rf"^lmlab\.{OP}: .*({match})"):
        torch.ops.lmlab.rope_causal_attention_bf16(*args, 0.5)


# ---- the training step ----------------------------------------------------------------------


def _took(monkeypatch) -> list[bool]:
    """Records, per attention layer call, whether fused_rope_attention took the kernel."""
    took: list[bool] = []
    original = SoftmaxAttention.fused_rope_attention

    def spy(self, x, position, positions):
        y = original(self, x, position, positions)
        took.append(y is not None)
        return y

    monkeypatch.setattr(SoftmaxAttention, "fused_rope_attention", spy)
    return took


def _step(m, x, monkeypatch, on: bool):
    monkeypatch.setattr(attention_mod, "TRAIN_ROPE_ATTENTION", on)
    m.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m(x, targets=x).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in m.named_parameters()}


@preferred
@pytest.mark.parametrize(
    "attention",
    [{"n_heads": 2}, {"n_heads": 4, "n_kv_heads": 2}, {"n_heads": 2, "n_kv_heads": 1}],
)
def test_a_bf16_training_step_takes_rope_in_attention_with_the_same_bits(attention, monkeypatch):
    cfg = tiny_model_config(37, d_model=64, attention=attention)  # head_dim 32 or 16
    torch.manual_seed(0)
    m = build_model(cfg)
    x = torch.randint(0, 37, (3, 24))
    took = _took(monkeypatch)
    loss_on, g_on = _step(m, x, monkeypatch, True)
    fits = cfg.head_dim % 32 == 0
    assert took == [fits] * cfg.n_layers
    took.clear()
    loss_off, g_off = _step(m, x, monkeypatch, False)
    assert took == [False] * cfg.n_layers
    assert torch.equal(loss_on, loss_off)
    for n, g in g_on.items():
        assert g is not None and torch.equal(g, g_off[n]), n


@preferred
@pytest.mark.parametrize(
    ("case", "model"),
    [
        ("attention bias", {"attention": {"n_heads": 2, "bias": True}}),
        ("qk_norm", {"attention": {"n_heads": 2, "qk_norm": True}}),
        ("math backend", {"attention": {"n_heads": 2, "backend": "math"}}),
        ("learned positions", {"attention": {"n_heads": 2}, "position": {"kind": "learned"}}),
        (
            "partial rotary",
            {
                "attention": {"n_heads": 2},
                "position": {"kind": "rope", "partial_rotary_factor": 0.5},
            },
        ),
        (
            "interleaved",
            {"attention": {"n_heads": 2}, "position": {"kind": "rope", "interleaved": True}},
        ),
        ("sliding window", {"attention": {"n_heads": 2, "mask": "sliding_window", "window": 8}}),
        ("attention dropout", {"attention": {"n_heads": 2, "dropout": 0.1}}),
    ],
)
def test_rope_in_attention_leaves_every_other_layer_to_the_split_path(case, model, monkeypatch):
    cfg = tiny_model_config(37, d_model=64, **model)
    torch.manual_seed(0)
    m = build_model(cfg).train()
    x = torch.randint(0, 37, (2, 16))
    took = _took(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(x, targets=x).loss.backward()
    assert took == [False] * cfg.n_layers, case


@preferred
def test_rope_in_attention_steps_aside_for_hooks_padding_eval_and_float32(monkeypatch):
    cfg = tiny_model_config(37, d_model=64, attention={"n_heads": 2})
    torch.manual_seed(0)
    m = build_model(cfg)
    x = torch.randint(0, 37, (2, 16))
    took = _took(monkeypatch)
    attn = m.layers[0].attn
    seen: list[tuple[int, ...]] = []
    for point in ("hook_q", "hook_k", "hook_v", "hook_scores", "hook_pattern"):
        getattr(attn, point).fns.append(lambda t, name: seen.append(tuple(t.shape)))
        took.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m(x, targets=x)
        assert took == [False] + [True] * (cfg.n_layers - 1), point  # that layer only
        assert seen, point  # ...and the hook saw its tensor
        getattr(attn, point).fns.clear()
        seen.clear()
    took.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(x, attention_mask=torch.ones_like(x, dtype=torch.bool))  # a padding mask
        with torch.no_grad():
            m(x)  # no gradients: inference
        m(x[:, :1])  # one token
        m(x, position_ids=torch.arange(16).expand(2, 16))  # per-row positions
    m(x, targets=x)  # float32
    assert not any(took)


@preferred
def test_rope_in_attention_keeps_the_default_models_training_losses(monkeypatch):
    # a few optimizer steps of the library's default model with it on and off: the same losses
    # (the same bits all the way: any difference would compound into the next steps)
    from lmlab.config import load_config
    from lmlab.training.optim import build_optimizer

    sets = ["model.d_model=64", "model.attention.n_heads=2", "model.n_layers=2"]
    cfg = load_config(None, [*sets, "model.max_seq_len=32"])
    cfg.model.vocab_size = 37

    def losses(on: bool) -> list[float]:
        monkeypatch.setattr(attention_mod, "TRAIN_ROPE_ATTENTION", on)
        torch.manual_seed(0)
        m = build_model(cfg.model)
        opt = build_optimizer(m, cfg.train)
        out = []
        for i in range(4):
            x = torch.randint(0, 37, (4, 32), generator=torch.Generator().manual_seed(i))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = m(x, targets=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(float(loss.detach()))
        return out

    took = _took(monkeypatch)
    on = losses(True)
    assert took and all(took)
    assert on == losses(False)


@needs_fused
def test_rope_in_attention_and_the_attention_take_an_empty_batch():
    # B = 0 (an empty batch) gave a division by zero in the backward's share-out of heads
    cos, sgn = _tables(8, 32)
    x = torch.randn(0, 8, 6, 32).bfloat16().requires_grad_()
    y = torch.ops.lmlab.rope_causal_attention_bf16(x, cos, sgn, 2, 2, 0.2)
    y.sum().backward()
    assert y.shape == (0, 2, 8, 32) and x.grad is not None and x.grad.shape == x.shape
    q = torch.randn(0, 2, 8, 32).bfloat16().requires_grad_()
    torch.ops.lmlab.causal_attention_bf16(q, q, q, 0.2).sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


@preferred
def test_a_training_forward_through_rope_in_attention_makes_fused_inference_weights_stale(
    monkeypatch,
):
    # the no_grad forwards' fused q/k/v copy (lmlab.nn.fused) goes stale after a training
    # forward, which covers a hand-written update (p.data -= lr * p.grad) no counter sees
    from lmlab.nn.fused import drop_fused

    cfg = tiny_model_config(37, d_model=64, attention={"n_heads": 2})
    torch.manual_seed(0)
    m = build_model(cfg)
    x = torch.randint(0, 37, (2, 16))
    took = _took(monkeypatch)
    m.eval()
    with torch.no_grad():
        m(x)  # builds the fused copy
    m.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(x, targets=x).loss.backward()
    assert took and all(took[-cfg.n_layers :])
    with torch.no_grad():
        for p in m.parameters():
            if p.grad is not None:
                p.data -= 0.5 * p.grad
    m.eval()
    with torch.no_grad():
        got = m(x).logits
        drop_fused(m)
        assert torch.equal(got, m(x).logits)


@preferred
def test_rope_in_attention_steps_aside_for_a_rope_that_splits_its_own_way(monkeypatch):
    from lmlab.nn.position import RotaryPosition

    calls: list[int] = []

    class OwnSplit(RotaryPosition):
        def rotate_split(self, *args, **kwargs):
            calls.append(1)
            return None  # the caller splits and rotates with torch ops

    cfg = tiny_model_config(37, d_model=64, attention={"n_heads": 2})
    torch.manual_seed(0)
    m = build_model(cfg)
    m.position.__class__ = OwnSplit
    took = _took(monkeypatch)
    x = torch.randint(0, 37, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(x, targets=x).loss.backward()
    assert not any(took) and len(calls) == cfg.n_layers
