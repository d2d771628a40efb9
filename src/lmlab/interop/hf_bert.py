"""Hugging Face BERT (``BertModel``, ``BertForMaskedLM``) <-> lmlab's encoder: config and
state-dict maps, both directions (Devlin et al. 2019).

BERT is lmlab's ``model.kind=encoder`` with post-norm blocks, learned positions, token-type
embeddings, biased q/k/v/o and MLP, LayerNorm (eps 1e-12) and bidirectional attention. A
``BertModel`` folder (sentence encoders such as all-MiniLM-L6-v2) has a pooler and no MLM head;
a ``BertForMaskedLM`` one the reverse (or both): :func:`fit_bert_config` reads which from the
tensors. Works on plain state dicts, so lmlab never imports ``transformers``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lmlab.config import (
    AttentionConfig,
    BlockConfig,
    FFNConfig,
    ModelConfig,
    NormConfig,
    PositionConfig,
)
from lmlab.errors import LmlabError

# HF hidden_act -> lmlab activation
BERT_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
BERT_ACTIVATIONS["relu"] = "relu"

# Per-layer module names: HF (under encoder.layer.{i}.) -> lmlab (under layers.{i}.)
BERT_LAYER_KEYS = {
    "attention.self.query": "attn.q_proj",
    "attention.self.key": "attn.k_proj",
    "attention.self.value": "attn.v_proj",
    "attention.output.dense": "attn.o_proj",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "ffn.up_proj",
    "output.dense": "ffn.down_proj",
    "output.LayerNorm": "ffn_norm",
}
# Modules outside the layers: HF -> lmlab ("bert." prefix removed, the MLM head under "cls.")
BERT_TOP_KEYS = {
    "embeddings.word_embeddings": "embed",
    "embeddings.position_embeddings": "position",
    "embeddings.token_type_embeddings": "token_type",
    "embeddings.LayerNorm": "embed_norm",
    "pooler.dense": "pooler",
    "cls.predictions.transform.dense": "mlm_dense",
    "cls.predictions.transform.LayerNorm": "mlm_norm",
}
# Buffers and heads lmlab does not keep (position ids; BertForPreTraining's next-sentence head).
BERT_IGNORED = ("embeddings.position_ids", "cls.seq_relationship.")


def bert_model_config(hf: Any) -> ModelConfig:
    """A ``BertConfig`` (or its config.json as attributes) -> ModelConfig(kind="encoder").

    Raises LmlabError for a hidden_act or position_embedding_type lmlab has no component for."""
    act = getattr(hf, "hidden_act", "gelu")
    if act not in BERT_ACTIVATIONS:
        raise LmlabError(
            f"BERT hidden_act {act!r} has no lmlab activation; supported: "
            f"{', '.join(BERT_ACTIVATIONS)}"
        )
    pos = getattr(hf, "position_embedding_type", "absolute") or "absolute"
    if pos != "absolute":
        raise LmlabError(f"BERT position_embedding_type {pos!r} is not supported (only absolute)")
    return ModelConfig(
        kind="encoder",
        vocab_size=hf.vocab_size,
        d_model=hf.hidden_size,
        n_layers=hf.num_hidden_layers,
        max_seq_len=hf.max_position_embeddings,
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        init="normal",
        init_std=float(getattr(hf, "initializer_range", 0.02)),
        type_vocab_size=int(getattr(hf, "type_vocab_size", 2)),
        attention=AttentionConfig(n_heads=hf.num_attention_heads, bias=True, mask="bidirectional"),
        position=PositionConfig(kind="learned"),
        norm=NormConfig(kind="layernorm", eps=float(getattr(hf, "layer_norm_eps", 1e-12))),
        ffn=FFNConfig(
            kind="mlp", d_ff=hf.intermediate_size, activation=BERT_ACTIVATIONS[act], bias=True
        ),
        block=BlockConfig(kind="post"),
    )


def _strip(key: str) -> str:
    return key[len("bert.") :] if key.startswith("bert.") else key


def fit_bert_config(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> ModelConfig:
    """Set ``pooler`` and ``mlm_head`` to what the state dict holds (BertModel: pooler only;
    BertForMaskedLM: MLM head only; a pretraining checkpoint: both)."""
    keys = {_strip(k) for k in sd}
    return dataclasses.replace(
        cfg,
        pooler="pooler.dense.weight" in keys,
        mlm_head="cls.predictions.transform.dense.weight" in keys,
    )


def bert_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF BERT state dict (``bert.``-prefixed or not) -> lmlab EncoderLM state dict.

    With tied embeddings the MLM decoder weight is the token embedding (HF's own copy, if
    present, is dropped). Raises LmlabError naming a key it cannot place."""
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        k = _strip(key)
        if any(k.startswith(p) for p in BERT_IGNORED):
            continue
        module, _, kind = k.rpartition(".")
        if module.startswith("encoder.layer."):
            i, _, rest = module[len("encoder.layer.") :].partition(".")
            if rest not in BERT_LAYER_KEYS:
                raise LmlabError(f"BERT tensor {key!r} has no place in an lmlab model")
            out[f"layers.{i}.{BERT_LAYER_KEYS[rest]}.{kind}"] = value
        elif module in BERT_TOP_KEYS:
            out[f"{BERT_TOP_KEYS[module]}.{kind}"] = value
        elif k == "cls.predictions.bias":
            out["lm_head.bias"] = value
        elif k == "cls.predictions.decoder.weight":
            if not cfg.tie_embeddings:
                out["lm_head.weight"] = value
        elif k == "cls.predictions.decoder.bias":
            continue  # the same tensor as cls.predictions.bias
        else:
            raise LmlabError(f"BERT tensor {key!r} has no place in an lmlab model")
    if cfg.mlm_head and cfg.tie_embeddings and "embed.weight" in out:
        out["lm_head.weight"] = out["embed.weight"]
    return out


def to_hf_bert_state_dict(
    sd: dict[str, torch.Tensor], cfg: ModelConfig, prefix: str = "bert."
) -> dict[str, torch.Tensor]:
    """lmlab EncoderLM state dict -> HF state dict, keys as ``BertForMaskedLM.state_dict()``
    names them (``prefix`` "" for ``BertModel``): the tied decoder weight and the decoder bias
    are written too, as HF's state dict lists them. Raises LmlabError for an lmlab tensor BERT
    has no place for (e.g. a pre-norm model's final norm)."""
    layer_keys = {v: k for k, v in BERT_LAYER_KEYS.items()}
    top_keys = {v: k for k, v in BERT_TOP_KEYS.items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        module, _, kind = key.rpartition(".")
        if module.startswith("layers."):
            i, _, rest = module[len("layers.") :].partition(".")
            if rest not in layer_keys:
                raise LmlabError(f"lmlab tensor {key!r} has no BERT counterpart")
            out[f"{prefix}encoder.layer.{i}.{layer_keys[rest]}.{kind}"] = value
        elif module in top_keys:
            hf = f"{top_keys[module]}.{kind}"
            out[hf if hf.startswith("cls.") else f"{prefix}{hf}"] = value
        elif key == "lm_head.bias":
            out["cls.predictions.bias"] = value
            out["cls.predictions.decoder.bias"] = value
        elif key == "lm_head.weight":
            out["cls.predictions.decoder.weight"] = value
        else:
            raise LmlabError(f"lmlab tensor {key!r} has no BERT counterpart")
    return out
