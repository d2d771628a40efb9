"""Hugging Face Mistral, Qwen2 and Qwen3 -> lmlab: config maps and state-dict key maps.

All three are Llama with attention changes, so each converter starts from
:func:`lmlab.interop.hf.llama_model_config` / :func:`~lmlab.interop.hf.llama_state_dict` and
adds what differs:

- Mistral (Jiang et al. 2023): sliding-window attention (``sliding_window``: a query sees itself
  and the window - 1 tokens before it);
- Qwen2 (Yang et al. 2024): bias on q/k/v, none on o; optional sliding window;
- Qwen3 (Yang et al. 2025): QK-norm (RMSNorm over each head of q and k), ``attention_bias`` on
  all four projections.

Works on config objects with the attributes of ``transformers``' ``MistralConfig`` /
``Qwen2Config`` / ``Qwen3Config`` and on plain state dicts, so lmlab never imports
``transformers``. A setting lmlab has no component for raises LmlabError naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lmlab.config import ModelConfig
from lmlab.errors import LmlabError
from lmlab.interop.hf import LLAMA_KEYS, LLAMA_LAYER_KEYS, llama_model_config, llama_state_dict


def _window_attention(cfg: ModelConfig, window: int | None) -> ModelConfig:
    """cfg with a sliding-window mask of ``window`` tokens, or causal when the window is None or
    wider than the context (identical on every sequence the model accepts)."""
    if window is None or window > cfg.max_seq_len:
        return cfg
    attention = dataclasses.replace(cfg.attention, mask="sliding_window", window=int(window))
    return dataclasses.replace(cfg, attention=attention)


def _qwen_window(hf: Any) -> int | None:
    """The one window every layer uses (None: all layers full attention). Raises LmlabError when
    Qwen's ``layer_types`` mixes sliding and full layers (lmlab has one mask for all layers)."""
    window = getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", 0) else None
    kinds = set(getattr(hf, "layer_types", None) or [])
    if window is None or kinds == {"full_attention"}:
        return None
    if kinds - {"sliding_attention"}:
        raise LmlabError(
            f"layer_types mixes {sorted(kinds)}: lmlab uses one attention mask for every layer "
            "(set max_window_layers to 0 or use_sliding_window to false)"
        )
    return int(window)


def mistral_model_config(hf: Any) -> ModelConfig:
    """A ``MistralConfig`` -> ModelConfig: Llama's, plus ``sliding_window`` as
    model.attention.mask=sliding_window (causal when it is None or wider than the context)."""
    return _window_attention(llama_model_config(hf), getattr(hf, "sliding_window", None))


def qwen2_model_config(hf: Any) -> ModelConfig:
    """A ``Qwen2Config`` -> ModelConfig: Llama's with bias on q/k/v and none on o."""
    cfg = llama_model_config(hf)
    attention = dataclasses.replace(cfg.attention, bias=True, out_bias=False)
    return _window_attention(dataclasses.replace(cfg, attention=attention), _qwen_window(hf))


def qwen3_model_config(hf: Any) -> ModelConfig:
    """A ``Qwen3Config`` -> ModelConfig: Llama's with QK-norm (``attention_bias`` on all four
    projections, as Llama)."""
    cfg = llama_model_config(hf)
    attention = dataclasses.replace(cfg.attention, qk_norm=True)
    return _window_attention(dataclasses.replace(cfg, attention=attention), _qwen_window(hf))


QK_NORM_KEYS = {"self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm"}


def hf_state_dict(sd: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """A Mistral / Qwen2 / Qwen3 state dict -> lmlab's keys (the Llama layout; Qwen2's q/k/v
    biases follow their weights; Qwen3's q_norm/k_norm map to attn.q_norm/k_norm)."""
    rest: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        parts = key.split(".")  # model.layers.{i}.{module...}.weight
        module = ".".join(parts[3:-1])
        if parts[:2] == ["model", "layers"] and module in QK_NORM_KEYS:
            out[f"layers.{parts[2]}.{QK_NORM_KEYS[module]}.{parts[-1]}"] = value
        else:
            rest[key] = value
    out.update(llama_state_dict(rest, tied))
    return out


def to_hf_state_dict(sd: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """lmlab keys -> Mistral / Qwen2 / Qwen3 keys: the inverse of :func:`hf_state_dict`.
    With ``tied`` the LM head (the embedding matrix) is left out, as Hugging Face stores it."""
    top = {v: k for k, v in LLAMA_KEYS.items()}
    layer = {v: k for k, v in {**LLAMA_LAYER_KEYS, **QK_NORM_KEYS}.items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key in top:
            if not (tied and key == "lm_head.weight"):
                out[top[key]] = value
            continue
        parts = key.split(".")  # layers.{i}.{module...}.{weight|bias}
        module = ".".join(parts[2:-1])
        if parts[0] != "layers" or module not in layer:
            raise LmlabError(f"lmlab weight {key!r} has no Mistral/Qwen counterpart")
        out[f"model.layers.{parts[1]}.{layer[module]}.{parts[-1]}"] = value
    return out
