"""Hugging Face Mixtral (Jiang et al. 2024) <-> lmlab: config map and state-dict key maps.

Mixtral is Llama/Mistral attention with every FFN replaced by a top-2-of-8 SwiGLU Mixture of
Experts, so the non-MoE weights go through :func:`lmlab.interop.hf.llama_state_dict`.

Expert weights come in two layouts, both read here:
- ``transformers`` 5 in memory (``model.state_dict()``): per layer ``mlp.gate.weight`` (E, D), and
  the experts fused into 3-D parameters ``mlp.experts.gate_up_proj`` (E, 2F, D) (gate rows first,
  then up) and ``mlp.experts.down_proj`` (E, D, F);
- checkpoint files (Mistral's release; ``save_pretrained`` writes it back): per layer
  ``block_sparse_moe.gate.weight`` (E, D) and per expert ``block_sparse_moe.experts.{e}.w1``
  (gate, F x D), ``w3`` (up, F x D), ``w2`` (down, D x F).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lmlab.config import FFNConfig, ModelConfig
from lmlab.errors import LmlabError
from lmlab.interop.hf import LLAMA_KEYS, LLAMA_LAYER_KEYS, llama_state_dict
from lmlab.interop.hf_mistral import mistral_model_config

W_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # checkpoint -> lmlab


def mixtral_model_config(hf: Any) -> ModelConfig:
    """A ``MixtralConfig`` -> ModelConfig: the Llama mapping with ``ffn.kind: moe`` (SwiGLU
    experts, ``topk_softmax`` router, no shared expert, no z-loss, ``router_aux_loss_coef``).

    ``sliding_window`` maps to ``attention.mask: sliding_window`` as for Mistral. Raises
    LmlabError for a non-zero ``router_jitter_noise`` (training-time noise lmlab lacks).
    """
    if getattr(hf, "router_jitter_noise", 0.0):
        raise LmlabError(f"Mixtral router_jitter_noise={hf.router_jitter_noise} is not supported")
    cfg = mistral_model_config(hf)
    ffn = FFNConfig(
        kind="moe",
        d_ff=hf.intermediate_size,
        bias=False,
        n_experts=hf.num_local_experts,
        top_k=hf.num_experts_per_tok,
        router="topk_softmax",
        expert="swiglu",
        shared_expert=False,
        aux_loss_coef=float(hf.router_aux_loss_coef),
        z_loss_coef=0.0,
    )
    return dataclasses.replace(cfg, ffn=ffn)


def mixtral_state_dict(sd: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """Rename a Mixtral state dict (either layout, see the module docstring) to lmlab's keys.

    Router ``gate`` -> ``ffn.router``; expert e's gate/up/down -> ``ffn.experts.{e}.gate_proj``,
    ``up_proj``, ``down_proj``. Raises LmlabError on a key it does not know.
    """
    out: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        parts = key.split(".")  # model.layers.{i}.{mlp|block_sparse_moe}.{gate|experts}...
        is_moe = (
            len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[4] in ("gate", "experts")
        )
        if not (is_moe and parts[3] in ("mlp", "block_sparse_moe")):
            rest[key] = value
            continue
        prefix, sub = f"layers.{parts[2]}.ffn.", parts[4:]
        if sub == ["gate", "weight"]:
            out[prefix + "router.weight"] = value
        elif sub == ["experts", "gate_up_proj"]:  # (E, 2F, D)
            gate, up = value.chunk(2, dim=1)
            for e in range(value.shape[0]):
                out[f"{prefix}experts.{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}experts.{e}.up_proj.weight"] = up[e]
        elif sub == ["experts", "down_proj"]:  # (E, D, F)
            for e in range(value.shape[0]):
                out[f"{prefix}experts.{e}.down_proj.weight"] = value[e]
        elif len(sub) == 4 and sub[2] in W_NAMES and sub[3] == "weight":
            out[f"{prefix}experts.{sub[1]}.{W_NAMES[sub[2]]}.weight"] = value
        else:
            raise LmlabError(f"Mixtral weight {key!r} has no place in an lmlab model")
    out.update(llama_state_dict(rest, tied))
    return {k: v.contiguous() for k, v in out.items()}


def mixtral_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """lmlab -> the ``transformers`` 5 in-memory layout (what ``MixtralForCausalLM``'s
    ``load_state_dict`` takes): the inverse of :func:`mixtral_state_dict`. ``lm_head.weight`` is
    always written (the embedding when tied), as Hugging Face's state dict lists it."""
    names = {v: k for k, v in LLAMA_LAYER_KEYS.items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key in LLAMA_KEYS.values():
            out[next(k for k, v in LLAMA_KEYS.items() if v == key)] = value
            continue
        parts = key.split(".")  # layers.{i}.{module...}.weight
        module = ".".join(parts[2:-1])
        if module in names:
            out[f"model.layers.{parts[1]}.{names[module]}.{parts[-1]}"] = value
        elif module != "ffn.router" and not module.startswith("ffn.experts."):
            raise LmlabError(f"lmlab weight {key!r} has no Mixtral counterpart")
    for i in range(cfg.n_layers):
        pre, hf = f"layers.{i}.ffn.", f"model.layers.{i}.mlp."
        experts = range(cfg.ffn.n_experts)
        out[hf + "gate.weight"] = sd[pre + "router.weight"]
        gate = torch.stack([sd[f"{pre}experts.{e}.gate_proj.weight"] for e in experts])
        up = torch.stack([sd[f"{pre}experts.{e}.up_proj.weight"] for e in experts])
        out[hf + "experts.gate_up_proj"] = torch.cat([gate, up], dim=1)  # (E, 2F, D)
        out[hf + "experts.down_proj"] = torch.stack(
            [sd[f"{pre}experts.{e}.down_proj.weight"] for e in experts]
        )  # (E, D, F)
    out["lm_head.weight"] = sd["lm_head.weight"]
    return out


def mixtral_checkpoint_state_dict(
    sd: dict[str, torch.Tensor], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """lmlab -> the checkpoint-file layout (Mistral's release, what ``save_pretrained`` writes):
    router -> ``block_sparse_moe.gate.weight`` (E, D); expert e's gate/up/down ->
    ``block_sparse_moe.experts.{e}.w1`` (F, D) / ``w3`` (F, D) / ``w2`` (D, F); the rest as
    Llama. ``lm_head.weight`` is always written. Raises LmlabError for a weight with no place."""
    lmlab_to_w = {v: k for k, v in W_NAMES.items()}
    names = {v: k for k, v in LLAMA_LAYER_KEYS.items()}
    top = {v: k for k, v in LLAMA_KEYS.items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key in top:
            out[top[key]] = value
            continue
        parts = key.split(".")  # layers.{i}.{module...}.weight
        module = ".".join(parts[2:-1])
        moe = f"model.layers.{parts[1]}.block_sparse_moe."
        if module in names:
            out[f"model.layers.{parts[1]}.{names[module]}.{parts[-1]}"] = value
        elif module == "ffn.router":
            out[moe + "gate.weight"] = value
        elif module.startswith("ffn.experts.") and len(parts) == 7 and parts[5] in lmlab_to_w:
            out[f"{moe}experts.{parts[4]}.{lmlab_to_w[parts[5]]}.weight"] = value
        else:
            raise LmlabError(f"lmlab weight {key!r} has no Mixtral counterpart")
    if cfg.tie_embeddings and "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
