"""Hugging Face ``transformers`` decoders <-> lmlab: config maps and state-dict key maps.

Works on a config object (attributes as in ``transformers``' ``LlamaConfig`` / ``GPT2Config``) and
a plain state dict, so lmlab itself never imports ``transformers``. Each converter raises
LmlabError for a setting lmlab has no component for, naming it.
"""

from __future__ import annotations

from typing import Any

import torch

from lmlab.config import (
    AttentionConfig,
    BlockConfig,
    FFNConfig,
    ModelConfig,
    NormConfig,
    PositionConfig,
    RopeScalingConfig,
)
from lmlab.errors import LmlabError

# HF rope_type -> lmlab model.position.scaling.kind
HF_ROPE_TYPES = {"default": "none", "linear": "linear", "dynamic": "dynamic_ntk", "yarn": "yarn"}


def rope_position_config(
    hf: Any, default_theta: float = 10000.0, default_partial: float = 1.0
) -> PositionConfig:
    """An HF config's RoPE settings -> ``PositionConfig(kind="rope")`` (half-split layout).

    Reads transformers 5's ``rope_parameters`` dict, else the older ``rope_scaling`` dict with a
    ``rope_theta`` attribute; ``default_theta``/``default_partial`` fill in what neither gives.
    rope_type ``default``/``linear``/``dynamic``/``yarn`` map to scaling ``none``/``linear``/
    ``dynamic_ntk``/``yarn`` with the parameters HF would use (dynamic scales past
    ``max_position_embeddings``; yarn's original length is ``original_max_position_embeddings``).
    Raises LmlabError for any other rope_type (llama3, longrope, ...).
    """
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    hf_type = params.get("rope_type", params.get("type", "default"))
    if hf_type not in HF_ROPE_TYPES:
        raise LmlabError(
            f"RoPE scaling {hf_type!r} has no lmlab component; "
            f"supported: {', '.join(HF_ROPE_TYPES)}"
        )
    theta = params.get("rope_theta") or getattr(hf, "rope_theta", None) or default_theta
    partial = params.get("partial_rotary_factor") or default_partial
    scaling = RopeScalingConfig(kind=HF_ROPE_TYPES[hf_type])
    max_len = hf.max_position_embeddings
    if hf_type in ("linear", "dynamic"):
        scaling.factor = float(params["factor"])
    if hf_type == "dynamic":  # HF rescales past max_position_embeddings itself
        scaling.original_max_seq_len = max_len
    if hf_type == "yarn":  # as transformers' _compute_yarn_parameters reads them
        original = getattr(hf, "original_max_position_embeddings", None)
        original = original or params.get("original_max_position_embeddings") or max_len
        scaling.original_max_seq_len = int(original)
        scaling.factor = float(params.get("factor") or max_len / original)
        scaling.beta_fast = float(params.get("beta_fast") or 32)
        scaling.beta_slow = float(params.get("beta_slow") or 1)
        scaling.truncate = bool(params.get("truncate", True))
        if params.get("attention_factor") is not None:
            scaling.attention_factor = float(params["attention_factor"])
        if params.get("mscale") and params.get("mscale_all_dim"):  # HF ignores one alone
            scaling.mscale = float(params["mscale"])
            scaling.mscale_all_dim = float(params["mscale_all_dim"])
    return PositionConfig(
        kind="rope",
        rope_theta=float(theta),
        partial_rotary_factor=float(partial),
        scaling=scaling,
    )


def llama_model_config(hf: Any) -> ModelConfig:
    """A ``LlamaConfig`` -> ModelConfig (RMSNorm, SwiGLU, RoPE half-split with the scaling of
    :func:`rope_position_config`, GQA, Pre-Norm)."""
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise LmlabError(f"Llama hidden_act {hf.hidden_act!r} is not supported (silu only)")
    position = rope_position_config(hf)
    if position.partial_rotary_factor != 1.0:
        raise LmlabError("Llama rotates every channel: partial_rotary_factor must be 1")
    return ModelConfig(
        vocab_size=hf.vocab_size,
        d_model=hf.hidden_size,
        n_layers=hf.num_hidden_layers,
        max_seq_len=hf.max_position_embeddings,
        tie_embeddings=bool(hf.tie_word_embeddings),
        attention=AttentionConfig(
            n_heads=hf.num_attention_heads,
            n_kv_heads=hf.num_key_value_heads,
            head_dim=getattr(hf, "head_dim", None),
            bias=bool(getattr(hf, "attention_bias", False)),
        ),
        position=position,
        norm=NormConfig(kind="rmsnorm", eps=hf.rms_norm_eps),
        ffn=FFNConfig(
            kind="swiglu",
            d_ff=hf.intermediate_size,
            bias=bool(getattr(hf, "mlp_bias", False)),
        ),
        block=BlockConfig(kind="pre"),
    )


