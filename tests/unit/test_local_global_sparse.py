"""The block-sparse local + global path equals the dense masked formula (its oracle).

Facts: :func:`local_global_sparse` equals softmax over the dense :func:`local_global_allowed`
mask (float64 to 1e-12, float32 to 1e-5) for full passes and chunks (S > T), GQA, left padding
with positions from the mask, with and without ``global_every``; the attention core takes the
sparse path exactly where :func:`sparse_applies` says; a model's full pass, decode steps,
chunked prefill and gradients equal the dense model's; the sparse path keeps no (T, S) tensor.
"""

from __future__ import annotations

import pytest
import torch

from lmlab.models import build_model
from lmlab.nn.attention_core import attend, attention_math, attention_sdpa, repeat_kv
from lmlab.nn.hooks import HookPoint
from lmlab.nn.local_global import (
    LocalGlobalMask,
    local_global_allowed,
    local_global_sparse,
    sparse_applies,
)
from lmlab.nn.masks import position_ids_from_attention_mask
from tests.helpers import tiny_model_config

V = 50


def dense_reference(q, k, v, window, g, every, key_mask=None, from_key_mask=False):
    """softmax(q k^T / sqrt(hd)) v over the dense local_global mask, padding keys removed, a
    query with no key 0: the formula spelled out, float64 when the inputs are."""
    t, s = q.shape[2], k.shape[2]
    idx = torch.arange(s)
    if key_mask is not None and from_key_mask:
        pos = position_ids_from_attention_mask(key_mask[:, -s:])[:, None]  # (B, 1, S)
    else:
        pos = idx[None, None]
    allowed = local_global_allowed(
        pos[..., -t:, None], pos[..., None, :], window, g, every, order=idx[None] <= idx[-t:, None]
    )  # (B or 1, 1, T, S)
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, -s:]
    rep = q.shape[1] // k.shape[1]
    scores = q @ repeat_kv(k, rep).transpose(-2, -1) / q.shape[-1] ** 0.5
    w = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    return w @ repeat_kv(v, rep)


def qkv(b, h, kv, t, s, hd=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, hd, generator=gen, dtype=dtype)
    k = torch.randn(b, kv, s, hd, generator=gen, dtype=dtype)
    v = torch.randn(b, kv, s, hd, generator=gen, dtype=dtype)
    return q, k, v


CASES = [  # (T, S, window, global_tokens, global_every, H, K)
    (32, 32, 4, 1, 0, 4, 4),
    (33, 33, 5, 2, 0, 4, 2),  # T not a multiple of the block
    (40, 40, 3, 2, 7, 4, 1),  # every 7th global, MQA
    (29, 29, 4, 0, 5, 2, 2),  # only strided globals
    (30, 30, 6, 0, 0, 4, 2),  # no global token: the sliding window
    (7, 40, 4, 1, 6, 4, 2),  # a chunk of 7 after 33 cached keys
    (1, 37, 5, 3, 4, 4, 1),  # a decode step
    (24, 24, 24, 1, 0, 2, 1),  # window = T: the band alone covers every key
]


@pytest.mark.parametrize(("t", "s", "window", "g", "every", "h", "kv"), CASES)
def test_sparse_equals_the_dense_formula_in_float64(t, s, window, g, every, h, kv):
    q, k, v = qkv(2, h, kv, t, s)
    got = local_global_sparse(
        q, k, v, scale=8**-0.5, window=window, global_tokens=g, global_every=every
    )
    want = dense_reference(q, k, v, window, g, every)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(("t", "s", "window", "g", "every", "h", "kv"), CASES)
def test_sparse_equals_the_dense_formula_with_left_padding(t, s, window, g, every, h, kv):
    q, k, v = qkv(3, h, kv, t, s, seed=1)
    key_mask = torch.ones(3, s, dtype=torch.bool)
    key_mask[1, :5] = False
    key_mask[2, : s - 2] = False  # 2 real tokens: most queries are padding
    got = local_global_sparse(
        q,
        k,
        v,
        scale=8**-0.5,
        window=window,
        global_tokens=g,
        global_every=every,
        key_mask=key_mask,
        from_key_mask=True,
    )
    want = dense_reference(q, k, v, window, g, every, key_mask, from_key_mask=True)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    # a left-padded row equals the same row alone
    alone = local_global_sparse(
        q[1:2, :, -min(t, s - 5) :],
        k[1:2, :, 5:],
        v[1:2, :, 5:],
        scale=8**-0.5,
        window=window,
        global_tokens=g,
        global_every=every,
    )
    torch.testing.assert_close(got[1:2, :, -alone.shape[2] :], alone, atol=1e-12, rtol=1e-12)


