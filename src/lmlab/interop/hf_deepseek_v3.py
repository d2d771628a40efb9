"""Hugging Face DeepSeek-V3 <-> lmlab: multi-head latent attention with dense SwiGLU layers
(DeepSeek-AI 2024, "DeepSeek-V3 Technical Report"; MLA from "DeepSeek-V2", sec. 2.1).

Legend: H heads, c kv_lora_rank, c' q_lora_rank, n qk_nope_head_dim, r qk_rope_head_dim,
dv v_head_dim, D hidden_size, F intermediate_size.

A ``DeepseekV3Config`` maps onto ``model.attention.kind: mla``
(:class:`lmlab.nn.mla.MultiHeadLatentAttention`, whose parameters carry HF's DeepseekV3Attention
names, so the weights load by renaming ``model.layers.{i}.self_attn`` -> ``layers.{i}.attn``):

- ``head_dim`` = r (HF's DeepseekV3Config sets it so), RoPE on the r decoupled channels;
  ``rope_interleave`` (DeepSeek's checkpoints: true) is ``model.position.interleaved``. HF
  rotates the interleaved pairs and returns them de-interleaved; lmlab rotates them in place:
  the same permutation of q_R and k_R, so every score is equal and no row is reordered.
- ``q_lora_rank`` null is lmlab's 0 (a plain ``q_proj``), else q_a_proj / q_a_layernorm /
  q_b_proj.
- the softmax scale is 1/sqrt(n + r) times yarn_mscale(factor, mscale_all_dim)^2 when
  ``rope_parameters`` sets ``mscale_all_dim`` (HF's ``yarn_apply_mscale``):
  ``model.attention.softmax_mscale: true``; YaRN itself is :mod:`lmlab.nn.rope_scaling`'s.
- the FFN of every layer is the dense SwiGLU MLP of width F. DeepSeek's MoE layers (from layer
  ``first_k_dense_replace`` on: sigmoid-scored, group-limited top-k routing with a score
  correction bias, a routed scaling factor and shared experts) have no lmlab counterpart, so a
  config with any is refused by name.

HF's latent norms (q_a_layernorm, kv_a_layernorm) use eps 1e-6 whatever ``rms_norm_eps`` says,
lmlab's the model's eps: a config whose ``rms_norm_eps`` is not 1e-6 is refused. Works on config
objects with ``DeepseekV3Config``'s attributes and plain state dicts; lmlab never imports
``transformers`` here.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from lmlab.config import (
    AttentionConfig,
    BlockConfig,
    FFNConfig,
    ModelConfig,
    NormConfig,
)
from lmlab.errors import LmlabError
from lmlab.interop.families_decoder import (
    _Checks,
    _common_checks,
    _llama_kwargs,
    _rope_checks,
)
from lmlab.interop.hf import HF_ROPE_TYPES, LLAMA_KEYS, llama_state_dict, rope_position_config
from lmlab.interop.hf_family import HF_FAMILIES, HFFamily
from lmlab.interop.hf_fields import MAX_EXPERTS, MAX_FFN, MAX_HEADS, MAX_LAYERS, Field, check_value
from lmlab.nn.mla import MLADims

LATENT_EPS = 1e-6  # HF DeepseekV3RMSNorm's default, used by q_a_layernorm and kv_a_layernorm

# config.json fields only DeepSeek reads (the shared ones are lmlab.interop.hf_fields'), checked
# before anything is built; MoE sizes are checked too, so a hostile value is named even though
# the MoE layout is refused anyway.
DEEPSEEK_FIELDS: dict[str, Field] = {
    "kv_lora_rank": Field("int", 1, MAX_FFN),
    "q_lora_rank": Field("int", 1, MAX_FFN, nullable=True),
    "qk_nope_head_dim": Field("int", 1, MAX_HEADS),
    "qk_rope_head_dim": Field("int", 2, MAX_HEADS),
    "v_head_dim": Field("int", 1, MAX_HEADS),
    "first_k_dense_replace": Field("int", 0, MAX_LAYERS),
    "n_routed_experts": Field("int", 1, MAX_EXPERTS, nullable=True),
    "n_shared_experts": Field("int", 0, MAX_EXPERTS, nullable=True),
    "moe_intermediate_size": Field("int", 1, MAX_FFN, nullable=True),
    "n_group": Field("int", 1, MAX_EXPERTS, nullable=True),
    "topk_group": Field("int", 1, MAX_EXPERTS, nullable=True),
    "num_nextn_predict_layers": Field("int", 0, MAX_LAYERS, nullable=True),
    "routed_scaling_factor": Field("float", 0, nullable=True),
    "norm_topk_prob": Field("bool", nullable=True),
    "rope_interleave": Field("bool", nullable=True),
}
# HF's defaults for what a config.json may leave out (DeepseekV3Config's class attributes)
DEFAULTS: dict[str, Any] = {
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "first_k_dense_replace": 3,
    "n_routed_experts": 256,
    "rope_interleave": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
}


def _get(hf: Any, name: str) -> Any:
    """``hf.name``, HF's default when absent or null (but a null q_lora_rank: no q latent)."""
    value = getattr(hf, name, DEFAULTS[name])
    return DEFAULTS[name] if value is None and name != "q_lora_rank" else value


