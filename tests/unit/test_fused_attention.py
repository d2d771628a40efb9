"""lmlab's fused bf16 causal attention (torch.ops.lmlab.causal_attention_bf16,
attention_kernels.cpp): forward and gradients against the float64 formula at shapes that hit
every tail of its row blocks and column vectors; exact causality (what the skipped blocks would
have added is exactly nothing); strided and misaligned inputs; what it refuses; and that bf16
training takes it with the same function as the batched-matmul path it replaces."""

from __future__ import annotations

import pytest
import torch

import lmlab.nn.attention_core as core
from lmlab.nn import train_kernel

needs_fused = pytest.mark.skipif(
    not (train_kernel.available() and train_kernel.attention_bf16_available()),
    reason="lmlab's fused bf16 attention is built on CPUs with AVX512-BF16 only",
)


def _exact(q, k, v, scale, g):
    """The float64 formula on the same bf16 inputs: out and the gradients of <out, g>."""
    q, k, v = (x.double().detach().requires_grad_() for x in (q, k, v))
    t = q.shape[2]
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = s.softmax(-1) @ v
    grads = torch.autograd.grad(out, (q, k, v), g.double())
    return [out.detach(), *grads]


def _fused(q, k, v, scale, g):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = torch.ops.lmlab.causal_attention_bf16(q, k, v, scale)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), g)]


def _bmm(q, k, v, scale, g):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = core.causal_attention_bmm(q, k, v, scale)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), g)]


def _err(got: list[torch.Tensor], ref: list[torch.Tensor]) -> list[float]:
    """max |got - ref| of out, dq, dk, dv, each over the reference's largest magnitude (at
    least 1: a gradient that is exactly 0, one token's dq, is compared as it is)."""
    return [
        float((a.double() - b).abs().max() / b.abs().max().clamp_min(1.0))
        for a, b in zip(got, ref, strict=True)
    ]


@needs_fused
@pytest.mark.parametrize(
    ("b", "h", "t", "hd", "hdv"),
    [
        (1, 1, 1, 16, 16),  # one token
        (1, 2, 2, 16, 16),
        (2, 3, 7, 16, 16),  # one odd row block
        (2, 2, 17, 32, 32),  # a 16-column vector and one more; an odd last row pair
        (1, 2, 37, 48, 48),  # three vectors of hd
        (2, 2, 64, 32, 32),  # nanoGPT's shape
        (1, 2, 100, 128, 128),  # hd wider than one register tile
        (2, 4, 256, 64, 64),  # the Mini-GPT shape
        (2, 2, 33, 48, 32),  # v narrower than q and k (MLA: nope + rope dims vs v's)
        (1, 3, 50, 16, 80),  # v wider
    ],
)
def test_fused_attention_is_the_float64_formula_to_bf16_rounding(b, h, t, hd, hdv):
    torch.manual_seed(t * 100 + hd)
    q, k = (torch.randn(b, h, t, hd).bfloat16() for _ in range(2))
    v, g = (torch.randn(b, h, t, hdv).bfloat16() for _ in range(2))
    q = q * 2  # sharper rows than unit scores
    scale = hd**-0.5
    ref = _exact(q, k, v, scale, g)
    fused = _err(_fused(q, k, v, scale, g), ref)
    bmm = _err(_bmm(q, k, v, scale, g), ref)
    # bf16 outputs (8 bits of mantissa) of float32 sums: within a few bf16 roundings of the
    # largest value, and no worse than the batched-matmul path (which rounds the scores first)
    for name, e, e_bmm in zip(("out", "dq", "dk", "dv"), fused, bmm, strict=True):
        assert e <= 1.6e-2, (name, e)
        assert e <= 1.5 * e_bmm + 4e-3, (name, e, e_bmm)


@needs_fused
@pytest.mark.parametrize(
    ("h", "kv", "t", "hd", "hdv"),
    [
        (4, 2, 37, 32, 32),  # GQA, two query heads per kv head
        (6, 2, 20, 16, 16),  # three per kv head
        (4, 1, 64, 32, 32),  # MQA
        (4, 1, 33, 48, 32),  # MLA's absorbed form: one latent "kv head", v narrower
    ],
)
def test_fused_attention_shares_kv_heads_as_the_repeated_formula(h, kv, t, hd, hdv):
    # query head i reads kv head i // (h / kv); dK and dV sum over the heads that share them
    torch.manual_seed(h * 10 + kv)
    q = torch.randn(2, h, t, hd).bfloat16()
    k = torch.randn(2, kv, t, hd).bfloat16()
    v = torch.randn(2, kv, t, hdv).bfloat16()
    g = torch.randn(2, h, t, hdv).bfloat16()
    rep = h // kv
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    s = (q64 @ k64.repeat_interleave(rep, 1).transpose(-1, -2)) * 0.3
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out64 = s.softmax(-1) @ v64.repeat_interleave(rep, 1)
    ref = [out64.detach(), *torch.autograd.grad(out64, (q64, k64, v64), g.double())]
    got = _fused(q, k, v, 0.3, g)
    assert [x.shape for x in got] == [x.shape for x in ref]
    for name, e in zip(("out", "dq", "dk", "dv"), _err(got, ref), strict=True):
        assert e <= 1.6e-2, (name, e)


