"""Micro-batches with unequal target counts, for the gradient-accumulation tests.

:func:`uneven_targets` masks (-100) the first ``input_ids[r, 0] % T`` targets of each row r: a
function of the batch's content alone, so a micro-batch masks the same way whether it is drawn
alone or as part of a bigger batch. :func:`patch_uneven_clm` installs it on the CLM objective;
with ``parts`` > 1 each train batch of ``parts * b`` rows is the concatenation of the ``parts``
micro-batches of b rows a run with ``grad_accum_steps = parts`` (or ``parts`` ranks) draws.
"""

from __future__ import annotations

from typing import Any

import torch

from lmlab.training import loop
from lmlab.training.objectives import CausalLM


def uneven_targets(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """input_ids, targets (B, T) -> the same with targets[r, :input_ids[r, 0] % T] = -100."""
    x, y = batch["input_ids"], batch["targets"].clone()
    t = y.shape[1]
    cut = x[:, 0] % t  # (B,) 0 .. T-1: every row keeps at least one target
    y[torch.arange(t)[None, :] < cut[:, None]] = -100
    return {**batch, "targets": y}


def patch_uneven_clm(setattr_: Any, parts: int = 1) -> None:
    """Install uneven targets on CausalLM.batch via ``setattr_(obj, name, value)`` (pytest's
    monkeypatch.setattr, or plain setattr in a worker)."""
    orig_rng, orig_batch = loop.batch_rng, CausalLM.batch

    def keyed_rng(seed: int, step: int, micro: int, rank: int = 0, stream: int = 0) -> Any:
        if stream != 0:
            return orig_rng(seed, step, micro, rank, stream)
        return ("train", seed, step, micro)

    def batch(self: CausalLM, split: str, batch_size: int, rng: Any) -> dict[str, torch.Tensor]:
        if not isinstance(rng, tuple):  # evaluation: its own generators
            return uneven_targets(orig_batch(self, split, batch_size, rng))
        _, seed, step, micro = rng
        b = batch_size // parts
        pieces = [
            uneven_targets(orig_batch(self, split, b, orig_rng(seed, step, micro * parts + j)))
            for j in range(parts)
        ]
        return {k: torch.cat([p[k] for p in pieces]) for k in pieces[0]}

    setattr_(loop, "batch_rng", keyed_rng)
    setattr_(CausalLM, "batch", batch)
