"""Hugging Face GPT-NeoX (Pythia, GPT-NeoX-20B) <-> lmlab: config map and state-dict key maps.

Works on a config object with ``GPTNeoXConfig``'s attributes (transformers 5 keeps the rotary
settings in ``rope_parameters``; older configs have ``rotary_pct`` and ``rotary_emb_base``) and a
plain state dict, so lmlab itself never imports ``transformers``.
"""

from __future__ import annotations

from typing import Any

import torch

from lmlab.config import AttentionConfig, BlockConfig, FFNConfig, ModelConfig, NormConfig
from lmlab.errors import LmlabError
from lmlab.interop.hf import rope_position_config

NEOX_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
}


def neox_model_config(hf: Any) -> ModelConfig:
    """A ``GPTNeoXConfig`` -> ModelConfig: LayerNorm with bias, partial half-split RoPE
    (``rotary_pct`` / ``partial_rotary_factor``), GELU MLP with bias, attention bias
    (``attention_bias``), untied LM head unless ``tie_word_embeddings``, Pre-Norm.

    ``use_parallel_residual`` (HF's default, used by Pythia and NeoX-20B: x + attn(ln1(x)) +
    mlp(ln2(x))) maps to ``block.parallel``. Raises LmlabError for an activation lmlab lacks.
    """
    act = getattr(hf, "hidden_act", "gelu")
    if act not in NEOX_ACTIVATIONS:
        raise LmlabError(
            f"GPT-NeoX hidden_act {act!r} is not supported; "
            f"supported: {', '.join(NEOX_ACTIVATIONS)}"
        )
    position = rope_position_config(
        hf,
        default_theta=getattr(hf, "rotary_emb_base", 10000.0),
        default_partial=getattr(hf, "rotary_pct", 1.0),
    )
    return ModelConfig(
        vocab_size=hf.vocab_size,
        d_model=hf.hidden_size,
        n_layers=hf.num_hidden_layers,
        max_seq_len=hf.max_position_embeddings,
        dropout=float(getattr(hf, "hidden_dropout", 0.0)),
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention=AttentionConfig(
            n_heads=hf.num_attention_heads,
            bias=bool(getattr(hf, "attention_bias", True)),
            dropout=float(getattr(hf, "attention_dropout", 0.0)),
        ),
        position=position,
        norm=NormConfig(kind="layernorm", eps=hf.layer_norm_eps, bias=True),
        ffn=FFNConfig(
            kind="mlp", d_ff=hf.intermediate_size, activation=NEOX_ACTIVATIONS[act], bias=True
        ),
        block=BlockConfig(kind="pre", parallel=bool(getattr(hf, "use_parallel_residual", True))),
    )