@needs_fused
def test_fused_attention_is_exactly_causal_forward_and_backward():
    # the blocks above the diagonal are never multiplied, and the partial ones multiply by an
    # exact 0: future keys and values leave earlier rows bit for bit unchanged, and an earlier
    # query's output gradient adds exactly nothing to a later key's dK, dV
    torch.manual_seed(3)
    b, h, t, hd, cut = 2, 2, 45, 32, 19
    q, k, v, g = (torch.randn(b, h, t, hd).bfloat16() for _ in range(4))
    base = _fused(q, k, v, 0.3, g)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, cut:] = torch.randn(b, h, t - cut, hd).bfloat16() * 50
    v2[:, :, cut:] = torch.randn(b, h, t - cut, hd).bfloat16() * 50
    moved = _fused(q, k2, v2, 0.3, g)
    assert torch.equal(moved[0][:, :, :cut], base[0][:, :, :cut])
    g2 = g.clone()
    g2[:, :, :cut] = torch.randn(b, h, cut, hd).bfloat16()
    later = _fused(q, k, v, 0.3, g2)
    for got, want in zip(later[2:], base[2:], strict=True):  # dk, dv of keys >= cut
        assert torch.equal(got[:, :, cut:], want[:, :, cut:])


@needs_fused
def test_fused_attention_reads_strided_and_misaligned_inputs_as_contiguous_ones():
    torch.manual_seed(4)
    b, h, t, hd = 2, 3, 21, 32
    q, k, v, g = (torch.randn(b, h, t, hd).bfloat16() for _ in range(4))
    want = _fused(q, k, v, 0.25, g)
    # (B, T, H, hd) storage seen as (B, H, T, hd): the projections' layout
    qt, kt, vt, gt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, g))
    assert not qt.is_contiguous()
    for a, w in zip(_fused(qt, kt, vt, 0.25, gt), want, strict=True):
        assert torch.equal(a, w)
    # odd strides and a data pointer off by one element: read through a contiguous copy
    buf = torch.zeros(b * h * t * hd + 1).bfloat16()
    odd = buf[1:].view(b, h, t, hd)
    odd.copy_(q)
    assert odd.data_ptr() % 4 != 0
    for a, w in zip(_fused(odd, k, v, 0.25, g), want, strict=True):
        assert torch.equal(a, w)


@needs_fused
def test_fused_attention_keeps_a_nan_score_in_its_row():
    q, k, v = (torch.randn(1, 1, 20, 16).bfloat16() for _ in range(3))
    q[0, 0, 7, 3] = float("nan")
    out = torch.ops.lmlab.causal_attention_bf16(q, k, v, 0.25)
    assert out[0, 0, 7].isnan().all()
    assert not out[0, 0, :7].isnan().any() and not out[0, 0, 8:].isnan().any()


@needs_fused
def test_fused_attention_refuses_second_order_gradients():
    q, k, v = (torch.randn(1, 2, 5, 16).bfloat16().requires_grad_() for _ in range(3))
    out = torch.ops.lmlab.causal_attention_bf16(q, k, v, 0.3)
    with pytest.raises(RuntimeError, match="second-order"):
        torch.autograd.grad(out.float().sum(), (q, k, v), create_graph=True)


@needs_fused
@pytest.mark.parametrize(
    "args",
    [
        [torch.ones(1, 2, 4, 16)] * 3,  # float32
        [torch.ones(1, 2, 4, 8).bfloat16()] * 3,  # hd not a multiple of 16
        [torch.ones(1, 2, 0, 16).bfloat16()] * 3,  # no tokens
        [torch.ones(2, 4, 16).bfloat16()] * 3,  # 3-d
        [torch.ones(1, 2, 4, 16).bfloat16(), torch.ones(1, 2, 5, 16).bfloat16()] * 2,  # lengths
        [torch.ones(1, 2, 4, 16).bfloat16()] * 2 + [torch.ones(1, 2, 4, 24).bfloat16()],  # v's hd
        [torch.ones(1, 3, 4, 16).bfloat16()] + [torch.ones(1, 2, 4, 16).bfloat16()] * 2,  # 2 !| 3
        [torch.ones(1, 4, 4, 16).bfloat16(), torch.ones(1, 2, 4, 16).bfloat16()]
        + [torch.ones(1, 1, 4, 16).bfloat16()],  # k and v heads differ
        [torch.ones(1, 0, 4, 16).bfloat16()] + [torch.ones(1, 2, 4, 16).bfloat16()] * 2,  # no q
        [torch.ones(1, 2, 4, 16, device="meta").bfloat16()] * 3,
    ],
)
def test_fused_attention_refuses_what_it_cannot_read(args):
    with pytest.raises(RuntimeError, match=r"^lmlab\.causal_attention_bf16: "):
        torch.ops.lmlab.causal_attention_bf16(*args[:3], 0.5)


