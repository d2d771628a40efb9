"""Multi-head latent attention (DeepSeek-V2 sec. 2.1): equal to Hugging Face's DeepseekV3Attention
with the same weights (the state dict loads without a rename), the absorbed path equal to the
expanded one, and a cache of c_KV + k_R only, (kv_lora_rank + qk_rope_head_dim) numbers a token.
"""

from __future__ import annotations

import pytest
import torch

from lmlab.analysis.costs import kv_cache_bytes_per_token
from lmlab.errors import ConfigError
from lmlab.models.build import build_model
from lmlab.nn.mla import MultiHeadLatentAttention
from lmlab.nn.position import POSITION
from tests.helpers.attention_maps import forward_with_map
from tests.helpers.configs import tiny_model_config

H, D, C, CQ, N, R, DV = 4, 32, 20, 12, 6, 8, 5  # heads, d_model, c, c', nope, rope, v


def mla_config(q_lora_rank: int = CQ, interleaved: bool = True, **attention: object):
    return tiny_model_config(
        attention=dict(
            n_heads=H,
            kind="mla",
            head_dim=R,
            kv_lora_rank=C,
            q_lora_rank=q_lora_rank,
            qk_nope_head_dim=N,
            qk_rope_head_dim=R,
            v_head_dim=DV,
            **attention,
        ),
        position=dict(kind="rope", interleaved=interleaved, rope_theta=500.0),
        norm=dict(kind="rmsnorm", eps=1e-6),
    )


def perturbed(module: torch.nn.Module) -> torch.nn.Module:
    """Every parameter redrawn (norm weights off 1), so a wrong map cannot hide."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return module


def hf_attention(q_lora_rank: int | None, interleaved: bool):
    tr = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    cfg = tr.DeepseekV3Config(
        vocab_size=50,
        hidden_size=D,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=H,
        num_key_value_heads=H,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=C,
        qk_nope_head_dim=N,
        qk_rope_head_dim=R,
        v_head_dim=DV,
        rope_interleave=interleaved,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        first_k_dense_replace=1,
    )
    cfg._attn_implementation = "eager"
    return perturbed(ds.DeepseekV3Attention(cfg, 0).eval()), ds.DeepseekV3RotaryEmbedding(cfg)


@pytest.mark.parametrize("q_lora_rank", [CQ, 0])
@pytest.mark.parametrize("interleaved", [True, False])
def test_equals_hf_deepseek_v3_attention_left_padded(q_lora_rank, interleaved):
    """Same weights (loaded by name, strict), same inputs: outputs equal to 1e-5 in float32 at
    every real token of a left-padded batch, positions from the mask; expanded and absorbed."""
    hf, rotary = hf_attention(q_lora_rank or None, interleaved)
    b, t, pad = 2, 9, 3
    x = torch.randn(b, t, D, generator=torch.Generator().manual_seed(0))
    keep = torch.ones(b, t, dtype=torch.bool)
    keep[1, :pad] = False  # row 1 is left-padded
    positions = (keep.long().cumsum(-1) - 1).clamp_min(0)
    allowed = torch.ones(t, t, dtype=torch.bool).tril()[None] & keep[:, None, :]  # (B, T, S)
    mask = torch.zeros(b, 1, t, t).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    with torch.no_grad():
        want, _ = hf(x, rotary(x, positions), mask)
    for absorb in (False, True):
        cfg = mla_config(q_lora_rank, interleaved, absorb=absorb)
        ours = MultiHeadLatentAttention(cfg).eval()
        ours.load_state_dict(hf.state_dict())  # HF's names: a loader maps by renaming only
        position = POSITION.get("rope")(cfg)
        with torch.no_grad():
            got = ours(x, position, positions, key_mask=keep).out
        assert (got - want)[keep].abs().max() < 1e-5, absorb


@pytest.mark.parametrize("q_lora_rank", [CQ, 0])
def test_absorbed_equals_expanded_float64(q_lora_rank):
    """W_UK folded into the query and W_UV after the softmax: the same attention over the latent,
    equal to 1e-12 in float64 (1e-5 in float32) on a full pass and through a cache."""
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        cfg = mla_config(q_lora_rank)
        expanded = perturbed(MultiHeadLatentAttention(cfg)).to(dtype).eval()
        absorbed = MultiHeadLatentAttention(mla_config(q_lora_rank, absorb=True)).to(dtype)
        absorbed.load_state_dict(expanded.state_dict())
        position = POSITION.get("rope")(cfg)
        x = torch.randn(2, 11, D, dtype=dtype, generator=torch.Generator().manual_seed(2))
        pos = torch.arange(11)
        with torch.no_grad():
            full, w_full = forward_with_map(expanded, x, position, pos)
            lat, w_lat = forward_with_map(absorbed.eval(), x, position, pos)
            assert (full.out - lat.out).abs().max() < tol
            assert (w_full - w_lat).abs().max() < tol
            cache = absorbed.new_cache()  # prefill 6, then one token at a time
            steps = [absorbed(x[:, :6], position, pos[:6], cache=cache).out]
            steps += [
                absorbed(x[:, i : i + 1], position, pos[i : i + 1], cache=cache).out
                for i in range(6, 11)
            ]
            assert (torch.cat(steps, 1) - full.out).abs().max() < tol


def test_cache_holds_latent_and_rope_key_only():
    """Decoding caches (kv_lora_rank + qk_rope_head_dim) * 4 bytes a token and layer in float32,
    as declared, against 2 H hd * 4 for multi-head attention; cached decoding == full pass."""
    cfg = mla_config()
    model = build_model(cfg).eval()
    x = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(x).logits
        cache = model.new_cache()
        steps = [model(x[:, :4], cache=cache).logits]
        steps += [model(x[:, i : i + 1], cache=cache).logits for i in range(4, 10)]
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-5
    per_token = (C + R) * 4
    assert cache.nbytes() == 2 * 10 * cfg.n_layers * per_token
    assert kv_cache_bytes_per_token(cfg) == cfg.n_layers * per_token
    mha = tiny_model_config(attention=dict(n_heads=H))
    assert kv_cache_bytes_per_token(mha) == mha.n_layers * 2 * H * mha.head_dim * 4


@pytest.mark.parametrize(
    "attention, position, needle",
    [
        ({"kv_lora_rank": 0}, {}, "model.attention.kv_lora_rank"),
        ({"qk_rope_head_dim": 6}, {}, "model.attention.qk_rope_head_dim"),
        ({"n_kv_heads": 2}, {}, "model.attention.n_kv_heads"),
        ({"qk_norm": True}, {}, "model.attention.qk_norm"),
        ({}, {"kind": "alibi"}, "model.position.kind"),
    ],
)
def test_check_refuses_what_it_cannot_do(attention, position, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        tiny_model_config(
            attention=dict(n_heads=H, kind="mla", **attention), position=dict(position)
        )


def test_fields_refused_on_softmax():
    with pytest.raises(ConfigError, match="kv_lora_rank applies to kind=mla only"):
        tiny_model_config(attention=dict(n_heads=H, kv_lora_rank=8))
