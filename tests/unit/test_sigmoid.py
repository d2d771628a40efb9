"""Sigmoid attention (Ramapuram et al. 2024) and the local + global mask (Longformer, Beltagy et
al. 2020; BigBird, Zaheer et al. 2020): each against an independent float64 / loop reference."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.models import build_model
from lmlab.nn.kv_cache import LayerKVCache
from lmlab.nn.local_global import LocalGlobalMask, local_global_mask
from lmlab.nn.masks import MASKS, causal_mask, position_ids_from_attention_mask, sliding_window_mask
from lmlab.nn.position import NoPosition
from lmlab.nn.sigmoid_attention import SigmoidAttention, sigmoid_attend
from tests.helpers import forward_with_map, tiny_model_config

V = 50

# ----------------------------------------------------------------------------- sigmoid attention


def _sigmoid_reference(q, k, v, b, allowed):
    """out_i = sum_j [allowed(i, j)] sigmoid(q_i.k_j / sqrt(d) + b) v_j, loops, float64; GQA by
    kv head h // (H / K); allowed: (B, T, S) bool."""
    bsz, h, t, hd = q.shape
    rep = h // k.shape[1]
    out = torch.zeros(bsz, h, t, hd, dtype=torch.float64)
    w = torch.zeros(bsz, h, t, k.shape[2], dtype=torch.float64)
    for bi in range(bsz):
        for hi in range(h):
            for i in range(t):
                for j in range(k.shape[2]):
                    if allowed[bi, i, j]:
                        z = float(q[bi, hi, i] @ k[bi, hi // rep, j]) / math.sqrt(hd) + b
                        w[bi, hi, i, j] = 1.0 / (1.0 + math.exp(-z))
                        out[bi, hi, i] += w[bi, hi, i, j] * v[bi, hi // rep, j]
    return out, w


def test_sigmoid_attend_equals_float64_formula_with_gqa_causal_mask_and_padding():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    k, v = (
        torch.randn(2, 2, 6, 8, dtype=torch.float64),
        torch.randn(2, 2, 6, 8, dtype=torch.float64),
    )
    key_mask = torch.ones(2, 6, dtype=torch.bool)
    key_mask[1, :2] = False  # row 1 left-padded by 2
    b = -math.log(64)
    y, w = sigmoid_attend(
        q, k, v, scale=8**-0.5, offset=b, n_rep=2, mask_fn=causal_mask, key_mask=key_mask
    )
    allowed = causal_mask(6, 6)[None] & key_mask[:, None, :]
    ref_y, ref_w = _sigmoid_reference(q, k, v, b, allowed)
    torch.testing.assert_close(y, ref_y, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(w, ref_w, atol=1e-12, rtol=1e-12)
    assert (w[1, :, :2] == 0).all() and (y[1, :, :2] == 0).all()  # padding rows: no key, 0


def test_masked_and_padded_keys_contribute_exactly_nothing():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    key_mask = torch.tensor([[False, True, True, True, True]])
    y, w = sigmoid_attend(q, k, v, scale=0.5, offset=-2.0, mask_fn=causal_mask, key_mask=key_mask)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 0], v2[:, :, 0] = 1e4, 1e6  # the padding key, made enormous
    y2, w2 = sigmoid_attend(
        q, k2, v2, scale=0.5, offset=-2.0, mask_fn=causal_mask, key_mask=key_mask
    )
    assert torch.equal(y, y2) and torch.equal(w, w2)  # bit for bit
    assert (w[..., 0] == 0).all() and (w.triu(1) == 0).all()  # padding and future: weight 0
    # changing a future key/value changes nothing for earlier queries
    k3, v3 = k.clone(), v.clone()
    k3[:, :, 4], v3[:, :, 4] = 1e4, 1e6
    y3, _ = sigmoid_attend(q, k3, v3, scale=0.5, offset=-2.0, mask_fn=causal_mask)
    y0, _ = sigmoid_attend(q, k, v, scale=0.5, offset=-2.0, mask_fn=causal_mask)
    assert torch.equal(y3[:, :, :4], y0[:, :, :4])


def test_sigmoid_module_bias_is_minus_log_max_seq_len_and_weights_are_the_sigmoids():
    cfg = tiny_model_config(attention={"n_heads": 4, "n_kv_heads": 2, "kind": "sigmoid"})
    attn = SigmoidAttention(cfg).double()
    assert attn.offset == -math.log(cfg.max_seq_len)
    h = torch.randn(2, 5, cfg.d_model, dtype=torch.float64)
    with torch.no_grad():
        got, weights = forward_with_map(attn, h, NoPosition(cfg), torch.arange(5))
        q = (h @ attn.q_proj.weight.T).view(2, 5, 4, -1).transpose(1, 2)
        k = (h @ attn.k_proj.weight.T).view(2, 5, 2, -1).transpose(1, 2)
        v = (h @ attn.v_proj.weight.T).view(2, 5, 2, -1).transpose(1, 2)
        y, w = _sigmoid_reference(q, k, v, attn.offset, causal_mask(5, 5)[None].expand(2, 5, 5))
        out = y.transpose(1, 2).reshape(2, 5, -1) @ attn.o_proj.weight.T
    torch.testing.assert_close(got.out, out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(weights, w, atol=1e-12, rtol=1e-12)
    # rows do not sum to 1 (no normalisation), but start near it: sum_j sigmoid(~0 - log n) ~ T/n
    assert not torch.allclose(weights.sum(-1), torch.ones(2, 4, 5, dtype=torch.float64))


def test_sigmoid_bias_field_sets_b_is_refused_elsewhere_and_must_be_finite():
    cfg = tiny_model_config(attention={"n_heads": 4, "kind": "sigmoid", "sigmoid_bias": -1.5})
    assert SigmoidAttention(cfg).offset == -1.5
    with pytest.raises(ConfigError, match="model.attention.sigmoid_bias"):
        tiny_model_config(attention={"n_heads": 4, "sigmoid_bias": -1.5})  # kind=softmax
    with pytest.raises(ConfigError, match="model.attention.sigmoid_bias"):
        tiny_model_config(attention={"n_heads": 4, "kind": "sigmoid", "sigmoid_bias": "inf"})


def test_sigmoid_cached_decoding_equals_full_pass_in_float64():
    m = build_model(tiny_model_config(vocab_size=V, attention={"n_heads": 4, "kind": "sigmoid"}))
    m = m.double().eval()
    x = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        full = m(x).logits
        cache = m.new_cache()
        steps = [m(x[:, :4], cache=cache).logits] + [
            m(x[:, t : t + 1], cache=cache).logits for t in range(4, 12)
        ]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-12, rtol=1e-12)


# ----------------------------------------------------------------------------- local + global


def _local_global_dense(t, s, window, g, every, causal):
    """The rule written out per (i, j): positions s-t+i and j, independent of the module."""
    out = torch.zeros(t, s, dtype=torch.bool)
    for i in range(t):
        p = s - t + i
        for j in range(s):
            glob_p = p < g or (every > 0 and p % every == 0)
            glob_j = j < g or (every > 0 and j % every == 0)
            near = 0 <= p - j < window if causal else abs(p - j) < window
            ok = near or glob_p or glob_j
            out[i, j] = ok and (j <= p or not causal)
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    ("t", "s", "window", "g", "every"),
    [(9, 9, 3, 1, 0), (9, 9, 2, 2, 4), (4, 11, 3, 0, 5), (1, 13, 1, 3, 0), (7, 7, 7, 0, 0)],
)
def test_local_global_mask_equals_the_dense_loop_formula(t, s, window, g, every, causal):
    mask = LocalGlobalMask(g, every, causal)(t, s, None, window)
    assert torch.equal(mask, _local_global_dense(t, s, window, g, every, causal))


def test_no_global_tokens_is_the_sliding_window_and_a_wide_window_is_causal():
    for window in (1, 3, 6):
        got = LocalGlobalMask(0, 0)(6, 10, None, window)
        assert torch.equal(got, sliding_window_mask(6, 10, None, window))
    assert torch.equal(LocalGlobalMask(2, 3)(8, 8, None, 8), causal_mask(8, 8))
    assert MASKS["local_global"] is local_global_mask  # registered, default 1 global token


def test_local_global_padded_row_sees_what_it_sees_alone():
    key_mask = torch.tensor([[True] * 9, [False] * 3 + [True] * 6])
    fn = LocalGlobalMask(1, 4).padded(key_mask)
    got = fn(9, 9, None, 2)  # (B, 1, T, S)
    assert got.shape == (2, 1, 9, 9)
    assert torch.equal(got[0, 0], LocalGlobalMask(1, 4)(9, 9, None, 2))
    assert torch.equal(got[1, 0, 3:, 3:], LocalGlobalMask(1, 4)(6, 6, None, 2))
    assert torch.equal(position_ids_from_attention_mask(key_mask)[1, 3:], torch.arange(6))


def test_local_global_model_uses_the_full_cache_and_decodes_like_the_full_pass():
    cfg = tiny_model_config(
        vocab_size=V,
        attention={
            "n_heads": 4,
            "mask": "local_global",
            "window": 2,
            "global_tokens": 2,
            "global_every": 5,
        },
    )
    assert cfg.attention.global_tokens == 2 and cfg.attention.global_every == 5
    m = build_model(cfg).double().eval()
    x = torch.randint(0, V, (2, 14))
    with torch.no_grad():
        full = m(x).logits
        cache = m.new_cache()
        assert all(isinstance(layer, LayerKVCache) for layer in cache.layers)
        steps = [m(x[:, t : t + 1], cache=cache).logits for t in range(14)]
        windowed = (
            build_model(
                tiny_model_config(
                    vocab_size=V, attention={"n_heads": 4, "mask": "sliding_window", "window": 2}
                )
            )
            .double()
            .eval()
        )
        windowed.load_state_dict(m.state_dict())
        other = windowed(x).logits
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-12, rtol=1e-12)
    assert cache.nbytes() == 2 * 2 * 14 * 2 * 32 * 8  # layers, batch, tokens, k+v, K hd, fp64
    # the global tokens change what later queries read: not the plain sliding window
    torch.testing.assert_close(other[:, :2], full[:, :2])
    assert not torch.allclose(other[:, 2:], full[:, 2:])


@pytest.mark.parametrize(
    ("attention", "message"),
    [
        ({"mask": "local_global"}, "model.attention.window"),
        ({"mask": "local_global", "window": 2, "global_tokens": -1}, "global_tokens"),
        ({"mask": "local_global", "window": 2, "global_every": 99}, "global_every"),
        ({"mask": "causal", "global_tokens": 2}, "global_tokens"),
        ({"mask": "sliding_window", "window": 2, "global_every": 2}, "global_every"),
    ],
)
def test_bad_local_global_settings_name_the_field(attention, message):
    with pytest.raises(ConfigError, match=message):
        tiny_model_config(attention={"n_heads": 4, **attention})
