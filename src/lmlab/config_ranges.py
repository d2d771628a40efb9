"""The allowed interval of every numeric config field (:data:`FIELD_RANGES`), checked last by
:func:`lmlab.validation.validate_run_config` (:func:`check_ranges`).

Re-exported by :mod:`lmlab.config` (``from lmlab.config import FIELD_RANGES`` keeps working).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmlab.errors import ConfigError

if TYPE_CHECKING:
    from lmlab.config import RunConfig


@dataclass(frozen=True)
class Range:
    """An interval of allowed values: ``[low, high]``, either end open when its flag says so."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:  # False for NaN
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return bool(above and below)

    def __str__(self) -> str:
        def num(x: float) -> str:
            return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"

        lo, hi = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"{lo}{num(self.low)}, {num(self.high)}{hi}"


MAX_TOKENS = 1 << 24  # context lengths, windows, positions (16,777,216 tokens)
MAX_VOCAB = 1 << 22  # vocabulary sizes and token ids (4,194,304; the largest real vocab: ~260k)
MAX_STEPS = 10**9  # optimizer-step counts and intervals
MAX_WIDTH = 1 << 16  # d_model, d_ff, head counts x head_dim stay far below this
_UNIT, _PROB = Range(0, 1, high_open=True), Range(0, 1, low_open=True, high_open=True)


def _positive_up_to(high: float) -> Range:
    return Range(0, high, low_open=True)


def _count(low: int, high: int) -> Range:
    return Range(low, high)


# Every int or float field of RunConfig with its allowed interval; checked by check_ranges after
# the cross-field rules (tests/unit/test_config.py fails for a numeric field missing here).
FIELD_RANGES: dict[str, Range] = {
    "model.vocab_size": _count(1, MAX_VOCAB),
    "model.d_model": _count(1, MAX_WIDTH),
    "model.n_layers": _count(1, 1024),
    "model.max_seq_len": _count(1, MAX_TOKENS),
    "model.dropout": _UNIT,
    "model.init_std": _positive_up_to(1.0),
    "model.attention.n_heads": _count(1, 1024),
    "model.attention.n_kv_heads": _count(1, 1024),
    "model.attention.head_dim": _count(1, 4096),
    "model.attention.dropout": _UNIT,
    "model.attention.window": _count(1, MAX_TOKENS),
    "model.position.rope_theta": _positive_up_to(1e12),
    "model.position.partial_rotary_factor": Range(0, 1, low_open=True),
    "model.position.scaling.factor": Range(1, 1e4),
    "model.position.scaling.original_max_seq_len": _count(1, MAX_TOKENS),
    "model.position.scaling.beta_fast": _positive_up_to(1e6),
    "model.position.scaling.beta_slow": _positive_up_to(1e6),
    "model.position.scaling.attention_factor": _positive_up_to(1e3),
    "model.position.scaling.mscale": _positive_up_to(1e3),
    "model.position.scaling.mscale_all_dim": _positive_up_to(1e3),
    "model.position.offset": _count(0, 1 << 16),
    "model.position.num_buckets": _count(1, 1 << 16),
    "model.position.max_distance": _count(1, MAX_TOKENS),
    "model.norm.eps": _positive_up_to(0.1),
    "model.ffn.d_ff": _count(1, 1 << 20),
    "model.ffn.multiple_of": _count(1, 1 << 16),
    "model.ffn.n_experts": _count(1, 4096),
    "model.ffn.top_k": _count(1, 4096),
    "model.ffn.aux_loss_coef": Range(0, 100),
    "model.ffn.z_loss_coef": Range(0, 100),
    "model.seq2seq.n_decoder_layers": _count(1, 1024),
    "model.seq2seq.pad_token_id": _count(0, MAX_VOCAB - 1),
    "model.seq2seq.decoder_start_token_id": _count(0, MAX_VOCAB - 1),
    "model.seq2seq.eos_token_id": _count(0, MAX_VOCAB - 1),
    "model.type_vocab_size": _count(0, 1024),
    "data.val_fraction": _PROB,
    "data.tokenizer.vocab_size": _count(1, MAX_VOCAB),
    "data.passkey_min_distance": _count(1, MAX_TOKENS),  # and lmlab.data.passkey's own check
    "data.passkey_max_distance": _count(1, MAX_TOKENS),
    "train.max_steps": _count(1, MAX_STEPS),
    "train.batch_size": _count(1, 1 << 16),
    "train.grad_accum_steps": _count(1, 1 << 16),
    "train.seq_len": _count(1, MAX_TOKENS),
    "train.lr": _positive_up_to(10.0),
    "train.min_lr": Range(0, 10.0),
    "train.warmup_steps": _count(0, MAX_STEPS),
    "train.lr_decay_steps": _count(1, MAX_STEPS),
    "train.weight_decay": Range(0, 10.0),
    "train.beta1": _UNIT,
    "train.beta2": _UNIT,
    "train.muon_lr": _positive_up_to(10.0),
    "train.muon_momentum": _UNIT,
    "train.muon_weight_decay": Range(0, 10.0),
    "train.decay_fraction": Range(0, 1),
    "train.grad_clip": Range(0, 1e6),
    "train.max_skipped_steps": _count(0, 10**6),
    "train.eval_every": _count(1, MAX_STEPS),
    "train.eval_batches": _count(1, 10**6),
    "train.log_every": _count(1, MAX_STEPS),
    "train.checkpoint_every": _count(1, MAX_STEPS),
    "train.checkpoint_interval_s": _positive_up_to(1e9),
    "train.keep_checkpoints": _count(1, 10**6),
    "train.seed": Range(0, 2**32, high_open=True),
    "train.mask_prob": _PROB,
}


def numeric_fields(cls: type | None = None, prefix: str = "") -> list[str]:
    """Dotted names of every int or float field (optional ones included) of ``cls``
    (default :class:`~lmlab.config.RunConfig`)."""
    if cls is None:
        from lmlab.config import RunConfig

        cls = RunConfig
    out: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name.startswith("_"):  # a section's variant-declared fields (lmlab.config)
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += numeric_fields(tp, f"{prefix}{f.name}.")  # type: ignore[arg-type]
        elif {int, float} & set(typing.get_args(tp) or (tp,)):
            out.append(prefix + f.name)
    return out


def check_ranges(cfg: RunConfig, only: str = "") -> None:
    """Refuse a numeric field outside its :data:`FIELD_RANGES` interval (NaN and inf included;
    None, where a field allows it, means "derived" and is not checked). ``only``: check just the
    fields whose dotted name starts with it (``"model."``). Raises ConfigError."""
    for name, allowed in FIELD_RANGES.items():
        if not name.startswith(only):
            continue
        value: Any = cfg
        for part in name.split("."):
            value = getattr(value, part)
        if value is not None and value not in allowed:
            raise ConfigError(f"{name} must be in {allowed}, got {value}")
