import math

import pytest
import torch

from lmlab.nn.attention import SoftmaxAttention, attention_math, attention_sdpa, repeat_kv
from lmlab.nn.masks import causal_mask
from lmlab.nn.position import NoPosition
from tests.helpers import forward_with_map, tiny_model_config


def test_three_token_hand_example():
    """Q = K = [[1,0],[0,1],[1,1]], V = [[1,2],[3,4],[5,6]], no mask, d_k = 2."""
    qk = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
    values = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    q = k = torch.tensor(qk)[None, None]
    v = torch.tensor(values)[None, None]
    out, w = attention_math(q, k, v, None, scale=1 / math.sqrt(2))
    # The formula by hand, in plain Python: softmax_j(q_0 . k_j / sqrt(2)).
    scores = [sum(a * b for a, b in zip(qk[0], kj, strict=True)) / math.sqrt(2) for kj in qk]
    exps = [math.exp(s) for s in scores]
    expected = [e / sum(exps) for e in exps]
    assert w[0, 0, 0].tolist() == pytest.approx(expected, abs=1e-6)
    assert w[0, 0, 0].tolist() == pytest.approx([0.401, 0.198, 0.401], abs=1e-3)
    expected_out = [sum(expected[j] * values[j][c] for j in range(3)) for c in range(2)]
    assert out[0, 0, 0].tolist() == pytest.approx(expected_out, abs=1e-6)


def test_sdpa_equals_math_with_and_without_mask():
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    for mask in (None, causal_mask(5, 5)):
        a, _ = attention_math(q, k, v, mask, 0.3)
        b, _ = attention_sdpa(q, k, v, mask, 0.3)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    c, _ = attention_sdpa(q, k, v, None, 0.3, is_causal=True)
    torch.testing.assert_close(
        c, attention_math(q, k, v, causal_mask(5, 5), 0.3)[0], atol=1e-5, rtol=1e-5
    )


def test_causal_mask_with_cache_offset_is_bottom_right_aligned():
    m = causal_mask(2, 5)
    assert m.tolist() == [[True, True, True, True, False], [True] * 5]
    with pytest.raises(ValueError):
        causal_mask(3, 2)


def test_fully_masked_row_gives_zeros_not_nan():
    q, k, v = (torch.randn(1, 1, 3, 4) for _ in range(3))
    mask = torch.ones(3, 3, dtype=torch.bool)
    mask[1] = False
    out, w = attention_math(q, k, v, mask, 0.5)
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    assert out[0, 0, 1].abs().sum() == 0 and w[0, 0, 1].sum() == 0
    torch.testing.assert_close(w[0, 0, 0].sum(), torch.tensor(1.0))


def test_weights_rows_sum_to_one_and_respect_causality():
    _, w = attention_math(*(torch.randn(1, 2, 6, 4) for _ in range(3)), causal_mask(6, 6), 0.5)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, 6))
    assert (w.triu(diagonal=1) == 0).all()


def test_gqa_equals_mha_with_duplicated_kv_heads():
    """GQA with K kv heads = MHA whose k/v projections repeat each kv head H/K times."""
    gqa_cfg = tiny_model_config(d_model=32, attention={"n_heads": 4, "n_kv_heads": 2})
    mha_cfg = tiny_model_config(d_model=32, attention={"n_heads": 4})
    gqa, mha = SoftmaxAttention(gqa_cfg), SoftmaxAttention(mha_cfg)
    hd = gqa_cfg.head_dim
    with torch.no_grad():
        mha.q_proj.weight.copy_(gqa.q_proj.weight)
        mha.o_proj.weight.copy_(gqa.o_proj.weight)
        for name in ("k_proj", "v_proj"):
            w = getattr(gqa, name).weight.view(2, hd, 32)
            getattr(mha, name).weight.copy_(w.repeat_interleave(2, dim=0).reshape(4 * hd, 32))
    x = torch.randn(2, 7, 32)
    pos = NoPosition(gqa_cfg)
    torch.testing.assert_close(
        gqa(x, pos, torch.arange(7)).out, mha(x, pos, torch.arange(7)).out, atol=1e-6, rtol=1e-5
    )
    assert repeat_kv(torch.arange(2.0).view(1, 2, 1, 1), 3).flatten().tolist() == [0, 0, 0, 1, 1, 1]


def test_math_backend_matches_sdpa_backend_in_module():
    cfg = tiny_model_config()
    attn = SoftmaxAttention(cfg).eval()
    x = torch.randn(2, 9, cfg.d_model)
    pos = NoPosition(cfg)
    fast = attn(x, pos, torch.arange(9)).out
    slow, weights = forward_with_map(attn, x, pos, torch.arange(9))  # the math formula
    assert weights.shape == (2, 4, 9, 9)
    torch.testing.assert_close(fast, slow.out, atol=1e-5, rtol=1e-5)


def test_math_attention_of_float64_inputs_is_float64_exact():
    """A float64 model is a reference: its softmax must not be demoted to float32 (error 1e-8)."""
    q, k, v = (torch.randn(2, 3, 7, 8, dtype=torch.float64) * 3 for _ in range(3))
    mask = causal_mask(7, 7)
    out, w = attention_math(q, k, v, mask, scale=0.35)
    scores = (q @ k.transpose(-2, -1)) * 0.35
    scores = scores - scores.masked_fill(~mask, -math.inf).amax(-1, keepdim=True)
    e = scores.exp() * mask  # the formula: exp(s_ij - max_j) / sum_j, masked keys weigh 0
    expected = e / e.sum(-1, keepdim=True)
    assert w.dtype == torch.float64 and out.dtype == torch.float64
    torch.testing.assert_close(w, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(out, expected @ v, rtol=0, atol=1e-12)
