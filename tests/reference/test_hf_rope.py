"""RoPE variants equal Hugging Face: Llama with linear / dynamic / yarn scaling, GPT-NeoX with
partial rotary. Tiny configs, random weights, nothing downloaded; float32 logits to 1e-5, for the
full forward pass and for cached decoding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmlab.errors import LmlabError  # noqa: E402
from lmlab.generation.generate import SamplingParams, generate_ids  # noqa: E402
from lmlab.interop.hf import llama_model_config, llama_state_dict, rope_position_config  # noqa: E402
from lmlab.interop.hf_neox import neox_model_config, neox_state_dict  # noqa: E402
from lmlab.models import build_model  # noqa: E402
from tests.helpers import hf_config, perturb_vectors  # noqa: E402

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _hf_cached(hf_model: torch.nn.Module, x: torch.Tensor, prefill: int) -> torch.Tensor:
    """HF logits from a prefill of ``prefill`` tokens, then one token at a time with its cache."""
    out = hf_model(x[:, :prefill], use_cache=True)
    steps = [out.logits]
    for t in range(prefill, x.shape[1]):
        out = hf_model(x[:, t : t + 1], cache=out.cache, use_cache=True)
        steps.append(out.logits)
    return torch.cat(steps, 1)


def _ours_cached(model: torch.nn.Module, x: torch.Tensor, prefill: int) -> torch.Tensor:
    cache = model.new_cache()
    steps = [model(x[:, :prefill], cache=cache).logits]
    steps += [model(x[:, t : t + 1], cache=cache).logits for t in range(prefill, x.shape[1])]
    return torch.cat(steps, 1)


def _llama_pair(rope_parameters: dict, max_pos: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    cfg = hf_config("llama", max_position_embeddings=max_pos, rope_parameters=dict(rope_parameters))
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(cfg).eval()
    perturb_vectors(hf_model, 0.1)
    ours = build_model(llama_model_config(cfg)).eval()
    ours.load_state_dict(llama_state_dict(hf_model.state_dict(), False), strict=True)
    return hf_model, ours


STATIC_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0},
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "rope_theta": 500.0,
    },
    "yarn-beta-notruncate-attnfactor": {
        "rope_type": "yarn",
        "factor": 3.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 8.0,
        "beta_slow": 2.0,
        "truncate": False,
        "attention_factor": 1.3,
        "rope_theta": 500.0,
    },
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "mscale": 0.8,
        "mscale_all_dim": 0.5,
        "rope_theta": 500.0,
    },
}


@pytest.mark.parametrize("name", list(STATIC_SCALINGS))
def test_llama_with_static_rope_scaling_matches_hf_full_and_cached(name: str):
    hf_model, ours = _llama_pair(STATIC_SCALINGS[name], max_pos=64)
    assert ours.cfg.position.scaling.kind == STATIC_SCALINGS[name]["rope_type"]
    x = torch.randint(0, 97, (2, 40))  # past the yarn models' original 16 positions
    with torch.no_grad():
        ref = hf_model(x).logits
        torch.testing.assert_close(ours(x).logits, ref, **TOL)
        torch.testing.assert_close(_ours_cached(ours, x, 9), ref, **TOL)
        plain_hf, _ = _llama_pair({"rope_type": "default", "rope_theta": 500.0}, max_pos=64)
        assert not torch.allclose(plain_hf(x).logits, ref, atol=1e-3)  # the scaling matters


def test_llama_dynamic_ntk_matches_hf_past_original_length_full_and_cached():
    hf_model, ours = _llama_pair(
        {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0}, max_pos=16
    )
    s = ours.cfg.position.scaling
    assert (s.kind, s.factor, s.original_max_seq_len) == ("dynamic_ntk", 2.0, 16)
    x = torch.randint(0, 97, (2, 40))  # longer than max_position_embeddings=16
    with torch.no_grad():
        full = hf_model(x).logits
        torch.testing.assert_close(ours(x).logits, full, **TOL)
        # Cached: each step's base follows the length so far, cached keys keep their rotation.
        cached = _hf_cached(hf_model, x, 9)
        torch.testing.assert_close(_ours_cached(ours, x, 9), cached, **TOL)
        # Up to 16 tokens dynamic NTK is plain RoPE; a 40-token forward pass rescales all of them.
        plain_hf, _ = _llama_pair({"rope_type": "default", "rope_theta": 500.0}, max_pos=16)
        torch.testing.assert_close(cached[:, :16], plain_hf(x[:, :16]).logits, **TOL)
        assert not torch.allclose(cached, full, atol=1e-3)


def test_old_rope_scaling_and_rope_theta_attributes_map_like_rope_parameters():
    new = transformers.LlamaConfig(
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "rope_theta": 500.0,
        },
    )
    old = SimpleNamespace(  # a transformers 4 config.json: rope_theta beside rope_scaling
        max_position_embeddings=64,
        rope_theta=500.0,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    )
    assert rope_position_config(old) == rope_position_config(new)
    for hf_type, kind in [("linear", "linear"), ("dynamic", "dynamic_ntk")]:
        cfg = SimpleNamespace(max_position_embeddings=64, rope_theta=7.0, rope_scaling=None)
        cfg.rope_scaling = {"rope_type": hf_type, "factor": 2.0}
        pos = rope_position_config(cfg)
        assert (pos.rope_theta, pos.scaling.kind, pos.scaling.factor) == (7.0, kind, 2.0)
    plain = rope_position_config(SimpleNamespace(max_position_embeddings=64, rope_theta=9.0))
    assert (plain.rope_theta, plain.scaling.kind) == (9.0, "none")
    with pytest.raises(LmlabError, match="'llama3' has no lmlab component"):
        rope_position_config(
            SimpleNamespace(max_position_embeddings=64, rope_scaling={"rope_type": "llama3"})
        )


def _neox_config(**kw: object):
    return hf_config("gpt_neox", **kw)


@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "parallel"])
@pytest.mark.parametrize("attention_bias", [True, False])
def test_gpt_neox_partial_rotary_matches_hf_full_and_cached(attention_bias: bool, parallel: bool):
    cfg = _neox_config(attention_bias=attention_bias, use_parallel_residual=parallel)
    torch.manual_seed(0)
    hf_model = transformers.GPTNeoXForCausalLM(cfg).eval()
    perturb_vectors(hf_model, 0.05)
    mc = neox_model_config(cfg)
    assert (mc.position.partial_rotary_factor, mc.position.rope_theta) == (0.25, 500.0)
    assert (mc.norm.kind, mc.ffn.activation, mc.tie_embeddings) == ("layernorm", "gelu", False)
    ours = build_model(mc).eval()
    ours.load_state_dict(neox_state_dict(hf_model.state_dict(), 4), strict=True)
    assert ours.position.rotary_dim == 4  # 0.25 * head_dim 16
    x = torch.randint(0, 97, (2, 17))
    with torch.no_grad():
        ref = hf_model(x).logits
        torch.testing.assert_close(ours(x).logits, ref, **TOL)
        torch.testing.assert_close(_ours_cached(ours, x, 9), ref, **TOL)
        expected = hf_model.generate(
            x[:1, :5], max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None
        )[0, 5:].tolist()
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    assert list(generate_ids(ours, x[0, :5].tolist(), greedy, 64)) == expected


def test_gpt_neox_fused_qkv_is_split_per_head():
    cfg = _neox_config()
    torch.manual_seed(0)
    hf_model = transformers.GPTNeoXForCausalLM(cfg)
    sd = neox_state_dict(hf_model.state_dict(), 4)
    w = hf_model.gpt_neox.layers[0].attention.query_key_value.weight  # (3D, D)
    hd = 16
    for h in range(4):  # rows of head h: [q_h; k_h; v_h]
        rows = w[3 * hd * h : 3 * hd * (h + 1)]
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            got = sd[f"layers.0.attn.{name}.weight"][hd * h : hd * (h + 1)]
            torch.testing.assert_close(got, rows[hd * j : hd * (j + 1)], atol=0, rtol=0)


def test_gpt_neox_old_attributes_and_parallel_residual():
    old = SimpleNamespace(  # a transformers 4 GPTNeoXConfig: rotary_pct / rotary_emb_base
        vocab_size=97,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        rotary_pct=0.25,
        rotary_emb_base=500,
        layer_norm_eps=1e-5,
        hidden_act="gelu",
        use_parallel_residual=False,
        tie_word_embeddings=False,
    )
    assert neox_model_config(old) == neox_model_config(_neox_config())
    assert neox_model_config(_neox_config(use_parallel_residual=True)).block.parallel
