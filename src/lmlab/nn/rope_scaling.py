"""RoPE context scaling: pure functions from a scaling config to rotation frequencies.

Legend: hd head_dim, r rotary channels (hd * partial_rotary_factor, even). Each function maps
``(r, theta, scaling, seq_len)`` to ``(inv_freq (r/2,) float32, attention_factor float)``:
channel pair i rotates by ``position * inv_freq[i]`` radians, and cos/sin are multiplied by
``attention_factor`` (so q.k scores by its square; 1.0 except for YaRN). ``seq_len`` is a 0-dim
int64 tensor, the number of positions seen by the current forward (max position + 1); only
length-dependent kinds (:func:`is_length_dependent`) read it, and None means "not known yet" (at
construction). Every formula follows the paper and Hugging Face ``transformers`` 5
(``modeling_rope_utils.py``) operation for operation, so float32 results agree to rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from lmlab.checks import positive
from lmlab.errors import ConfigError
from lmlab.registry import Registry

if TYPE_CHECKING:
    from lmlab.config import ModelConfig, RopeScalingConfig

RopeScalingFn = Callable[
    [int, float, "RopeScalingConfig", "torch.Tensor | None"], tuple[torch.Tensor, float]
]
ROPE_SCALING: Registry[RopeScalingFn] = Registry("rope_scaling", "model.position.scaling.kind")
ROPE_SCALING.notes = """
Selected by `model.position.scaling.kind` (with `scaling.factor`), for `position.kind: rope`;
`lmlab eval --lengths ... --set model.position.scaling.kind=yarn` may change it at inference.
When to use: `linear` for a longer context with a short fine-tune; `ntk` for a longer context
with no fine-tune; `dynamic_ntk` for inference past the training length (the NTK base is
recomputed once past the original length); `yarn`, whose attention temperature is
0.1 ln(s) + 1, is the strongest extension, as in Qwen / DeepSeek configs.
"""

WHERE = "model.position.scaling"
FACTOR_4 = ({"position": {"scaling": {"factor": 4.0}}},)  # the contract examples of a kind


def check_factor(m: ModelConfig) -> None:
    """Every scaling kind but none: 1 <= factor < inf; original_max_seq_len > 0 when set."""
    s = m.position.scaling
    if not 1.0 <= s.factor < float("inf"):  # NaN and inf gave NaN losses
        raise ConfigError(
            f"{WHERE}.factor must be >= 1 and finite (new length / original), got {s.factor}"
        )
    positive(s.original_max_seq_len, f"{WHERE}.original_max_seq_len")


def check_ntk(m: ModelConfig) -> None:
    """NTK's base change divides by r - 2: more than 2 rotated channels."""
    check_factor(m)
    r = int(m.head_dim * m.position.partial_rotary_factor)
    if r <= 2:
        kind = m.position.scaling.kind
        raise ConfigError(f"{WHERE}.kind={kind} needs more than 2 rotated channels, got {r}")


def check_yarn(m: ModelConfig) -> None:
    """beta_fast > beta_slow > 0; positive factors; mscale with mscale_all_dim or neither."""
    check_factor(m)
    s = m.position.scaling
    positive(s.beta_slow, f"{WHERE}.beta_slow")
    if s.beta_fast <= s.beta_slow:
        raise ConfigError(
            f"{WHERE}.beta_fast ({s.beta_fast}) must exceed {WHERE}.beta_slow ({s.beta_slow})"
        )
    positive(s.attention_factor, f"{WHERE}.attention_factor")
    positive(s.mscale, f"{WHERE}.mscale")
    positive(s.mscale_all_dim, f"{WHERE}.mscale_all_dim")
    if (s.mscale is None) != (s.mscale_all_dim is None):
        raise ConfigError(f"{WHERE}.mscale and {WHERE}.mscale_all_dim must be set together")


