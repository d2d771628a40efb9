"""Hugging Face DiffLlama <-> lmlab: Llama with differential attention (Ye et al. 2024).

DiffLlama is Llama's layout (q/k/v/o, SwiGLU, RMSNorm, half-split RoPE) whose attention is
:class:`lmlab.nn.differential.DifferentialAttention`, in the same head pairing, so its weights
load by Llama's rename plus the four lambda vectors per layer
(``model.layers.{i}.self_attn.lambda_q1`` <-> ``layers.{i}.attn.lambda_q1``, each (hd,)). Works on
config objects with ``DiffLlamaConfig``'s attributes and plain state dicts; lmlab never imports
``transformers`` here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from lmlab.config import ModelConfig
from lmlab.errors import LmlabError
from lmlab.interop.hf import llama_model_config, llama_state_dict
from lmlab.interop.hf_mistral import to_hf_state_dict

LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
_HF_LAMBDAS = [["self_attn", name] for name in LAMBDAS]  # model.layers.{i}.self_attn.{name}
_LMLAB_LAMBDAS = [["attn", name] for name in LAMBDAS]  # layers.{i}.attn.{name}


def diffllama_model_config(hf: Any) -> ModelConfig:
    """A ``DiffLlamaConfig`` -> ModelConfig: Llama's with ``model.attention.kind=differential``.
    Raises LmlabError for ``attention_dropout`` > 0 (DiffLlama itself refuses it)."""
    dropout = getattr(hf, "attention_dropout", 0.0) or 0.0
    if not (isinstance(dropout, int | float) and math.isfinite(dropout) and dropout == 0):
        raise LmlabError(f"DiffLlama attention_dropout must be 0, got {dropout!r:.40}")
    cfg = llama_model_config(hf)
    return dataclasses.replace(
        cfg, attention=dataclasses.replace(cfg.attention, kind="differential")
    )


def diffllama_state_dict(sd: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """A DiffLlama state dict -> lmlab's keys: Llama's rename, the lambda vectors to attn."""
    out: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        parts = key.split(".")  # model.layers.{i}.self_attn.lambda_q1
        if len(parts) == 5 and parts[:2] == ["model", "layers"] and parts[3:] in _HF_LAMBDAS:
            out[f"layers.{parts[2]}.attn.{parts[4]}"] = value
        else:
            rest[key] = value
    out.update(llama_state_dict(rest, tied))
    return out


def diffllama_hf_state_dict(
    sd: dict[str, torch.Tensor], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """lmlab keys -> DiffLlama's: the inverse of :func:`diffllama_state_dict` (a tied LM head
    left out, as ``save_pretrained`` writes it)."""
    out: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        parts = key.split(".")  # layers.{i}.attn.lambda_q1
        if len(parts) == 4 and parts[0] == "layers" and parts[2:] in _LMLAB_LAMBDAS:
            out[f"model.layers.{parts[1]}.self_attn.{parts[3]}"] = value
        else:
            rest[key] = value
    out.update(to_hf_state_dict(rest, cfg.tie_embeddings))
    return out
