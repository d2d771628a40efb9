"""Norm placements checked against float64 formulas written out here."""

import math

import torch
import torch.nn.functional as F

from lmlab.models import build_model
from tests.helpers import tiny_model_config


def _rms(v: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w


def test_hybrid_norm_block_equals_its_float64_formula():
    """HybridNorm: h = x + Attn(QKV-norm), out = LayerNorm(h + FFN(h)) (Zhuo et al. 2025)."""
    cfg = tiny_model_config(vocab_size=37, block={"kind": "hybrid"}, position={"kind": "none"})
    model = build_model(cfg).double().eval()
    layer = model.layers[0]
    with torch.no_grad():
        for p in layer.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    b, t, d, h, hd = 2, 6, 32, 4, 8
    x = torch.randn(b, t, d, dtype=torch.float64)
    with torch.no_grad():
        got = layer(x, model.position, torch.arange(t))
        at, eps = layer.attn, cfg.norm.eps

        def heads(w: torch.Tensor, norm_w: torch.Tensor) -> torch.Tensor:
            return _rms((x @ w.T).view(b, t, h, hd), norm_w, eps).transpose(1, 2)

        q = heads(at.q_proj.weight, at.q_norm.weight)
        k = heads(at.k_proj.weight, at.k_norm.weight)
        v = heads(at.v_proj.weight, at.v_norm.weight)
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
        scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        hidden = x + y @ at.o_proj.weight.T
        f = layer.ffn
        ffn = F.gelu(hidden @ f.up_proj.weight.T + f.up_proj.bias) @ f.down_proj.weight.T
        ffn = ffn + f.down_proj.bias
        n = layer.ffn_norm
        expected = F.layer_norm(hidden + ffn, (d,), n.weight, n.bias, n.eps)
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
    assert not any("attn_norm" in name for name, _ in layer.named_parameters())


def test_post_norm_block_equals_its_formula():
    cfg = tiny_model_config(vocab_size=37, block={"kind": "post"}, position={"kind": "none"})
    model = build_model(cfg).double().eval()
    layer = model.layers[0]
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        got = layer(x, model.position, torch.arange(5))
        a = layer.attn(x, model.position, torch.arange(5)).out
        h = layer.attn_norm(x + a)
        expected = layer.ffn_norm(h + layer.ffn(h))
    torch.testing.assert_close(got, expected)
