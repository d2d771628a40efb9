"""Logits processors as pure functions, and sampling. Legend: V vocab; logits are (V,) float.

Order applied by :func:`next_token`: repetition penalty -> temperature -> top-k -> top-p -> sample.
"""

from __future__ import annotations

import torch


def apply_repetition_penalty(
    logits: torch.Tensor, history: torch.Tensor, penalty: float
) -> torch.Tensor:
    """Make tokens already in ``history`` (int64 ids) less likely: positive logits are divided by
    ``penalty``, negative ones multiplied (Keskar et al. 2019, CTRL). penalty 1.0 is a no-op."""
    if penalty == 1.0 or history.numel() == 0:
        return logits
    out = logits.clone()
    seen = torch.unique(history)
    vals = out[seen]
    out[seen] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return out


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits, set the rest to -inf (k <= 0 or >= V: no-op)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[..., -1, None]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering (Holtzman et al. 2020): keep the smallest set of most likely tokens whose
    probability sums to >= p (always at least one); p >= 1 is a no-op."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above each one
    remove_sorted = before >= p
    remove_sorted[..., 0] = False
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def next_token(
    logits: torch.Tensor,
    history: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    generator: torch.Generator | None = None,
) -> int:
    """Pick the next token id from (V,) logits. temperature 0 = greedy (argmax)."""
    logits = apply_repetition_penalty(logits.float(), history, repetition_penalty)
    if temperature == 0.0:
        return int(torch.argmax(logits))
    logits = apply_top_p(apply_top_k(logits / temperature, top_k), top_p)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