def test_sparse_equals_the_dense_formula_in_float32():
    q, k, v = qkv(2, 4, 2, 64, 64, hd=16, dtype=torch.float32)
    got = local_global_sparse(q, k, v, scale=0.25, window=8, global_tokens=1, global_every=9)
    want = dense_reference(q.double(), k.double(), v.double(), 8, 1, 9)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_the_core_takes_the_sparse_path_exactly_where_the_rule_says(monkeypatch):
    calls = []
    real = LocalGlobalMask.sparse_attend

    def spy(self, *args, **kw):
        out = real(self, *args, **kw)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(LocalGlobalMask, "sparse_attend", spy)
    mask = LocalGlobalMask(1, 0)
    for s, sparse in ((31, False), (32, True)):  # window 4: sparse from S = 32
        assert sparse_applies(s, 4, True) is sparse
        q, k, v = qkv(1, 2, 2, s, s)
        y, _ = attend(q, k, v, backend=attention_sdpa, scale=1.0, mask_fn=mask, window=4)
        assert calls.pop() is sparse
        torch.testing.assert_close(
            y, dense_reference(q * 8**0.5, k, v, 4, 1, 0), atol=1e-12, rtol=0
        )
    q, k, v = qkv(1, 2, 2, 32, 32)
    pattern = HookPoint()
    pattern.fns.append(lambda w, _: None)  # a pattern hook on (as need_weights records it)
    hooks = (HookPoint(), pattern)
    attend(q, k, v, backend=attention_math, scale=1.0, mask_fn=mask, window=4, hooks=hooks)
    assert calls == []  # weights materialised: the dense math path, the sparse one not called
    hole = torch.ones(1, 32, dtype=torch.bool)
    hole[0, 10] = False  # padding after a real token: positions are not index - offset
    attend(
        q,
        k,
        v,
        backend=attention_sdpa,
        scale=1.0,
        mask_fn=mask.padded(hole),
        window=4,
        key_mask=hole,
    )
    assert calls.pop() is False
    assert not sparse_applies(64, 4, causal=False)  # the bidirectional form stays dense


def _model(**attention):
    cfg = tiny_model_config(
        vocab_size=V, max_seq_len=64, attention={"n_heads": 4, "mask": "local_global", **attention}
    )
    return build_model(cfg).double().eval()


@pytest.mark.parametrize(
    "attention",
    [
        {"window": 3, "global_tokens": 1},
        {"window": 2, "global_tokens": 2, "global_every": 5, "n_kv_heads": 2},
    ],
)
def test_model_sparse_equals_dense_full_chunked_decoded_and_padded(attention, monkeypatch):
    m = _model(**attention)
    x = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(x)
    mask[1, :6] = 0
    pos = position_ids_from_attention_mask(mask)
    with torch.no_grad():
        full = m(x).logits
        padded = m(x, attention_mask=mask, position_ids=pos).logits
        cache = m.new_cache()
        chunks = [m(x[:, i : i + 7], cache=cache).logits for i in range(0, 40, 7)]
        cache = m.new_cache()
        steps = [m(x[:, i : i + 1], cache=cache).logits for i in range(40)]
        alone = m(x[1:, 6:]).logits
        monkeypatch.setattr(LocalGlobalMask, "sparse_attend", lambda *a, **kw: None)
        dense_full = m(x).logits
        dense_padded = m(x, attention_mask=mask, position_ids=pos).logits
    tol = {"atol": 1e-12, "rtol": 1e-12}
    torch.testing.assert_close(full, dense_full, **tol)
    torch.testing.assert_close(padded, dense_padded, **tol)
    torch.testing.assert_close(torch.cat(chunks, 1), full, **tol)
    torch.testing.assert_close(torch.cat(steps, 1), full, **tol)
    torch.testing.assert_close(padded[1:, 6:], alone, **tol)


def test_gradients_equal_the_dense_formula():
    q, k, v = qkv(2, 4, 2, 36, 36)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    y = local_global_sparse(q, k, v, scale=8**-0.5, window=4, global_tokens=1, global_every=8)
    grads = torch.autograd.grad((y * y).sum(), (q, k, v))
    ref = dense_reference(q, k, v, 4, 1, 8)
    want = torch.autograd.grad((ref * ref).sum(), (q, k, v))
    for a, b in zip(grads, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_sparse_path_keeps_no_query_by_key_tensor():
    t = 256
    q, k, v = qkv(1, 4, 4, t, t, dtype=torch.float32)
    q.requires_grad_()
    largest = []

    def pack(x):
        largest.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        local_global_sparse(q, k, v, scale=1.0, window=16, global_tokens=1, global_every=0)
    # the band's scores, (H, T, 2 window - 1 + G) = 4 * 256 * 32, against the dense 4 * 256 * 256
    assert max(largest) <= 4 * t * (2 * 16 - 1 + 1)


@pytest.mark.parametrize(("window", "g", "every", "kv"), [(16, 1, 0, 4), (8, 2, 16, 2)])
def test_declared_saved_elements_match_what_autograd_keeps(window, g, every, kv):
    t, h, hd = 256, 4, 16
    cfg = tiny_model_config(
        vocab_size=V,
        d_model=64,
        max_seq_len=t,
        attention={
            "n_heads": h,
            "n_kv_heads": kv,
            "mask": "local_global",
            "window": window,
            "global_tokens": g,
            "global_every": every,
        },
    )
    q, k, v = qkv(1, h, kv, t, t, hd=hd, dtype=torch.float32)
    inputs = {x.requires_grad_().untyped_storage().data_ptr() for x in (q, k, v)}
    seen = {}

    def pack(x):
        st = x.untyped_storage()
        if st.data_ptr() not in inputs:
            seen[st.data_ptr()] = st.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        local_global_sparse(q, k, v, scale=1.0, window=window, global_tokens=g, global_every=every)
    from lmlab.nn.attention import SoftmaxAttention

    declared = SoftmaxAttention.saved_score_elements(cfg, t) * t * 4  # float32 bytes
    assert 0.9 < declared / sum(seen.values()) < 1.1
    dense = 4 * t * h * hd  # QK^T and AV over every key
    ell, n_global = (
        min(t, window) + window - 1,
        len([p for p in range(t) if p < g or (every and p % every == 0)]),
    )
    want = 4 * h * hd * (ell + n_global) + 4 * h * hd * n_global  # rows: n_global x T keys / T
    assert SoftmaxAttention.score_flops_per_token(cfg, t) == want < dense
    cfg.attention.mask = "sliding_window"  # no sparse path: the dense count
    assert SoftmaxAttention.score_flops_per_token(cfg, t) == dense
