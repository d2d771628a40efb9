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
    """Learning rate for optimizer step ``step`` (0-based) of a run with D = ``lr_decay_steps``
    (default ``max_steps``) decay steps and W = ``warmup_steps``.

    Linear warmup lr * (s + 1) / W for s < W, so step W - 1 is the one step at the peak ``lr``
    (step 0 when W = 0); then a cosine from the peak down to ``min_lr``, reached exactly at the
    last step D - 1; ``min_lr`` after it (an extended run). When W >= D the warmup fills the run
    and ``min_lr`` follows it.
    """
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    peak = max(cfg.warmup_steps - 1, 0)  # the step at full lr
    last = decay_steps - 1  # the step at min_lr
    if step >= last:
        return cfg.min_lr
    progress = (step - peak) / (last - peak)  # 0 at the peak, 1 at the last step
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
