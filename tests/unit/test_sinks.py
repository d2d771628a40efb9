"""Attention sinks (gpt-oss learned sink logits) and the StreamingLLM mask and cache."""

from __future__ import annotations

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.generation.generate import SamplingParams, generate_ids
from lmlab.models import build_model
from lmlab.nn.attention import SoftmaxAttention
from lmlab.nn.masks import sliding_window_mask
from lmlab.nn.position import POSITION
from lmlab.nn.sinks import SinkAttention, StreamingKVCache, streaming_mask
from tests.helpers.attention_maps import forward_with_map
from tests.helpers.configs import tiny_model_config


def _attn_cfg(**attention):
    return tiny_model_config(attention={"n_heads": 4, **attention}, position={"kind": "rope"})


def _sink_module(**attention) -> tuple[SinkAttention, object]:
    cfg = _attn_cfg(kind="sink", bias=True, **attention)
    torch.manual_seed(0)
    attn = SinkAttention(cfg).eval()
    with torch.no_grad():
        attn.sinks.normal_(0.0, 1.0)
    return attn, POSITION.get("rope")(cfg)


def _reference(q, k, v, sinks, mask, scale):
    """float64 p_j = exp(a_j) / (exp(s_h) + sum_k exp(a_k)), out = sum_j p_j v_j; q (B, H, T,
    hd), k, v (B, H, S, hd), mask (B or 1, 1, T, S) bool."""
    a = (q.double() @ k.double().transpose(-2, -1)) * scale
    e = torch.exp(a).masked_fill(~mask, 0.0)
    den = torch.exp(sinks.double()).view(1, -1, 1, 1) + e.sum(-1, keepdim=True)
    return (e / den) @ v.double()