def rope_inv_freq(dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """(dim/2,) float32 rotation frequencies theta^(-2i/dim) (Su et al. 2021, RoFormer)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (theta**exponents)


def length_dependent(fn: RopeScalingFn) -> RopeScalingFn:
    """Mark a scaling function whose frequencies depend on ``seq_len`` (recomputed per forward)."""
    fn.length_dependent = True  # type: ignore[attr-defined]
    return fn


def is_length_dependent(fn: RopeScalingFn) -> bool:
    """True if ``fn`` reads ``seq_len`` (so frequencies cannot be computed once at construction)."""
    return bool(getattr(fn, "length_dependent", False))


@ROPE_SCALING.register("none")
def no_scaling(
    dim: int, theta: float, s: RopeScalingConfig, seq_len: torch.Tensor | None = None
) -> tuple[torch.Tensor, float]:
    """Plain RoPE frequencies theta^(-2i/r) (Su et al. 2021)."""
    return rope_inv_freq(dim, theta), 1.0


@ROPE_SCALING.register(
    "linear",
    options=("factor",),
    check=check_factor,
    examples=({"position": {"scaling": {"factor": 4.0}}},),
)
def linear_scaling(
    dim: int, theta: float, s: RopeScalingConfig, seq_len: torch.Tensor | None = None
) -> tuple[torch.Tensor, float]:
    """Position interpolation: position m is read as m / factor (Chen et al. 2023; HF linear).

    Every frequency is divided by ``factor`` ("Extending Context Window of Large Language Models
    via Positional Interpolation")."""
    return rope_inv_freq(dim, theta) / s.factor, 1.0


@ROPE_SCALING.register(
    "ntk",
    options=("factor",),
    check=check_ntk,
    examples=({"position": {"scaling": {"factor": 4.0}}},),
)
def ntk_scaling(
    dim: int, theta: float, s: RopeScalingConfig, seq_len: torch.Tensor | None = None
) -> tuple[torch.Tensor, float]:
    """NTK-aware base change: theta * factor^(r/(r-2)) (bloc97 2023, "NTK-Aware Scaled RoPE").

    The highest frequency is unchanged and the lowest is divided by exactly ``factor``, so high
    frequencies extrapolate and low ones interpolate. Needs r > 2."""
    return rope_inv_freq(dim, theta * s.factor ** (dim / (dim - 2))), 1.0


@ROPE_SCALING.register(
    "dynamic_ntk",
    options=("factor", "original_max_seq_len"),
    check=check_ntk,
    examples=({"position": {"scaling": {"factor": 4.0}}},),
)
@length_dependent
def dynamic_ntk_scaling(
    dim: int, theta: float, s: RopeScalingConfig, seq_len: torch.Tensor | None = None
) -> tuple[torch.Tensor, float]:
    """NTK base change recomputed from the current length past the original (emozilla 2023; HF
    dynamic).

    Plain RoPE while ``seq_len`` <= L = ``original_max_seq_len``; beyond it the base becomes
    theta * (factor * seq_len / L - (factor - 1))^(r/(r-2)).

    With a KV cache, cached keys keep the rotation of the step that wrote them (as in HF), so past
    L cached decoding differs from a full forward pass over the same tokens. Needs r > 2.
    """
    plain = rope_inv_freq(dim, theta, None if seq_len is None else seq_len.device)
    if seq_len is None:
        return plain, 1.0
    original = s.original_max_seq_len
    assert original is not None, "resolve original_max_seq_len before calling"
    length = torch.clamp(seq_len, min=original)
    base = theta * ((s.factor * length / original) - (s.factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=seq_len.device).float() / dim
    scaled = 1.0 / (base**exponents)
    return torch.where(seq_len > original, scaled, plain), 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's sqrt(1/t) = 0.1 * mscale * ln(factor) + 1 if factor > 1, else 1 (Peng et al. 2023)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(s: RopeScalingConfig) -> float:
    """The cos/sin multiplier: ``attention_factor`` if set; mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) if both are set (DeepSeek-V2); else 0.1 ln(factor) + 1."""
    if s.attention_factor is not None:
        return s.attention_factor
    if s.mscale and s.mscale_all_dim:
        return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    return yarn_mscale(s.factor)


def yarn_correction_range(dim: int, theta: float, s: RopeScalingConfig) -> tuple[float, float]:
    """The channel-pair range [low, high] between full extrapolation (pairs that rotate more than
    ``beta_fast`` times over the original context) and full interpolation (fewer than
    ``beta_slow`` times), floored/ceiled when ``truncate``, clipped to [0, r - 1]."""
    original = s.original_max_seq_len
    assert original is not None, "resolve original_max_seq_len before calling"

    def pair_for(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = pair_for(s.beta_fast), pair_for(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


@ROPE_SCALING.register(
    "yarn",
    options=(
        "factor",
        "original_max_seq_len",
        "beta_fast",
        "beta_slow",
        "truncate",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
    ),
    check=check_yarn,
    examples=({"position": {"scaling": {"factor": 4.0, "original_max_seq_len": 8}}},),
)
def yarn_scaling(
    dim: int, theta: float, s: RopeScalingConfig, seq_len: torch.Tensor | None = None
) -> tuple[torch.Tensor, float]:
    """YaRN: NTK-by-parts interpolation plus an attention temperature (Peng et al. 2023; HF yarn).

    Pairs that turn more than ``beta_fast`` times over the original context keep their frequency,
    pairs turning fewer than ``beta_slow`` times are divided by ``factor``, a ramp linear in the
    pair index blends those between (the reference code's form); cos and sin are multiplied by
    sqrt(1/t) = 0.1 ln(factor) + 1 ("YaRN: Efficient Context Window Extension of Large Language
    Models")."""
    low, high = yarn_correction_range(dim, theta, s)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq, yarn_attention_factor(s)
