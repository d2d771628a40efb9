"""The validation loss a run logs: :func:`estimate_loss` over fixed batches of the val split."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from lmlab.config import RunConfig
from lmlab.data.dataset import batch_rng
from lmlab.training.distributed import Parallel
from lmlab.training.hardware import autocast
from lmlab.training.objectives import CausalLM, Objective


def _batch_loss(
    model: Callable[..., Any], batch: dict[str, torch.Tensor], dev: torch.device, precision: str
) -> torch.Tensor:
    with autocast(dev, precision):
        return model(**{k: v.to(dev) for k, v in batch.items()}).loss


@torch.no_grad()
def estimate_loss(
    model: nn.Module,
    tokens: np.ndarray,
    cfg: RunConfig,
    dev: torch.device,
    seq_len: int,
    par: Parallel | None = None,
    objective: Objective | None = None,
) -> float:
    """Mean loss (nats/token) over ``train.eval_batches`` random batches of ``objective``'s
    ``val`` split (default: next-token windows of ``tokens``); the same batches at every call
    (a fixed generator), so successive values compare. Collective under ``par``:
    rank r scores batches r, r + W, ...; every rank runs the same number of forward passes (FSDP
    gathers weights in each), the last padded with an uncounted repeat."""
    rank, world = (par.rank, par.world_size) if par is not None else (0, 1)
    n = cfg.train.eval_batches
    if objective is None:
        objective = CausalLM(cfg, None, {"val": tokens}, seq_len)  # type: ignore[arg-type]
    was_training = model.training
    model.eval()
    losses = []
    for i in range(rank, -(-n // world) * world, world):
        rng = batch_rng(cfg.train.seed, 0, min(i, n - 1), stream=1)
        batch = objective.batch("val", cfg.train.batch_size, rng)
        loss = float(_batch_loss(model, batch, dev, cfg.train.precision))
        if i < n:
            losses.append(loss)
    model.train(was_training)
    total = float(np.sum(losses)) if losses else 0.0
    return (par.sum([total])[0] if par is not None else total) / n