def check_deepseek_config(raw: dict[str, Any], path: Path) -> None:
    """Check a DeepSeek-V3 ``config.json`` beyond :func:`lmlab.interop.hf_fields.check_hf_config`:
    the MLA sizes' types and ranges, the MoE layout (refused by name), hidden_act silu,
    rms_norm_eps 1e-6 (the latent norms'), key/value heads = heads, a RoPE scaling whose
    ``mscale_all_dim`` lmlab can apply. Raises LmlabError naming ``path`` and the field."""
    for name, field in DEEPSEEK_FIELDS.items():
        if name in raw:
            check_value(raw[name], field, f"{path}: {name}")
    layers = raw.get("num_hidden_layers")
    dense = raw.get("first_k_dense_replace", DEFAULTS["first_k_dense_replace"])
    experts = raw.get("n_routed_experts", DEFAULTS["n_routed_experts"])
    if isinstance(layers, int) and dense < layers:
        raise LmlabError(
            f"{path}: DeepSeek-V3 MoE layers (n_routed_experts={experts}, "
            f"first_k_dense_replace={dense}, num_hidden_layers={layers}) are not supported; "
            "lmlab's MoE (model.ffn.kind=moe) has no sigmoid-scored, group-limited router with "
            "a score-correction bias and shared experts, and no per-layer dense/MoE split: only "
            "configs whose layers are all dense (first_k_dense_replace >= num_hidden_layers) load"
        )
    head_dim, rope = raw.get("head_dim"), raw.get("qk_rope_head_dim", DEFAULTS["qk_rope_head_dim"])
    if head_dim is not None and head_dim != rope:
        raise LmlabError(
            f"{path}: head_dim ({head_dim!r:.20}) differs from qk_rope_head_dim ({rope}); "
            "DeepSeek-V3's head_dim is the RoPE channel count (transformers' forward fails "
            "otherwise): drop head_dim or set it to qk_rope_head_dim"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise LmlabError(f"{path}: hidden_act is {act!r:.40}; DeepSeek-V3 loads with silu only")
    eps = raw.get("rms_norm_eps", LATENT_EPS)
    if eps != LATENT_EPS:
        raise LmlabError(
            f"{path}: rms_norm_eps is {eps!r}; transformers' DeepSeek-V3 normalises the latents "
            f"(q_a_layernorm, kv_a_layernorm) with eps {LATENT_EPS:g} whatever rms_norm_eps says "
            f"and lmlab with the model's eps, so only rms_norm_eps {LATENT_EPS:g} loads exactly"
        )
    heads, kv = raw.get("num_attention_heads"), raw.get("num_key_value_heads")
    if kv is not None and kv != heads:
        raise LmlabError(
            f"{path}: num_key_value_heads ({kv}) must equal num_attention_heads ({heads}): "
            "MLA expands every head's key and value from one shared latent"
        )
    for group in ("rope_parameters", "rope_scaling"):
        params = raw.get(group) or {}
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in HF_ROPE_TYPES:
            raise LmlabError(
                f"{path}: {group}.rope_type {kind!r:.30} has no lmlab component; supported: "
                f"{', '.join(HF_ROPE_TYPES)}"
            )
        if params.get("mscale_all_dim") and kind != "yarn":
            raise LmlabError(
                f"{path}: {group}.mscale_all_dim with rope_type {kind!r:.20}: lmlab applies "
                "DeepSeek's softmax mscale with yarn only"
            )
        if kind == "yarn" and bool(params.get("mscale")) != bool(params.get("mscale_all_dim")):
            raise LmlabError(
                f"{path}: {group} sets one of mscale / mscale_all_dim; lmlab reads DeepSeek's "
                "YaRN mscale with both set (or neither)"
            )
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise LmlabError(
                f"{path}: {group}.partial_rotary_factor must be 1: DeepSeek rotates all "
                "qk_rope_head_dim channels"
            )


def deepseek_v3_model_config(hf: Any) -> ModelConfig:
    """A ``DeepseekV3Config`` (or a config.json namespace, checked by
    :func:`check_deepseek_config`) -> ModelConfig: MLA, RMSNorm, dense SwiGLU, RoPE of
    ``qk_rope_head_dim`` channels (interleaved as ``rope_interleave``), Pre-Norm.
    Raises LmlabError for MoE layers."""
    layers = hf.num_hidden_layers
    if _get(hf, "first_k_dense_replace") < layers:
        raise LmlabError(
            f"DeepSeek-V3 MoE layers (n_routed_experts={_get(hf, 'n_routed_experts')}, "
            f"first_k_dense_replace={_get(hf, 'first_k_dense_replace')}) are not supported"
        )
    rope = _get(hf, "qk_rope_head_dim")
    position = rope_position_config(hf)
    position.interleaved = bool(_get(hf, "rope_interleave"))
    s = position.scaling
    attention = AttentionConfig(
        kind="mla",
        n_heads=hf.num_attention_heads,
        head_dim=rope,
        bias=bool(_get(hf, "attention_bias")),
        dropout=float(_get(hf, "attention_dropout")),
        _extra={
            "kv_lora_rank": _get(hf, "kv_lora_rank"),
            "q_lora_rank": _get(hf, "q_lora_rank") or 0,
            "qk_nope_head_dim": _get(hf, "qk_nope_head_dim"),
            "qk_rope_head_dim": rope,
            "v_head_dim": _get(hf, "v_head_dim"),
            "softmax_mscale": s.kind == "yarn" and s.mscale_all_dim is not None,
        },
    )
    return ModelConfig(
        vocab_size=hf.vocab_size,
        d_model=hf.hidden_size,
        n_layers=layers,
        max_seq_len=hf.max_position_embeddings,
        tie_embeddings=bool(_get(hf, "tie_word_embeddings")),
        attention=attention,
        position=position,
        norm=NormConfig(kind="rmsnorm", eps=_get(hf, "rms_norm_eps")),
        ffn=FFNConfig(kind="swiglu", d_ff=hf.intermediate_size, bias=False),
        block=BlockConfig(kind="pre"),
    )


ATTN = (
    *("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj"),
    *("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"),
)
LAYER_KEYS = {  # HF module under model.layers.{i} -> lmlab module under layers.{i}
    **{f"self_attn.{name}": f"attn.{name}" for name in ATTN},
    "mlp.gate_proj": "ffn.gate_proj",
    "mlp.up_proj": "ffn.up_proj",
    "mlp.down_proj": "ffn.down_proj",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def deepseek_v3_state_dict(
    sd: dict[str, torch.Tensor], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 keys -> lmlab's: Llama's rename with the MLA modules (a tied head copied from
    the embedding). The multi-token-prediction (MTP) modules that DeepSeek's checkpoints store
    as extra layers after the last one (``model.layers.{n_layers + j}.*``: enorm, hnorm,
    eh_proj, a block and a shared head; ``num_nextn_predict_layers`` of them) are skipped, as
    transformers skips them (the next-token model does not use them; DeepSeek-V3 sec. 2.2): a
    layer past the last one is MTP when it holds ``model.layers.{i}.eh_proj.weight`` (the MTP
    projection of [norm(h); norm(embedding)]) and the MTP layers follow the last one without a
    gap (n_layers, n_layers + 1, ...); any other tensor past the last layer is a stray one,
    refused. Raises LmlabError naming a weight with no place: an MoE expert or router, any other
    key."""
    mtp: set[int] = set()
    i = cfg.n_layers
    while f"model.layers.{i}.eh_proj.weight" in sd:
        mtp.add(i)
        i += 1
    kept = {k: v for k, v in sd.items() if _layer_index(k) not in mtp}
    return llama_state_dict(kept, cfg.tie_embeddings, LAYER_KEYS, "DeepSeek-V3")


# ``model.layers.{i}.``: i in plain ASCII decimal without leading zeros ('²'.isdigit() is True but
# int() refuses it; '٢' and '02' would be read as 2)
_LAYER_KEY = re.compile(r"model\.layers\.(0|[1-9][0-9]{0,8})\.", re.ASCII)


def _layer_index(key: str) -> int | None:
    """i of ``model.layers.{i}.*`` (None for any other key or index)."""
    m = _LAYER_KEY.match(key)
    return None if m is None else int(m.group(1))


def deepseek_v3_hf_state_dict(
    sd: dict[str, torch.Tensor], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """lmlab keys -> DeepSeek-V3's: the inverse of :func:`deepseek_v3_state_dict` (a tied LM head
    left out, as ``save_pretrained`` writes it). Raises LmlabError for a key with no place."""
    top = {v: k for k, v in LLAMA_KEYS.items()}
    layer = {v: k for k, v in LAYER_KEYS.items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key in top:
            if not (key == "lm_head.weight" and cfg.tie_embeddings):
                out[top[key]] = value
            continue
        parts = key.split(".")  # layers.{i}.{module...}.{weight|bias}
        module = ".".join(parts[2:-1])
        if parts[0] != "layers" or module not in layer:
            raise LmlabError(f"lmlab weight {key!r} has no DeepSeek-V3 counterpart")
        out[f"model.layers.{parts[1]}.{layer[module]}.{parts[-1]}"] = value
    return out


def deepseek_v3_from(cfg: ModelConfig) -> dict[str, Any]:
    """lmlab config -> DeepseekV3Config kwargs (every layer dense); raises NotRepresentable
    naming every mismatch."""
    a, c = cfg.attention, _Checks("DeepSeek-V3")
    _common_checks(cfg, c, attention="mla")
    c.require(cfg.norm.kind == "rmsnorm", f"model.norm.kind={cfg.norm.kind}")
    c.require(cfg.norm.eps == LATENT_EPS, "model.norm.eps != 1e-6 (HF's latent norms use 1e-6)")
    c.require(cfg.ffn.kind == "swiglu", f"model.ffn.kind={cfg.ffn.kind}")
    c.require(not cfg.ffn.bias, "model.ffn.bias=true")
    c.require(not cfg.block.parallel, "model.block.parallel")
    c.require(a.mask == "causal", f"model.attention.mask={a.mask}")
    c.require(a.out_bias in (None, a.bias), "model.attention.out_bias != bias")
    if a.kind == "mla":
        s = cfg.position.scaling
        mscale = s.kind == "yarn" and s.mscale_all_dim is not None
        c.require(
            bool(a.softmax_mscale) == mscale,  # type: ignore[attr-defined]
            "model.attention.softmax_mscale != (yarn with mscale_all_dim)",
        )
    interleaved = cfg.position.interleaved  # DeepSeek has both layouts (rope_interleave)
    _rope_checks(replace(cfg, position=replace(cfg.position, interleaved=False)), c)
    c.done()
    d = MLADims.of(cfg)
    return {
        **_llama_kwargs(cfg),  # head_dim = r, num_key_value_heads = heads
        "q_lora_rank": d.q_lora_rank or None,
        "kv_lora_rank": d.kv_lora_rank,
        "qk_nope_head_dim": d.nope,
        "qk_rope_head_dim": d.rope,
        "v_head_dim": d.v,
        "first_k_dense_replace": cfg.n_layers,
        "rope_interleave": interleaved,
        "attention_bias": a.bias,
        "hidden_act": "silu",
    }


HF_FAMILIES.register(
    "deepseek_v3",
    "DeepSeek-V3 (dense layers): multi-head latent attention, SwiGLU (DeepSeek-AI 2024).",
)(
    HFFamily(
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        deepseek_v3_model_config,
        deepseek_v3_state_dict,
        deepseek_v3_from,
        deepseek_v3_hf_state_dict,
        check_config=check_deepseek_config,
    )
)