NEOX_LAYER_KEYS = {
    "attention.dense": "attn.o_proj",
    "mlp.dense_h_to_4h": "ffn.up_proj",
    "mlp.dense_4h_to_h": "ffn.down_proj",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
NEOX_BUFFERS = ("attention.bias", "attention.masked_bias", "attention.rotary_emb.inv_freq")


def split_neox_qkv(value: torch.Tensor, n_heads: int) -> tuple[torch.Tensor, ...]:
    """Fused ``query_key_value`` weight (3D, D) or bias (3D,) -> q, k, v each (D, D) or (D,).

    HF reshapes the projection to (..., H, 3 * hd) and chunks the last dim, so the output rows
    are laid out per head as [q_h; k_h; v_h] (not [q; k; v])."""
    per_head = value.reshape(n_heads, 3, -1, *value.shape[1:])  # (H, 3, hd[, D])
    return tuple(per_head[:, j].reshape(-1, *value.shape[1:]) for j in range(3))


def neox_state_dict(
    sd: dict[str, torch.Tensor], n_heads: int, tied: bool = False
) -> dict[str, torch.Tensor]:
    """GPT-NeoX keys -> lmlab's: split the per-head fused QKV; ``embed_out`` (older name) or
    ``lm_head`` -> lm_head; drop the mask / inv_freq buffers older checkpoints carry."""
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key == "gpt_neox.embed_in.weight":
            out["embed.weight"] = value
        elif key.startswith("gpt_neox.final_layer_norm."):
            out["final_norm." + key.split(".")[-1]] = value
        elif key in ("lm_head.weight", "embed_out.weight"):
            out["lm_head.weight"] = value
        elif key.startswith("gpt_neox.layers."):
            parts = key.split(".")  # gpt_neox.layers.{i}.{module...}.{weight|bias}
            i, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
            if f"{module}.{kind}" in NEOX_BUFFERS:
                continue
            if module == "attention.query_key_value":
                for name, part in zip(
                    ("q_proj", "k_proj", "v_proj"), split_neox_qkv(value, n_heads), strict=True
                ):
                    out[f"layers.{i}.attn.{name}.{kind}"] = part.contiguous()
            elif module in NEOX_LAYER_KEYS:
                out[f"layers.{i}.{NEOX_LAYER_KEYS[module]}.{kind}"] = value
            else:
                raise LmlabError(f"GPT-NeoX weight {key!r} has no place in an lmlab model")
        else:
            raise LmlabError(f"GPT-NeoX weight {key!r} has no place in an lmlab model")
    if tied:
        out["lm_head.weight"] = out["embed.weight"]
    return out


def fuse_neox_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q, k, v weights (D, D) or biases (D,) -> the fused ``query_key_value`` (3D, D) or (3D,),
    laid out per head as [q_h; k_h; v_h]: the inverse of :func:`split_neox_qkv`."""
    per_head = torch.stack(
        [t.reshape(n_heads, -1, *t.shape[1:]) for t in (q, k, v)], dim=1
    )  # (H, 3, hd[, D])
    return per_head.reshape(-1, *q.shape[1:])


def neox_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """lmlab keys -> ``GPTNeoXForCausalLM``'s: the inverse of :func:`neox_state_dict`.

    q, k and v are fused per head into ``query_key_value`` (:func:`fuse_neox_qkv`);
    ``lm_head.weight`` is always written (the embedding when tied), as the model's
    ``state_dict()`` lists it. Raises LmlabError for grouped-query attention (GPT-NeoX has one
    k/v head per query head) and for a weight GPT-NeoX has no place for, naming it.
    """
    n_heads = cfg.attention.n_heads
    if cfg.n_kv_heads != n_heads:
        raise LmlabError("GPT-NeoX has no grouped-query attention: n_kv_heads must equal n_heads")
    names = {v: k for k, v in NEOX_LAYER_KEYS.items()}
    out: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}  # "i.kind" -> {"q_proj": ...}
    for key, value in sd.items():
        parts = key.split(".")  # layers.{i}.{module...}.{weight|bias}
        module = ".".join(parts[2:-1])
        if key == "embed.weight":
            out["gpt_neox.embed_in.weight"] = value
        elif key in ("final_norm.weight", "final_norm.bias"):
            out["gpt_neox.final_layer_norm." + parts[-1]] = value
        elif key == "lm_head.weight":
            out["lm_head.weight"] = value
        elif parts[0] == "layers" and module in ("attn.q_proj", "attn.k_proj", "attn.v_proj"):
            qkv.setdefault(f"{parts[1]}.{parts[-1]}", {})[module.split(".")[1]] = value
        elif parts[0] == "layers" and module in names:
            out[f"gpt_neox.layers.{parts[1]}.{names[module]}.{parts[-1]}"] = value
        else:
            raise LmlabError(f"lmlab weight {key!r} has no GPT-NeoX counterpart")
    for name, parts_qkv in qkv.items():
        i, kind = name.split(".")
        missing = {"q_proj", "k_proj", "v_proj"} - parts_qkv.keys()
        if missing:
            raise LmlabError(f"layer {i} lacks attn.{sorted(missing)[0]}.{kind}")
        out[f"gpt_neox.layers.{i}.attention.query_key_value.{kind}"] = fuse_neox_qkv(
            parts_qkv["q_proj"], parts_qkv["k_proj"], parts_qkv["v_proj"], n_heads
        )
    if "lm_head.weight" not in out:
        raise LmlabError("the state dict has no lm_head.weight")
    return out
