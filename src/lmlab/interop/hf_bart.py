"""Hugging Face BART (``BartForConditionalGeneration``) <-> lmlab: config map and state-dict maps.

BART (Lewis et al. 2020): Post-Norm blocks with LayerNorm, biases on every projection, learned
positions whose table keeps 2 unused rows before position 0 (``position.offset: 2``), a
LayerNorm on the embeddings (``layernorm_embedding``), optional sqrt(d_model) embedding scaling,
a GELU MLP, no final norm, a tied LM head plus a fixed ``final_logits_bias``. Works on a config
object with ``BartConfig``'s attributes and a plain state dict (lmlab never imports
``transformers``).
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
    Seq2SeqConfig,
)
from lmlab.errors import LmlabError
from lmlab.interop.hf_seq2seq import KeyTable, rename, single_id

BART_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}


def bart_model_config(hf: Any) -> ModelConfig:
    """A ``BartConfig`` (or a config.json namespace) -> ModelConfig (model.kind=encoder_decoder).

    The encoder and decoder must share head count and FFN width (lmlab has one of each); LayerNorm
    eps is PyTorch's default 1e-5, as BART uses. Raises LmlabError otherwise, or for an
    activation lmlab lacks.
    """
    for a, b in (
        ("encoder_attention_heads", "decoder_attention_heads"),
        ("encoder_ffn_dim", "decoder_ffn_dim"),
    ):
        if getattr(hf, a) != getattr(hf, b):
            raise LmlabError(f"BART {a} != {b}: lmlab's encoder and decoder share these")
    act = str(getattr(hf, "activation_function", "gelu"))
    if act not in BART_ACTIVATIONS:
        raise LmlabError(
            f"BART activation_function {act!r} is not supported; supported: "
            f"{', '.join(BART_ACTIVATIONS)}"
        )
    return ModelConfig(
        kind="encoder_decoder",
        vocab_size=hf.vocab_size,
        d_model=hf.d_model,
        n_layers=hf.encoder_layers,
        max_seq_len=hf.max_position_embeddings,
        dropout=float(getattr(hf, "dropout", 0.1)),
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        final_norm=False,
        init="normal",
        attention=AttentionConfig(
            n_heads=hf.encoder_attention_heads,
            bias=True,
            dropout=float(getattr(hf, "attention_dropout", 0.0)),
        ),
        position=PositionConfig(kind="learned", offset=2),
        norm=NormConfig(kind="layernorm", eps=1e-5, bias=True),
        ffn=FFNConfig(
            kind="mlp", d_ff=hf.encoder_ffn_dim, activation=BART_ACTIVATIONS[act], bias=True
        ),
        block=BlockConfig(kind="post"),
        seq2seq=Seq2SeqConfig(
            n_decoder_layers=hf.decoder_layers,
            pad_token_id=single_id(getattr(hf, "pad_token_id", 1), "pad_token_id"),
            decoder_start_token_id=single_id(
                getattr(hf, "decoder_start_token_id", 2), "decoder_start_token_id"
            ),
            eos_token_id=single_id(getattr(hf, "eos_token_id", 2), "eos_token_id"),
            scale_embedding=bool(getattr(hf, "scale_embedding", False)),
            embed_norm=True,
            final_logits_bias=True,
        ),
    )


def _bart_table() -> KeyTable:
    proj = [
        ("q_proj", "q_proj"),
        ("k_proj", "k_proj"),
        ("v_proj", "v_proj"),
        ("out_proj", "o_proj"),
    ]
    layer = [
        ("self_attn_layer_norm", "attn_norm"),
        ("fc1", "ffn.up_proj"),
        ("fc2", "ffn.down_proj"),
        ("final_layer_norm", "ffn_norm"),
        ("encoder_attn_layer_norm", "cross_norm"),
    ]
    layer += [(f"self_attn.{a}", f"attn.{b}") for a, b in proj]
    layer += [(f"encoder_attn.{a}", f"cross_attn.{b}") for a, b in proj]
    table: KeyTable = [
        ("model.shared.weight", "embed.weight"),
        ("lm_head.weight", "lm_head.weight"),
        ("final_logits_bias", "final_logits_bias"),
    ]
    for stack in ("encoder", "decoder"):
        table.append((f"model.{stack}.embed_positions.weight", f"{stack}.position.weight"))
        for kind in ("weight", "bias"):
            table.append(
                (f"model.{stack}.layernorm_embedding.{kind}", f"{stack}.embed_norm.{kind}")
            )
            for a, b in layer:
                if stack == "encoder" and "encoder_attn" in a:
                    continue
                table.append(
                    (f"model.{stack}.layers.{{i}}.{a}.{kind}", f"{stack}.layers.{{i}}.{b}.{kind}")
                )
    return table


BART_SKIPPED = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")


def bart_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``BartForConditionalGeneration`` keys -> lmlab's (same layouts, renamed); the stacks'
    ``embed_tokens`` (copies of ``shared``) are dropped, a tied ``lm_head`` is the embedding.
    Raises LmlabError for an unexpected key."""
    kept = {k: v for k, v in sd.items() if k not in BART_SKIPPED}
    out = rename(kept, _bart_table(), reverse=False, family="BART")
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["embed.weight"]
    return out


def bart_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """lmlab keys -> ``BartForConditionalGeneration``'s: the inverse of :func:`bart_state_dict`
    (``shared``, both ``embed_tokens`` and ``lm_head`` written, as its ``state_dict()`` lists
    them). Raises LmlabError for a weight BART has no place for, naming it."""
    out = rename(sd, _bart_table(), reverse=True, family="BART")
    if "model.shared.weight" not in out:
        raise LmlabError("the state dict has no embed.weight")
    for stack in ("encoder", "decoder"):
        out[f"model.{stack}.embed_tokens.weight"] = out["model.shared.weight"]
    out.setdefault("lm_head.weight", out["model.shared.weight"])
    return out
