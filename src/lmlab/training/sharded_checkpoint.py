"""Checkpoints of FSDP2 runs: the shards gathered into the one checkpoint format lmlab has.

An FSDP2 run's checkpoint folder ``RUN/checkpoints/step-NNNNNN/`` is the same as any other
run's (:mod:`.checkpoint`):

| path | what |
|---|---|
| ``model.safetensors`` | the whole model, gathered from every rank's shards |
| ``optimizer.safetensors`` | the whole AdamW state, ``<param name>::step/exp_avg/exp_avg_sq`` |
| ``trainer_state.json`` | step, tokens, losses, world size and micro-batches per rank |

Saving is collective: every rank takes part in gathering each parameter and each optimizer
tensor (``DTensor.full_tensor``, one tensor at a time, in the same order on every rank); rank 0
alone keeps the whole tensors, on the CPU, and writes them with
:func:`~lmlab.training.checkpoint.save_checkpoint` (atomic, published through ``latest``).
Loading needs no communication: every rank reads the whole files, checks them against its model
and keeps its own shards (:func:`~lmlab.training.checkpoint.load_checkpoint`, which cuts each
tensor with ``distribute_tensor`` under the parameter's mesh and placements). So a checkpoint
written by W ranks loads into any number of ranks, into one plain process and into a DDP run,
and the other way round.

Nothing in the format is a pickle. Earlier lmlab versions wrote torch.distributed.checkpoint
(DCP) shards: ``sharded/`` (whose ``.metadata`` is a pickle) and a ``manifest.json`` of SHA-256
sums, which protects nothing, since whoever crafts the folder recomputes it. lmlab never opens
either file: resuming such a checkpoint is refused
(:func:`~lmlab.training.checkpoint.load_optimizer`); ``lmlab eval`` / ``generate`` read only its
``model.safetensors``.

Memory: while saving, rank 0 holds one whole copy of the model and of the AdamW state in CPU
memory (3 x the parameter bytes in float32) and every rank holds one whole tensor at a time;
small at the scale lmlab trains (one machine, or a few).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lmlab.config import ModelConfig
from lmlab.training.checkpoint import (
    checkpoint_name,
    load_optimizer_tensors,
    optimizer_tensors,
    save_checkpoint,
    whole_tensor,
)


def is_sharded_model(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (FSDP2 ``fully_shard`` applied)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _gathered_model(model: nn.Module, model_cfg: ModelConfig, main: bool) -> nn.Module | None:
    """The whole model on the CPU on the main rank (None elsewhere): every tensor of the FSDP2
    model's state dict gathered into a plain model of the same config. Collective: call on every
    rank. A plain (unsharded) model is returned as it is."""
    if not is_sharded_model(model):
        return model if main else None
    full: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():  # the same order on every rank
        whole = whole_tensor(t)
        if main:
            full[name] = whole.detach().cpu()
        del whole
    if not main:
        return None
    from lmlab.models.build import build_model

    with torch.device("meta"):
        plain = build_model(model_cfg)
    names: dict[int, list[str]] = {}  # tied weights: one parameter under several names
    for name, p in plain.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    plain.to_empty(device="cpu")  # new storage per module: re-tie below
    for first, *aliases in names.values():
        for alias in aliases:
            owner, _, attr = alias.rpartition(".")
            setattr(plain.get_submodule(owner), attr, plain.get_parameter(first))
    plain.load_state_dict(full)
    return plain


def save_sharded_checkpoint(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep: int,
    model_cfg: ModelConfig,
) -> Path:
    """Gather an FSDP2 model and its optimizer state and write checkpoint ``step`` in the
    ordinary format (module docstring), atomically, point ``latest`` at it and keep the newest
    ``keep``. Collective: every rank calls it; rank 0 writes (the run folder must be on a
    filesystem rank 0 sees; the others read it on resume). Returns the checkpoint folder."""
    distributed = dist.is_available() and dist.is_initialized()
    main = not distributed or dist.get_rank() == 0
    plain = _gathered_model(model, model_cfg, main)
    moments = optimizer_tensors(optimizer, model)  # collective for DTensor state
    final = Path(run_dir) / "checkpoints" / checkpoint_name(step)
    if main:
        assert plain is not None
        plain_optimizer = torch.optim.AdamW(plain.parameters())  # only carries the state
        load_optimizer_tensors(plain_optimizer, plain, moments, "the gathered optimizer state")
        final = save_checkpoint(run_dir, step, plain, plain_optimizer, state, keep)
    return final