LLAMA_KEYS = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "final_norm.weight",
    "lm_head.weight": "lm_head.weight",
}
LLAMA_LAYER_KEYS = {
    "self_attn.q_proj": "attn.q_proj",
    "self_attn.k_proj": "attn.k_proj",
    "self_attn.v_proj": "attn.v_proj",
    "self_attn.o_proj": "attn.o_proj",
    "mlp.gate_proj": "ffn.gate_proj",
    "mlp.up_proj": "ffn.up_proj",
    "mlp.down_proj": "ffn.down_proj",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def llama_state_dict(
    sd: dict[str, torch.Tensor],
    tied: bool,
    layer_keys: dict[str, str] = LLAMA_LAYER_KEYS,
    family: str = "Llama",
) -> dict[str, torch.Tensor]:
    """Rename a Llama state dict to lmlab's keys (same layout: both use half-split RoPE);
    ``layer_keys`` maps the modules under ``model.layers.{i}`` of a family with Llama's
    top-level names (DeepSeek-V3's attention), ``family`` names it in the error."""
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key in LLAMA_KEYS:
            out[LLAMA_KEYS[key]] = value
            continue
        parts = key.split(".")  # model.layers.{i}.{module...}.{weight|bias}
        if parts[:2] != ["model", "layers"]:
            raise LmlabError(f"{family} weight {key!r} has no place in an lmlab model")
        module = ".".join(parts[3:-1])
        if module not in layer_keys:
            raise LmlabError(f"{family} weight {key!r} has no place in an lmlab model")
        out[f"layers.{parts[2]}.{layer_keys[module]}.{parts[-1]}"] = value
    if tied:
        out["lm_head.weight"] = out["embed.weight"]
    return out


def gpt2_model_config(hf: Any) -> ModelConfig:
    """A ``GPT2Config`` -> ModelConfig (LayerNorm, learned positions, GELU-tanh MLP, biases)."""
    if hf.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise LmlabError(f"GPT-2 activation {hf.activation_function!r} is not supported")
    return ModelConfig(
        vocab_size=hf.vocab_size,
        d_model=hf.n_embd,
        n_layers=hf.n_layer,
        max_seq_len=hf.n_positions,
        # absent or null: GPT-2's default, tied (a distinct stored head still unties it: load.py)
        tie_embeddings=getattr(hf, "tie_word_embeddings", None) is not False,
        attention=AttentionConfig(n_heads=hf.n_head, bias=True),
        position=PositionConfig(kind="learned"),
        norm=NormConfig(kind="layernorm", eps=hf.layer_norm_epsilon, bias=True),
        ffn=FFNConfig(kind="mlp", d_ff=hf.n_inner or 4 * hf.n_embd, activation="gelu_tanh"),
        block=BlockConfig(kind="pre"),
    )


def gpt2_state_dict(
    sd: dict[str, torch.Tensor], d_model: int, tied: bool = True
) -> dict[str, torch.Tensor]:
    """GPT-2 keys -> lmlab's. GPT-2's Conv1D stores (in, out) matrices: transpose them; split the
    fused c_attn (D, 3D) into q, k and v. ``tied`` (config.json's ``tie_word_embeddings``,
    default true): the head is the embedding; untied, the stored ``lm_head.weight`` is kept."""
    head = sd.get("lm_head.weight")
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key.endswith(".attn.bias") or key.endswith(".attn.masked_bias"):
            continue  # causal-mask buffers in older versions
        if key == "transformer.wte.weight":
            out["embed.weight"] = value
        elif key == "transformer.wpe.weight":
            out["position.weight"] = value
        elif key.startswith("transformer.ln_f."):
            out["final_norm." + key.split(".")[-1]] = value
        elif key == "lm_head.weight":
            continue  # tied to wte, or kept below
        elif key.startswith("transformer.h."):
            parts = key.split(".")
            i, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
            prefix = f"layers.{i}."
            if module == "attn.c_attn":
                chunks = value.split(d_model, dim=-1)  # weight (D, 3D), bias (3D,)
                for name, chunk in zip(("q_proj", "k_proj", "v_proj"), chunks, strict=True):
                    out[f"{prefix}attn.{name}.{kind}"] = chunk.t() if kind == "weight" else chunk
            else:
                names = {
                    "attn.c_proj": "attn.o_proj",
                    "mlp.c_fc": "ffn.up_proj",
                    "mlp.c_proj": "ffn.down_proj",
                    "ln_1": "attn_norm",
                    "ln_2": "ffn_norm",
                }
                if module not in names:
                    raise LmlabError(f"GPT-2 weight {key!r} has no place in an lmlab model")
                conv1d = module.startswith(("attn.", "mlp.")) and kind == "weight"
                out[f"{prefix}{names[module]}.{kind}"] = value.t() if conv1d else value
        else:
            raise LmlabError(f"GPT-2 weight {key!r} has no place in an lmlab model")
    out = {k: v.contiguous() for k, v in out.items()}
    if tied:
        out["lm_head.weight"] = out["embed.weight"]
    elif head is not None:  # untied without a stored head: the load names the missing tensor
        out["lm_head.weight"] = head.contiguous()
    return out


GPT2_LAYER_KEYS = {  # GPT-2 module -> lmlab module, besides the fused c_attn
    "attn.c_proj": "attn.o_proj",
    "mlp.c_fc": "ffn.up_proj",
    "mlp.c_proj": "ffn.down_proj",
    "ln_1": "attn_norm",
    "ln_2": "ffn_norm",
}


def gpt2_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """lmlab keys -> ``GPT2LMHeadModel``'s: the inverse of :func:`gpt2_state_dict`.

    q, k and v (D, D) are fused into c_attn as [q; k; v] along the output dim and every Conv1D
    weight is stored transposed, (in, out): c_attn (D, 3D), c_proj (D, D), c_fc (D, F),
    mlp.c_proj (F, D). ``lm_head.weight`` is written (the embedding when tied, else the model's
    own head), as ``GPT2LMHeadModel.state_dict()`` lists it. Raises LmlabError for a weight
    GPT-2 has no place for (a gate projection, grouped-query k/v, ...), naming it, or for a
    missing one.
    """
    if cfg.n_kv_heads != cfg.attention.n_heads:
        raise LmlabError("GPT-2 has no grouped-query attention: n_kv_heads must equal n_heads")
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}  # "i.kind" -> {"q_proj": ...}
    layer_names = {v: k for k, v in GPT2_LAYER_KEYS.items()}
    top = {
        "embed.weight": "transformer.wte.weight",
        "position.weight": "transformer.wpe.weight",
        "final_norm.weight": "transformer.ln_f.weight",
        "final_norm.bias": "transformer.ln_f.bias",
    }
    for key, value in sd.items():
        if key in top:
            out[top[key]] = value
            continue
        if key == "lm_head.weight":
            if not cfg.tie_embeddings:
                out["lm_head.weight"] = value  # an untied head of its own
            continue  # tied: written from the embedding below
        parts = key.split(".")  # layers.{i}.{module...}.{weight|bias}
        i, module, kind = parts[1], ".".join(parts[2:-1]), parts[-1]
        if parts[0] != "layers":
            raise LmlabError(f"lmlab weight {key!r} has no GPT-2 counterpart")
        if module in ("attn.q_proj", "attn.k_proj", "attn.v_proj"):
            fused.setdefault(f"{i}.{kind}", {})[module.split(".")[1]] = value
        elif module in layer_names:
            conv1d = module.startswith(("attn.", "ffn.")) and kind == "weight"
            out[f"transformer.h.{i}.{layer_names[module]}.{kind}"] = value.t() if conv1d else value
        else:
            raise LmlabError(f"lmlab weight {key!r} has no GPT-2 counterpart")
    for name, qkv in fused.items():
        i, kind = name.split(".")
        missing = {"q_proj", "k_proj", "v_proj"} - qkv.keys()
        if missing:
            raise LmlabError(f"layer {i} lacks attn.{sorted(missing)[0]}.{kind}")
        cat = torch.cat([qkv["q_proj"], qkv["k_proj"], qkv["v_proj"]], dim=0)  # (3D, D) / (3D,)
        out[f"transformer.h.{i}.attn.c_attn.{kind}"] = cat.t() if kind == "weight" else cat
    if "transformer.wte.weight" not in out:
        raise LmlabError("the state dict has no embed.weight")
    if cfg.tie_embeddings or "lm_head.weight" not in out:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return {k: v.contiguous() for k, v in out.items()}