@needs_fused
@pytest.mark.skipif(
    not train_kernel.attention_bf16_preferred(), reason="an AMX CPU: training keeps the bmm path"
)
# the default model; MLA (hdv != hd); Llama (GQA: 8 query heads share 2 kv heads)
@pytest.mark.parametrize("preset", [None, "deepseek-mla", "llama"])
def test_bf16_training_takes_the_fused_attention_with_the_bmm_paths_function(preset, monkeypatch):
    # the sdpa backend's bf16 training call (attention_sdpa -> causal_attention_train) runs the
    # fused operator, and a whole model's loss and gradients match the batched-matmul path's
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    from lmlab.config import ModelConfig, load_config
    from lmlab.models import build_model

    if preset is None:
        cfg = ModelConfig(vocab_size=50, d_model=64, n_layers=2, max_seq_len=40)
        cfg.attention.n_heads = 4
    else:
        root = Path(__file__).resolve().parents[2]
        cfg = load_config(root / "configs" / f"{preset}.yaml").model
        cfg.vocab_size, cfg.max_seq_len = 50, 40
    torch.manual_seed(0)
    model = build_model(cfg)
    ids = torch.randint(0, 50, (3, 41))

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids[:, :-1], targets=ids[:, 1:])
        out.loss.backward()
        return out.loss.detach(), [p.grad.clone() for p in model.parameters()]

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fused_loss, fused_grads = run()
    names = {e.key for e in prof.key_averages()}
    # RoPE over head dims that are multiples of 32 (Llama's): the operator that rotates q and k
    # itself (tests/unit/test_rope_attention.py); others the split, then the attention
    fused = {"lmlab::causal_attention_bf16", "lmlab::rope_causal_attention_bf16"}
    assert names & fused
    assert "lmlab::causal_attention_bmm" not in names
    monkeypatch.setattr(core, "TRAIN_FUSED_ATTENTION", False)  # both off
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        bmm_loss, bmm_grads = run()
    assert not {e.key for e in prof.key_averages()} & fused
    assert abs(float(fused_loss) - float(bmm_loss)) < 2e-2
    for a, b in zip(fused_grads, bmm_grads, strict=True):
        assert float((a - b).norm()) <= 0.05 * float(b.norm()) + 1e-6


def test_training_attention_without_the_fused_kernel_is_the_bmm_path(monkeypatch):
    # hd not a multiple of 16, the flag off, or no library: causal_attention_train is the
    # batched-matmul path, bit for bit
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, 2, 9, 8).bfloat16() for _ in range(3))
    want = core.causal_attention_bmm(q, k, v, 0.5)
    assert torch.equal(core.causal_attention_train(q, k, v, 0.5), want)
    q, k, v = (torch.randn(1, 2, 9, 16).bfloat16() for _ in range(3))
    want = core.causal_attention_bmm(q, k, v, 0.5)
    monkeypatch.setattr(core, "TRAIN_FUSED_ATTENTION", False)
    assert torch.equal(core.causal_attention_train(q, k, v, 0.5), want)
    monkeypatch.setattr(core, "TRAIN_FUSED_ATTENTION", True)
    with train_kernel.disabled():  # the Python Function of the bmm path
        assert not train_kernel.attention_bf16_available()
        want = core.causal_attention_bmm(q, k, v, 0.5)
        assert torch.equal(core.causal_attention_train(q, k, v, 0.5), want)


def test_training_keeps_the_batched_matmuls_on_amx_cpus(monkeypatch):
    # oneDNN's batched matmuls run on the AMX tiles there; the kernel was not measured there
    monkeypatch.setattr(train_kernel, "_AMX", [True])
    assert not train_kernel.attention_bf16_preferred()
    monkeypatch.setattr(train_kernel, "_AMX", [False])
    assert train_kernel.attention_bf16_preferred() == train_kernel.attention_bf16_available()