@pytest.mark.parametrize("n_kv", [4, 2, 1])
def test_sink_attention_equals_hf_gpt_oss_attention(n_kv):
    """SinkAttention == transformers' GptOssAttention (eager), weights copied by name, with
    RoPE, GQA and a left-padded row."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention

    attn, position = _sink_module(n_kv_heads=n_kv)
    hf_cfg = transformers.GptOssConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=n_kv, head_dim=8,
        attention_bias=True, num_hidden_layers=1, layer_types=["full_attention"],
    )  # fmt: skip
    hf_cfg._attn_implementation = "eager"
    hf = GptOssAttention(hf_cfg, layer_idx=0).eval()
    missing, unexpected = hf.load_state_dict(attn.state_dict(), strict=False)
    assert not missing and not unexpected  # same names: q/k/v/o_proj and sinks
    b, t = 2, 7
    x = torch.randn(b, t, 32)
    key_mask = torch.ones(b, t, dtype=torch.bool)
    key_mask[1, :2] = False
    positions = ((key_mask.long().cumsum(-1) - 1) * key_mask).clamp_min(0)  # (B, T)
    cos, sin = position.cos_sin(positions)  # (B, T, hd), halves repeated
    allowed = torch.ones(t, t).tril().bool() & key_mask[:, None, :]  # (B, T, S)
    hf_mask = torch.zeros(b, 1, t, t).masked_fill(~allowed[:, None], float("-inf"))
    with torch.no_grad():
        got = attn(x, position, positions, key_mask=key_mask).out
        want, _ = hf(x, (cos[..., :4], sin[..., :4]), hf_mask)
    real = key_mask[:, :, None].expand_as(got)
    assert torch.allclose(got[real], want[real], atol=1e-5)


@pytest.mark.parametrize("mask", ["causal", "sliding_window", "bidirectional"])
@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_sink_attention_equals_float64_formula(mask, backend):
    """Both backends equal the float64 formula for every mask, GQA 2, with padding."""
    extra = {"window": 3} if mask == "sliding_window" else {}
    attn, position = _sink_module(n_kv_heads=2, mask=mask, backend=backend, **extra)
    b, t = 2, 6
    x = torch.randn(b, t, 32)
    key_mask = torch.ones(b, t, dtype=torch.bool)
    key_mask[0, :2] = False
    positions = torch.arange(t)
    with torch.no_grad():
        got = attn(x, position, positions, key_mask=key_mask).out
        q, k, v = attn.project(x, position, positions)
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        structure = attn.mask_fn(t, t, None, attn.window)  # (T, S)
        mask_ = (structure & key_mask[:, None, :])[:, None]
        y = _reference(q, k, v, attn.sinks, mask_, attn.scale)
        want = attn.merge_heads(y.float())
    assert torch.allclose(got, want, atol=1e-5)


def test_sink_backends_agree_and_weights_drop_the_sink():
    a_sdpa, position = _sink_module(n_kv_heads=1)
    a_math, _ = _sink_module(n_kv_heads=1, backend="math")
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        o1 = a_sdpa(x, position, torch.arange(9)).out
        out, weights = forward_with_map(a_math, x, position, torch.arange(9))
    assert torch.allclose(o1, out.out, atol=1e-6)
    assert weights.shape == (2, 4, 9, 9)
    assert bool((weights.sum(-1) < 1).all())  # the sink takes the rest


def test_sink_logits_to_minus_inf_equal_softmax_attention():
    """sinks = -inf: exp(s_h) = 0, so the output is plain softmax attention. In float64 to
    1e-12: the two softmaxes run over rows of different widths (S vs S + 1), which vectorised
    kernels may sum in a different order (float32 differed by ~1e-7 on an AMX CPU)."""
    attn, position = _sink_module(n_kv_heads=2, backend="math")
    plain = SoftmaxAttention(_attn_cfg(kind="softmax", bias=True, n_kv_heads=2, backend="math"))
    plain.load_state_dict({k: v for k, v in attn.state_dict().items() if k != "sinks"})
    attn, plain = attn.double(), plain.double()
    with torch.no_grad():
        attn.sinks.fill_(float("-inf"))
        x = torch.randn(2, 8, 32, dtype=torch.float64)
        got = attn(x, position, torch.arange(8)).out
        want = plain.eval()(x, position, torch.arange(8)).out
    assert (got - want).abs().max() < 1e-12
    assert want.abs().max() > 0.1  # not trivially zero


# ----------------------------------------------------------------------------- streaming


def test_streaming_mask_equals_its_dense_formula():
    """Query q sees k iff k <= q and (k < n_sink or q - k < window - n_sink), over (T, S)
    bottom-right aligned, checked element by element."""
    for window, n in [(6, 2), (4, 1), (5, 0), (3, 2)]:
        for t, s in [(10, 10), (3, 10), (1, 7)]:
            got = streaming_mask(t, s, window=window, sink_tokens=n)
            for i in range(t):
                q = s - t + i
                for k in range(s):
                    assert bool(got[i, k]) == (k <= q and (k < n or q - k < window - n))


def test_streaming_without_sinks_is_the_sliding_window():
    assert torch.equal(
        streaming_mask(9, 12, window=4, sink_tokens=0), sliding_window_mask(9, 12, window=4)
    )


def test_streaming_cache_keeps_sinks_and_recent_tokens():
    """After 20 tokens, window 6, 2 sinks: positions 0, 1 and 17..19 (the next query, 20,
    sees 17..20 and the sinks): window - 1 = 5 slots."""
    cache = StreamingKVCache(window=6, sink_tokens=2)
    for p in range(20):
        cache.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4), torch.tensor([[p]]))
    assert cache.pos is not None and cache.pos[0].tolist() == [0, 1, 17, 18, 19]
    assert cache.nbytes() == 2 * 5 * 2 * 4 * 4  # k and v, 5 slots, 2 heads, hd 4, float32


def test_streaming_checks():
    with pytest.raises(ConfigError, match="sink_tokens"):
        tiny_model_config(
            attention={"n_heads": 4, "mask": "streaming", "window": 4, "sink_tokens": 4}
        )
    with pytest.raises(ConfigError, match="window"):
        tiny_model_config(attention={"n_heads": 4, "mask": "streaming"})
    with pytest.raises(ConfigError, match="alibi"):
        tiny_model_config(
            attention={"n_heads": 4, "mask": "streaming", "window": 4, "sink_tokens": 1},
            position={"kind": "alibi"},
        )
    with pytest.raises(ConfigError, match="sink_tokens"):  # a field of streaming only
        tiny_model_config(attention={"n_heads": 4, "mask": "causal", "sink_tokens": 2})


def _streaming_model(kind: str = "rope"):
    cfg = tiny_model_config(
        attention={"n_heads": 4, "mask": "streaming", "window": 8, "sink_tokens": 2},
        position={"kind": kind},
        max_seq_len=16,
    )
    torch.manual_seed(0)
    return build_model(cfg).eval()


def test_generation_past_max_seq_len_keeps_cache_bytes_flat():
    """3 x max_seq_len tokens through the streaming cache: no rebuild, and once the window is
    full the cache's bytes stay constant."""
    model = _streaming_model()
    sizes: list[int] = []
    original = model.new_cache
    caches = []

    def spy():
        caches.append(original())
        return caches[-1]

    model.new_cache = spy  # type: ignore[method-assign]
    params = SamplingParams(max_new_tokens=48, temperature=0.0)
    for _ in generate_ids(model, [1, 2, 3], params, max_seq_len=16):
        sizes.append(caches[-1].nbytes())
    assert len(caches) == 1  # one cache for 51 tokens, never rebuilt
    assert caches[0].seq_len == 3 + 47
    full = sizes[10:]  # the window (8) is full after 7 + 1 tokens
    assert len(set(full)) == 1 and full[0] == 2 * 2 * 7 * 4 * 8 * 4  # L k/v kept K hd fp32


def test_streamed_generation_equals_dense_recomputation():
    """Greedy tokens streamed past max_seq_len == argmax of a full forward under the dense
    streaming mask (RoPE at absolute positions) over the whole sequence."""
    model = _streaming_model()
    params = SamplingParams(max_new_tokens=30, temperature=0.0)
    prompt = [1, 2, 3, 4]
    out = list(generate_ids(model, prompt, params, max_seq_len=16))
    seq = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = model(seq).logits[0]
    assert logits.argmax(-1)[len(prompt) - 1 : -1].tolist() == out


def test_learned_positions_still_rebuild_at_max_seq_len():
    """Learned positions end at max_seq_len: the cache is rebuilt as before, no error."""
    model = _streaming_model("learned")
    params = SamplingParams(max_new_tokens=40, temperature=0.0)
    assert len(list(generate_ids(model, [1, 2], params, max_seq_len=16))) == 40
