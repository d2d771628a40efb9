"""Attention variants: masks (causal, bidirectional, sliding window), the sliding-window cache,
linear attention, padding, the scale switch, QK-norm, per-projection bias and attention dropout."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmlab.errors import ConfigError, LmlabError
from lmlab.models import build_model
from lmlab.nn.attention import LinearAttention, SoftmaxAttention, attention_math
from lmlab.nn.kv_cache import LinearAttentionState, SlidingWindowKVCache
from lmlab.nn.masks import (
    MASKS,
    bidirectional_mask,
    causal_mask,
    position_ids_from_attention_mask,
    sliding_window_mask,
)
from lmlab.nn.position import POSITION, NoPosition, PositionEncoding, sinusoidal_table
from tests.helpers import forward_with_map, tiny_model_config

V = 37


def model(**attention) -> torch.nn.Module:
    return build_model(tiny_model_config(vocab_size=V, attention={"n_heads": 4, **attention}))


def twin(reference: torch.nn.Module, **attention) -> torch.nn.Module:
    """A model with other attention settings and the same weights as ``reference``."""
    other = model(**attention)
    other.load_state_dict(reference.state_dict())
    return other.eval()


# ----------------------------------------------------------------------------- masks


def test_mask_registry_names_and_misspelling_lists_them():
    assert MASKS.names()[:3] == ["causal", "bidirectional", "sliding_window"]  # then others
    with pytest.raises(ConfigError, match="causal, bidirectional, sliding_window"):
        MASKS.get("sliding", "model.attention.mask")


def test_sliding_window_mask_matches_hand_written_example():
    """window 3: each query sees itself and the 2 tokens before it."""
    x, o = False, True
    assert sliding_window_mask(5, 5, window=3).tolist() == [
        [o, x, x, x, x],
        [o, o, x, x, x],
        [o, o, o, x, x],
        [x, o, o, o, x],
        [x, x, o, o, o],
    ]
    # with 3 cached tokens the 2 queries are positions 3 and 4 (bottom-right aligned)
    assert sliding_window_mask(2, 5, window=3).tolist() == [[x, o, o, o, x], [x, x, o, o, o]]
    assert sliding_window_mask(3, 3, window=1).tolist() == torch.eye(3, dtype=bool).tolist()
    with pytest.raises(ValueError, match="window >= 1"):
        sliding_window_mask(3, 3, window=0)


def test_window_at_least_t_equals_causal_mask_and_causal_model():
    for t, s in ((6, 6), (2, 6)):
        assert torch.equal(sliding_window_mask(t, s, window=s), causal_mask(t, s))
    causal = model().eval()
    windowed = twin(causal, mask="sliding_window", window=12)
    x = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(windowed(x).logits, causal(x).logits, atol=1e-6, rtol=1e-5)
        narrow = twin(causal, mask="sliding_window", window=11)(x).logits
    assert torch.equal(narrow[:, :11], causal(x).logits[:, :11])  # token 11 loses token 0
    assert not torch.allclose(narrow[:, 11], causal(x).logits[:, 11])


def test_bidirectional_mask_sees_every_key_and_model_sees_the_future():
    assert bidirectional_mask(2, 4).all() and bidirectional_mask(2, 4).shape == (2, 4)
    m = model(mask="bidirectional").eval()
    x = torch.randint(0, V, (1, 8))
    y = x.clone()
    y[0, -1] = (x[0, -1] + 1) % V
    with torch.no_grad():
        assert not torch.allclose(m(x).logits[:, 0], m(y).logits[:, 0])
    attn, pos = m.layers[0].attn, NoPosition(m.cfg)
    h = torch.randn(1, 8, m.cfg.d_model)
    with torch.no_grad():
        q, k, v = attn.project(h, pos, torch.arange(8))
        expected, _ = attention_math(q, k, v, None, attn.scale)
        torch.testing.assert_close(attn(h, pos, torch.arange(8)).out, attn.merge_heads(expected))


@pytest.mark.parametrize(
    "attention, message",
    [
        ({"mask": "sliding_window"}, "model.attention.window must be set"),
        ({"mask": "sliding_window", "window": 0}, r"model.attention.window must be in \[1, "),
        ({"mask": "sliding_window", "window": 33}, "model.max_seq_len=32"),
        ({"window": 4}, "window applies to masks? sliding_window.* only, not causal"),
        ({"mask": "sliding"}, "model.attention.mask: unknown mask kind"),
        ({"kind": "linear", "mask": "sliding_window", "window": 4}, "kind=linear supports"),
        ({"kind": "linear", "scaled": False}, "scaled=false has no effect"),
    ],
)
def test_bad_mask_settings_name_the_field(attention, message):
    with pytest.raises(ConfigError, match=message):
        tiny_model_config(attention={"n_heads": 4, **attention})


# ----------------------------------------------------------------------------- sliding cache


def test_sliding_cache_holds_at_most_window_entries_and_decodes_like_full_forward():
    w = 4
    m = model(mask="sliding_window", window=w).eval()
    x = torch.randint(0, V, (2, 30))
    with torch.no_grad():
        full = m(x).logits
        cache = m.new_cache()
        assert all(isinstance(layer, SlidingWindowKVCache) for layer in cache.layers)
        chunks, sizes, start = [], [7, 3, 1, 1, 5] + [1] * 13, 0
        for n in sizes:  # prefill longer than the window, then chunks and single tokens
            chunks.append(m(x[:, start : start + n], cache=cache).logits)
            start += n
            assert cache.seq_len == start
            assert all(layer.kept == min(start, w - 1) <= w for layer in cache.layers)
    torch.testing.assert_close(torch.cat(chunks, 1), full, atol=1e-5, rtol=1e-5)
    cfg = m.cfg  # bounded: (w - 1) tokens x K and V x float32, whatever the length
    assert cache.nbytes() == cfg.n_layers * 2 * 2 * (w - 1) * cfg.n_kv_heads * cfg.head_dim * 4


def test_sliding_cache_update_returns_kept_then_new_and_frees_the_rest():
    c = SlidingWindowKVCache(3)
    k = torch.arange(5.0).view(1, 1, 5, 1)
    kk, _ = c.update(k, k)
    assert kk.flatten().tolist() == [0, 1, 2, 3, 4] and c.k.flatten().tolist() == [3, 4]
    kk, _ = c.update(k[:, :, :1] + 10, k[:, :, :1])
    assert kk.flatten().tolist() == [3, 4, 10] and c.k.flatten().tolist() == [4, 10]
    assert c.seq_len == 6 and c.kept == 2 and c.nbytes() == 2 * 2 * 4
    assert c.k.untyped_storage().nbytes() == 2 * 4  # not a view of the concatenated keys


# ----------------------------------------------------------------------------- linear attention


def _linear_reference(attn: LinearAttention, h: torch.Tensor, causal: bool) -> torch.Tensor:
    """Katharopoulos et al. eq. 4/5 spelled out with loops, in float64, from the weights."""
    b, t, _ = h.shape
    hd, rep = attn.head_dim, attn.n_heads // attn.n_kv_heads
    q = (h @ attn.q_proj.weight.T).view(b, t, attn.n_heads, hd)
    k = (h @ attn.k_proj.weight.T).view(b, t, attn.n_kv_heads, hd)
    v = (h @ attn.v_proj.weight.T).view(b, t, attn.n_kv_heads, hd)

    def phi(z):
        return torch.where(z > 0, z + 1, torch.exp(z))  # elu(z) + 1

    out = torch.zeros(b, t, attn.n_heads, hd, dtype=torch.float64)
    for bi in range(b):
        for hi in range(attn.n_heads):
            for i in range(t):
                keys = range(i + 1) if causal else range(t)
                sims = [float(phi(q[bi, i, hi]) @ phi(k[bi, j, hi // rep])) for j in keys]
                for j, s in zip(keys, sims, strict=True):
                    out[bi, i, hi] += s / sum(sims) * v[bi, j, hi // rep]
    return out.reshape(b, t, -1) @ attn.o_proj.weight.T


@pytest.mark.parametrize("mask", ["causal", "bidirectional"])
def test_linear_attention_equals_explicit_float64_formula(mask):
    cfg = tiny_model_config(
        attention={"n_heads": 4, "n_kv_heads": 2, "kind": "linear", "mask": mask}
    )
    attn = LinearAttention(cfg).double()
    h = torch.randn(2, 5, cfg.d_model, dtype=torch.float64)
    with torch.no_grad():
        got, weights = forward_with_map(attn, h, NoPosition(cfg), torch.arange(5))
        torch.testing.assert_close(got.out, _linear_reference(attn, h, mask == "causal"))
    assert weights.shape == (2, 4, 5, 5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 5, dtype=torch.float64))
    if mask == "causal":
        assert (weights.triu(1) == 0).all()


def test_linear_attention_parallel_form_equals_recurrent_form_in_float64():
    m = model(kind="linear").double().eval()
    x = torch.randint(0, V, (2, 16))
    with torch.no_grad():
        parallel = m(x).logits
        cache = m.new_cache()
        assert all(isinstance(layer, LinearAttentionState) for layer in cache.layers)
        steps = [m(x[:, t : t + 1], cache=cache).logits for t in range(16)]  # pure recurrence
        size = cache.nbytes()
        steps2 = m(torch.randint(0, V, (2, 9)), cache=cache)  # the state does not grow
    torch.testing.assert_close(torch.cat(steps, 1), parallel, atol=1e-12, rtol=1e-12)
    assert cache.nbytes() == size and steps2.logits.shape == (2, 9, V)


def test_linear_attention_state_is_sum_of_phi_k_v_outer_products():
    s = LinearAttentionState()
    fk, v = (
        torch.rand(1, 1, 3, 2, dtype=torch.float64),
        torch.randn(1, 1, 3, 2, dtype=torch.float64),
    )
    s.update(fk[:, :, :2], v[:, :, :2])
    s.update(fk[:, :, 2:], v[:, :, 2:])
    expected = sum(torch.outer(fk[0, 0, j], v[0, 0, j]) for j in range(3))
    torch.testing.assert_close(s.state[0, 0], expected)
    torch.testing.assert_close(s.normalizer[0, 0], fk[0, 0].sum(0))


def test_linear_attention_weights_over_cached_tokens_raise_and_score_bias_raises():
    m = model(kind="linear").eval()
    cache = m.new_cache()
    m(torch.randint(0, V, (1, 4)), cache=cache, need_weights=True)  # empty cache: fine
    with pytest.raises(LmlabError, match="cannot return weights over cached tokens"):
        m(torch.randint(0, V, (1, 1)), cache=cache, need_weights=True)

    class Biased(PositionEncoding):
        def score_bias(self, positions, s):
            return torch.zeros(4, positions.shape[-1], s)

    attn = m.layers[0].attn
    with pytest.raises(LmlabError, match="position bias"):
        attn(torch.randn(1, 3, m.cfg.d_model), Biased(m.cfg), torch.arange(3))
    with pytest.raises(TypeError, match="LinearAttentionState"):
        attn(torch.randn(1, 3, m.cfg.d_model), NoPosition(m.cfg), torch.arange(3), None, 1)


# ----------------------------------------------------------------------------- padding


def test_position_ids_from_attention_mask_count_real_tokens():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    pos = position_ids_from_attention_mask(mask)
    assert pos.tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]


PADDING_VARIANTS = [
    {},
    {"backend": "math"},
    {"mask": "sliding_window", "window": 3},
    {"kind": "linear"},
    {"n_kv_heads": 2, "qk_norm": True},
]


@pytest.mark.parametrize("position", ["rope", "learned", "sinusoidal", "none", "alibi"])
@pytest.mark.parametrize("attention", PADDING_VARIANTS, ids=[str(a) for a in PADDING_VARIANTS])
def test_left_padded_batch_equals_each_sequence_alone_and_never_nan(attention, position):
    if position == "alibi" and attention.get("kind") == "linear":
        pytest.skip("linear attention takes no score bias (it says so: tested above)")
    cfg = tiny_model_config(vocab_size=V, attention={"n_heads": 4, **attention})
    cfg.position.kind = position
    m = build_model(cfg).eval()
    lengths, t = [9, 5, 1], 9
    seqs = [torch.randint(1, V, (n,)) for n in lengths]
    ids = torch.zeros(3, t, dtype=torch.long)
    mask = torch.zeros(3, t, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, t - len(s) :], mask[i, t - len(s) :] = s, 1
    pos = position_ids_from_attention_mask(mask)
    with torch.no_grad():
        out = m(ids, attention_mask=mask, position_ids=pos, need_weights=True)
        assert torch.isfinite(out.logits).all()
        for i, s in enumerate(seqs):
            alone = m(s[None]).logits[0]
            torch.testing.assert_close(out.logits[i, t - len(s) :], alone, atol=1e-5, rtol=1e-5)
        # cached decoding continues the padded batch exactly like each sequence alone
        cache = m.new_cache()
        m(ids, cache=cache, attention_mask=mask, position_ids=pos)
        nxt = torch.randint(1, V, (3, 2))
        mask2 = torch.cat([mask, torch.ones(3, 2, dtype=torch.long)], 1)
        step = m(
            nxt, cache=cache, attention_mask=mask2, position_ids=pos[:, -1:] + 1 + torch.arange(2)
        )
        for i, s in enumerate(seqs):
            alone = m(torch.cat([s, nxt[i]])[None]).logits[0, -2:]
            torch.testing.assert_close(step.logits[i], alone, atol=1e-5, rtol=1e-5)
    for w in out.attentions:  # padding keys get no weight; padding queries' rows are all zero
        assert w is not None and torch.isfinite(w).all()
        assert (w * (1 - mask)[:, None, None, :]).abs().max() == 0
        assert w[2, :, :8].abs().max() == 0


def test_padding_gives_finite_gradients_in_training():
    m = model().train()
    ids = torch.randint(1, V, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :5] = 0
    targets = ids.masked_fill(mask == 0, -100)
    m(ids, targets=targets, attention_mask=mask).loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_padding_argument_shapes_are_checked():
    m = model().eval()
    ids = torch.randint(0, V, (2, 5))
    with pytest.raises(ValueError, match=r"attention_mask must be \(B, cached \+ new tokens\)"):
        m(ids, attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"position_ids must be \(B, T\)"):
        m(ids, position_ids=torch.arange(5))


def test_per_row_positions_equal_shared_positions_row_by_row():
    cfg = tiny_model_config()
    rope = POSITION.get("rope")(cfg)
    q, k = torch.randn(2, 4, 3, cfg.head_dim), torch.randn(2, 4, 3, cfg.head_dim)
    pos = torch.tensor([[0, 1, 2], [5, 6, 7]])
    qr, kr = rope.rotate(q, k, pos)
    for i in range(2):
        qi, ki = rope.rotate(q[i : i + 1], k[i : i + 1], pos[i])
        torch.testing.assert_close(qr[i : i + 1], qi)
        torch.testing.assert_close(kr[i : i + 1], ki)
    torch.testing.assert_close(sinusoidal_table(pos, 6)[1], sinusoidal_table(pos[1], 6))


# ----------------------------------------------------------------------------- options


def test_unscaled_attention_equals_math_attention_with_scale_one():
    cfg = tiny_model_config(attention={"n_heads": 4, "scaled": False})
    attn, pos = SoftmaxAttention(cfg).eval(), NoPosition(cfg)
    assert attn.scale == 1.0
    h = torch.randn(2, 6, cfg.d_model)
    with torch.no_grad():
        q, k, v = attn.project(h, pos, torch.arange(6))
        w = torch.softmax((q @ k.transpose(-2, -1)).masked_fill(~causal_mask(6, 6), -math.inf), -1)
        torch.testing.assert_close(attn(h, pos, torch.arange(6)).out, attn.merge_heads(w @ v))
    assert SoftmaxAttention(tiny_model_config()).scale == 1 / math.sqrt(cfg.head_dim)


def test_qk_norm_gives_each_q_and_k_head_unit_rms_before_rope():
    cfg = tiny_model_config(attention={"n_heads": 4, "n_kv_heads": 2, "qk_norm": True})
    attn = SoftmaxAttention(cfg)
    h = torch.randn(2, 5, cfg.d_model) * 7
    rope = POSITION.get("rope")(cfg)  # a rotation keeps the norm, so RMS 1 survives RoPE
    q, k, _ = attn.project(h, rope, torch.arange(5))
    for x in (q, k):
        torch.testing.assert_close(x.pow(2).mean(-1), torch.ones(x.shape[:-1]), atol=1e-4, rtol=0)
    with torch.no_grad():
        attn.q_norm.weight.fill_(3.0)
    q, _, _ = attn.project(h, NoPosition(cfg), torch.arange(5))
    torch.testing.assert_close(q.pow(2).mean(-1), torch.full(q.shape[:-1], 9.0), atol=1e-3, rtol=0)
    names = {n for n, _ in attn.named_parameters()}
    assert {"q_norm.weight", "k_norm.weight"} <= names
    assert attn.q_norm.weight.shape == (cfg.head_dim,)


def test_out_bias_switches_the_o_projection_bias_alone():
    attn = SoftmaxAttention(tiny_model_config(attention={"bias": True, "out_bias": False}))
    assert (
        attn.q_proj.bias is not None and attn.v_proj.bias is not None and attn.o_proj.bias is None
    )
    attn = SoftmaxAttention(tiny_model_config(attention={"bias": False, "out_bias": True}))
    assert attn.q_proj.bias is None and attn.o_proj.bias is not None


@pytest.mark.parametrize("kind", ["softmax", "linear"])
def test_attention_dropout_acts_in_training_only(kind):
    cfg = tiny_model_config(attention={"n_heads": 4, "dropout": 0.5, "kind": kind})
    plain = tiny_model_config(attention={"n_heads": 4, "kind": kind})
    attn, ref = (
        (SoftmaxAttention(cfg), SoftmaxAttention(plain))
        if kind == "softmax"
        else (LinearAttention(cfg), LinearAttention(plain))
    )
    ref.load_state_dict(attn.state_dict())
    h, pos = torch.randn(2, 6, cfg.d_model), NoPosition(cfg)
    a, b = attn.train()(h, pos, torch.arange(6)).out, attn(h, pos, torch.arange(6)).out
    assert not torch.allclose(a, b)
    attn.eval()
    torch.testing.assert_close(attn(h, pos, torch.arange(6)).out, ref(h, pos, torch.arange(6)).out)


def test_sdpa_and_math_agree_with_padding_and_sliding_window():
    m = model(mask="sliding_window", window=3).eval()
    slow = twin(m, mask="sliding_window", window=3, backend="math")
    ids = torch.randint(0, V, (2, 7))
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    with torch.no_grad():
        a = m(ids, attention_mask=mask).logits
        b = slow(ids, attention_mask=mask).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert F.softmax(a, -1).isfinite().all()