@needs_fused
@pytest.mark.parametrize("scale", [0.7, 1e6, 1e10, 1e20])
def test_fused_attention_softmax_is_finite_however_large_the_scores(scale):
    # the row max and the exponents come from the same stored scaled scores: the largest
    # exponent is exactly 0 (a product fused into the subtraction left its rounding error
    # there, e^(+-100) past 1e9, and NaN rows)
    q = torch.full((1, 1, 1, 16), 5e4).bfloat16()
    v = torch.ones(1, 1, 1, 16).bfloat16()
    assert torch.equal(torch.ops.lmlab.causal_attention_bf16(q, q, v, scale), v)
    torch.manual_seed(7)
    q, k, v = (torch.randn(2, 2, 37, 16).bfloat16() for _ in range(3))
    out = torch.ops.lmlab.causal_attention_bf16(q, k, v, scale)
    ref = _exact(q, k, v, scale, torch.ones(2, 2, 37, 16))[0]
    assert torch.isfinite(out).all()
    assert float((out.double() - ref).abs().max()) <= 1.6e-2 * float(ref.abs().max())


@needs_fused
def test_fused_attention_takes_a_zero_tensor_gradient_as_zeros():
    # a ZeroTensor has no data: the backward returned zeros instead of reading through null
    q, k, v = (torch.randn(1, 2, 5, 16).bfloat16().requires_grad_() for _ in range(3))
    out = torch.ops.lmlab.causal_attention_bf16(q, k, v, 0.3)
    zero = torch._efficientzerotensor((1, 2, 5, 16), dtype=torch.bfloat16)
    for grad in torch.autograd.grad(out, (q, k, v), zero):
        assert torch.equal(grad, torch.zeros_like(grad))


@needs_fused
def test_fused_attention_reads_a_negated_view_as_its_values():
    torch.manual_seed(8)
    q, k, v, g = (torch.randn(1, 2, 9, 16).bfloat16() for _ in range(4))
    want = _fused(-q, k, v, 0.5, -g)
    got = _fused(torch._neg_view(q), k, v, 0.5, torch._neg_view(g))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@needs_fused
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_attention_splits_the_heads_of_one_kv_head_over_threads(threads):
    # MQA at batch 1: fewer (batch, kv head) pairs than threads, so the backward splits the
    # query heads into runs summed in order; the same function as one run, and deterministic
    torch.manual_seed(9)
    q, g = torch.randn(1, 4, 40, 32).bfloat16(), torch.randn(1, 4, 40, 32).bfloat16()
    k, v = torch.randn(1, 1, 40, 32).bfloat16(), torch.randn(1, 1, 40, 32).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _fused(q, k, v, 0.3, g)
        again = _fused(q, k, v, 0.3, g)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(got, again, strict=True):
        assert torch.equal(a, b)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    s = (q64 @ k64.expand(1, 4, 40, 32).transpose(-1, -2)) * 0.3
    s = s.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    out64 = s.softmax(-1) @ v64.expand(1, 4, 40, 32)
    ref = [out64.detach(), *torch.autograd.grad(out64, (q64, k64, v64), g.double())]
    for name, e in zip(("out", "dq", "dk", "dv"), _err(got, ref), strict=True):
        assert e <= 1.6e-2, (name, e)


@needs_fused
@pytest.mark.parametrize(("h", "kv", "hdv"), [(4, 4, 32), (4, 2, 48), (3, 1, 16)])
def test_fused_attention_writes_its_output_token_major(h, kv, hdv):
    """The (B, H, T, hdv) output is a view of a (B, T, H, hdv) tensor, so the heads'
    concatenation before the output projection (transpose(1, 2), then reshape) copies nothing;
    its values are those of the contiguous formula's layout, and a gradient arriving in either
    layout gives the same gradients."""
    torch.manual_seed(h + kv + hdv)
    b, t, hd = 2, 19, 32
    q = torch.randn(b, h, t, hd).bfloat16()
    k = torch.randn(b, kv, t, hd).bfloat16()
    v = torch.randn(b, kv, t, hdv).bfloat16()
    out = torch.ops.lmlab.causal_attention_bf16(q, k, v, 0.2)
    assert out.shape == (b, h, t, hdv) and not out.is_contiguous()
    merged = out.transpose(1, 2).reshape(b, t, h * hdv)
    assert merged.data_ptr() == out.data_ptr()  # a view: no copy was made
    assert merged.is_contiguous()
    rep = h // kv
    ref = _exact(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), 0.2, out)[0]
    assert float((out.double() - ref).abs().max()) <= 1.6e-2 * float(ref.abs().max())
    g = torch.randn(b, t, h, hdv).bfloat16()
    token_major = _fused(q, k, v, 0.2, g.transpose(1, 2))  # as the projection's backward gives
    head_major = _fused(q, k, v, 0.2, g.transpose(1, 2).contiguous())
    for x, y in zip(token_major, head_major, strict=True):
        assert torch.equal(x, y)
