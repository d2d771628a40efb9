"""Logits processors as pure functions, and sampling. Legend: V vocab; logits are (V,) float.

Order applied by :func:`next_token`: repetition penalty -> temperature -> top-k -> top-p -> sample.
Every value is checked by :func:`check_sampling` (the one place; :class:`SamplingParams
<lmlab.generation.generate.SamplingParams>` and each function here call it): a negative
temperature, a top-p outside (0, 1], a negative top-k, a repetition penalty <= 0 or a value that
is not a finite number raise LmlabError. A top-k above the vocabulary keeps every token. No
value yields NaN probabilities: a temperature so small that logits / temperature overflows acts
as greedy (its limit), and a penalised logit saturates at the dtype's largest finite value.
"""

from __future__ import annotations

import math
import numbers

import torch

from lmlab.errors import LmlabError

_FLOAT32_MAX = torch.finfo(torch.float32).max


def _finite_number(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise LmlabError(f"{name} must be a finite number, got {value}")
    return float(value)


def check_temperature(temperature: float) -> None:
    """LmlabError unless ``temperature`` is a number in [0, float32's largest] (0 = greedy; a
    larger one is inf once the logits divide by it in float32: every logit 0, uniform sampling,
    what ``inf`` would mean and is refused for)."""
    t = _finite_number(temperature, "--temperature")
    if t < 0:
        raise LmlabError(f"--temperature must be >= 0, got {temperature}")
    if t > _FLOAT32_MAX:
        raise LmlabError(
            f"--temperature must be at most {_FLOAT32_MAX:.4g} (float32's largest number), got "
            f"{temperature}"
        )


def check_top_k(top_k: int) -> None:
    """LmlabError unless ``top_k`` is an integer >= 0 (0 = off; above the vocabulary: all)."""
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise LmlabError(f"--top-k must be an integer, got {top_k!r}")
    if top_k < 0:
        raise LmlabError(f"--top-k must be >= 0, got {top_k}")


def check_top_p(top_p: float) -> None:
    """LmlabError unless ``top_p`` is in (0, 1] (1 = off)."""
    if not 0.0 < _finite_number(top_p, "--top-p") <= 1.0:
        raise LmlabError(f"--top-p must be in (0, 1], got {top_p}")


def check_repetition_penalty(penalty: float) -> None:
    """LmlabError unless ``penalty`` is a finite number > 0 (1 = off)."""
    if _finite_number(penalty, "--repetition-penalty") <= 0:
        raise LmlabError(f"--repetition-penalty must be > 0, got {penalty}")


def check_sampling(
    temperature: float, top_k: int, top_p: float, repetition_penalty: float = 1.0
) -> None:
    """The sampling values' one check: LmlabError naming the flag for the first bad value."""
    check_temperature(temperature)
    check_top_k(top_k)
    check_top_p(top_p)
    check_repetition_penalty(repetition_penalty)


def _working_dtype(logits: torch.Tensor) -> torch.dtype:
    """At least float32: bf16/fp16 logits are promoted, float64 ones stay float64."""
    return torch.promote_types(logits.dtype, torch.float32)


def apply_repetition_penalty(
    logits: torch.Tensor, history: torch.Tensor, penalty: float
) -> torch.Tensor:
    """Make tokens already in ``history`` (int64 ids) less likely: positive logits are divided by
    ``penalty``, negative ones multiplied (Keskar et al. 2019, CTRL). penalty 1.0 is a no-op.

    A finite logit stays finite: an extreme penalty (1e-45, 1e300) saturates at the dtype's
    largest magnitude instead of reaching inf (which would make the probabilities NaN). Raises
    LmlabError for a penalty that is not a finite number > 0."""
    check_repetition_penalty(penalty)
    if penalty == 1.0 or history.numel() == 0:
        return logits
    out = logits.clone()
    seen = torch.unique(history)
    vals = out[seen]
    wide = vals.double()  # the penalty exactly: as float32, 1e300 is inf and 0 * inf is NaN
    penalised = torch.where(wide > 0, wide / penalty, wide * penalty)
    big = torch.finfo(out.dtype).max
    out[seen] = torch.where(vals.isfinite(), penalised.clamp(-big, big).to(out.dtype), vals)
    return out


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits, set the rest to -inf (k = 0 or k >= V: no-op, every token).
    Raises LmlabError for a negative k."""
    check_top_k(k)
    if k == 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[..., -1, None]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering (Holtzman et al. 2020): keep the smallest set of most likely tokens whose
    probability sums to >= p (always at least one); p = 1 is a no-op. Raises LmlabError for p
    outside (0, 1]."""
    check_top_p(p)
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1, dtype=_working_dtype(sorted_logits))
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
    """Pick the next token id from (V,) logits, computed in at least float32.

    temperature 0 = greedy (argmax), and so is a temperature so small that logits / temperature
    overflows (1e-45, 5e-324: its limit; never NaN, never refused). Raises LmlabError for a bad
    value (:func:`check_sampling`)."""
    check_sampling(temperature, top_k, top_p, repetition_penalty)
    logits = apply_repetition_penalty(
        logits.to(_working_dtype(logits)), history, repetition_penalty
    )
    if temperature == 0.0:
        return int(torch.argmax(logits))
    scaled = logits / temperature
    # Overflow (some finite logit / T is not finite): the T -> 0 limit. Every scaled logit
    # finite (their sum times 0 is then 0, else NaN) rules it out at once; else, as a non-finite
    # logit stays non-finite divided by any T > 0, "scaled is finite wherever logits is" is
    # "both are finite at the same places" (no gather of the finite entries: 0.45 ms -> 10 us
    # at V = 49,152, one thread).
    if not math.isfinite(float((scaled * 0).sum())) and not torch.equal(
        scaled.isfinite(), logits.isfinite()
    ):
        return int(torch.argmax(logits))
    logits = apply_top_p(apply_top_k(scaled, top_k), top_p)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
