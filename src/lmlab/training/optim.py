"""AdamW with decoupled weight decay on matrices only, and the warmup + cosine LR schedule."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lmlab.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups: weight decay on the 2-D weights of linear layers; none on norms, biases
    and embeddings (token embeddings, a tied LM head, learned positions)."""
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim >= 2 and id(p) not in embedding_ids and not name.startswith("position."):
            decay.append(p)
        else:
            no_decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter 2019) over :func:`param_groups`; the fused kernel when the
    parameters' device supports it."""
    groups = param_groups(model, cfg.weight_decay)
    kwargs: dict[str, Any] = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": 1e-8}
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, **kwargs)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup from lr/warmup_steps to
    lr over ``warmup_steps``, cosine decay to ``min_lr`` at ``lr_decay_steps``, then ``min_lr``."""
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if step >= decay_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / max(1, decay_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
