"""Config resolution: what a run fills in before it trains, computed in one place.

A config may leave fields unset that a run fills in from its data or from other fields
(:data:`FILLED_IN`): the vocabulary size and encoder-decoder special ids from the tokenizer, the
window length from ``model.max_seq_len``, the cosine decay length from ``max_steps`` at the run's
start. :func:`fill_in` is the one function that fills them; a new run fills them from its
tokenizer (:meth:`FillIns.for_new_run`), and a resumed run's config is compared with the saved
one as filled in by the saved run (:meth:`FillIns.of_run`). :func:`resolve_run` turns a config
and the run's tokenizer and device into the :class:`ResolvedRun` the trainer reads. Nothing here
reads or writes a file.

:func:`prepare_run` claims the run folder (new or resumed) before any of this.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lmlab.config import RunConfig, diff_configs
from lmlab.data.tokenizer import Tokenizer
from lmlab.errors import LmlabError
from lmlab.run import read_run_config
from lmlab.training.hardware import resolve_precision
from lmlab.training.objectives import objective_name, set_seq2seq_ids
from lmlab.training.run_folder import RunFolder, claim_new_run, claim_resumed_run

# Settings that may differ when a run is resumed (they do not change what is computed).
RESUMABLE_CHANGES = {"train.max_steps", "train.device"}

SEQ2SEQ_IDS = ("pad_token_id", "decoder_start_token_id", "eos_token_id")

# The fields a run fills in when the config leaves them unset (see FillIns).
FILLED_IN = (
    "model.vocab_size",
    *(f"model.seq2seq.{k}" for k in SEQ2SEQ_IDS),
    "train.seq_len",
    "train.lr_decay_steps",
    "train.precision",
)


@dataclass(frozen=True)
class FillIns:
    """The values the fields of :data:`FILLED_IN` take when a config leaves them unset.

    vocab_size: tokens in the tokenizer. seq2seq_ids: pad / decoder start / eos token ids
    (encoder-decoder models; None elsewhere). seq_len: tokens per training window.
    lr_decay_steps: optimizer steps of the cosine decay. precision: what ``auto`` becomes
    (``bf16`` or ``fp32``)."""

    vocab_size: int | None
    seq2seq_ids: dict[str, int | None]
    seq_len: int | None
    lr_decay_steps: int | None
    precision: str = "fp32"

    @classmethod
    def for_new_run(
        cls, cfg: RunConfig, tokenizer: Tokenizer, device: torch.device | None = None
    ) -> FillIns:
        """A new run's: the tokenizer's vocabulary and special ids (decoder start = pad, as
        T5), ``model.max_seq_len`` tokens per window, a decay over ``train.max_steps``, and the
        precision ``device`` runs fastest (:func:`resolve_precision`; the CPU when None)."""
        s = replace(cfg.model.seq2seq)  # a copy for set_seq2seq_ids to fill
        set_seq2seq_ids(replace(cfg, model=replace(cfg.model, seq2seq=s)), tokenizer)
        return cls(
            tokenizer.vocab_size,
            {k: getattr(s, k) for k in SEQ2SEQ_IDS},
            cfg.model.max_seq_len,
            cfg.train.max_steps,
            resolve_precision("auto", device if device is not None else torch.device("cpu")),
        )

    @classmethod
    def of_run(cls, saved: RunConfig) -> FillIns:
        """What the run that saved ``saved`` filled in (its config.yaml holds the values)."""
        s = saved.model.seq2seq
        return cls(
            saved.model.vocab_size,
            {k: getattr(s, k) for k in SEQ2SEQ_IDS},
            saved.train.seq_len,
            saved.train.lr_decay_steps,
            saved.train.precision,
        )


def fill_in(cfg: RunConfig, fills: FillIns) -> RunConfig:
    """A copy of ``cfg`` with its unset :data:`FILLED_IN` fields set from ``fills`` (a
    special id counts as unset when None, the other fields when None or 0); ``cfg`` is not
    changed."""
    cfg = copy.deepcopy(cfg)
    t, m, s = cfg.train, cfg.model, cfg.model.seq2seq
    m.vocab_size = m.vocab_size or fills.vocab_size
    for k in SEQ2SEQ_IDS:
        if getattr(s, k) is None:
            setattr(s, k, fills.seq2seq_ids[k])
    t.seq_len = t.seq_len or fills.seq_len
    t.lr_decay_steps = t.lr_decay_steps or fills.lr_decay_steps
    if t.precision == "auto":
        t.precision = fills.precision
    return cfg


@dataclass(frozen=True)
class ResolvedRun:
    """A run's config with every filled-in field set, and what the trainer derives from it.

    cfg: the config the run trains (and saves) with. device: where it trains. seq_len: tokens
    per training window. precision: ``bf16`` (autocast) or ``fp32`` (``auto`` resolved).
    objective: the training
    objective's registered name (``train.objective`` or the model kind's default)."""

    cfg: RunConfig
    device: torch.device
    seq_len: int
    precision: str
    objective: str
    auto_precision: bool = False  # precision was ``auto`` in the config (the log says the pick)


def check_precision(cfg: RunConfig, dev: torch.device) -> None:
    """Refuse a precision the device cannot autocast to (LmlabError)."""
    if cfg.train.precision == "bf16" and dev.type == "mps":
        raise LmlabError("train.precision=bf16 autocast is not supported on mps; use fp32")


def resolve_run(
    cfg: RunConfig, tokenizer: Tokenizer, dev: torch.device, new_run: bool = True
) -> ResolvedRun:
    """Fill in ``cfg`` (a copy) from ``tokenizer`` and the defaults, and resolve the rest.

    A new run refuses a ``model.vocab_size`` other than the tokenizer's and validates the filled
    config (ConfigError). A resumed run's saved config was validated when read; it holds every
    filled-in value already, so filling it changes nothing. Raises LmlabError for a precision
    the device cannot run."""
    check_precision(cfg, dev)
    auto_precision = cfg.train.precision == "auto"
    if new_run and cfg.model.vocab_size not in (None, n := tokenizer.vocab_size):
        msg = f"model.vocab_size is {cfg.model.vocab_size} but the tokenizer has {n} tokens"
        raise LmlabError(f"{msg}; remove model.vocab_size (null: the tokenizer's)")  # not replaced
    cfg = fill_in(cfg, FillIns.for_new_run(cfg, tokenizer, dev))
    if new_run:
        cfg.validate()
    assert cfg.train.seq_len is not None
    return ResolvedRun(
        cfg, dev, cfg.train.seq_len, cfg.train.precision, objective_name(cfg), auto_precision
    )


@dataclass
class PreparedRun:
    """What :func:`prepare_run` resolved: the config, the claimed (locked) run folder, and
    whether the run continues from a checkpoint."""

    cfg: RunConfig
    folder: RunFolder
    resuming: bool

    @property
    def run_dir(self) -> Path:
        return self.folder.path


def prepare_run(
    cfg: RunConfig | None,
    out: Path | None,
    resume: Path | None,
    max_steps: int | None,
    clean: bool = True,
    overwrite: bool = False,
) -> PreparedRun:
    """Resolve the config and claim the run folder (:mod:`lmlab.training.run_folder`: locked
    by rank 0, ``clean``, until the caller releases ``folder``).

    A folder counts as a run once it holds a checkpoint; a folder lmlab made for a run that
    failed or was stopped before its first checkpoint is started afresh. A folder holding a run
    or files lmlab did not write is refused unless ``overwrite``.
    """
    if resume is not None:
        if out is not None and Path(out).resolve() != Path(resume).resolve():
            raise LmlabError("--out cannot be combined with --resume (a run stays in its folder)")
        if overwrite:
            raise LmlabError("--overwrite starts a new run; it cannot be combined with --resume")
        saved = read_run_config(resume)
        if cfg is not None:
            # Fields a new run fills in compare as the saved run filled them in.
            probe = fill_in(cfg, FillIns.of_run(saved))
            changed = [
                f for f in diff_configs(saved, probe) if f not in RESUMABLE_CHANGES | {"name"}
            ]
            if changed:
                raise LmlabError(
                    f"--resume continues {resume} with its own config; these settings differ from "
                    f"it: {', '.join(changed)}. Only --max-steps (and --device, --time-budget) may "
                    "change on resume; start a new run for anything else"
                )
        folder = claim_resumed_run(Path(resume), clean)  # checked: now lock it
        if max_steps is not None:
            saved.train.max_steps = max_steps
        return PreparedRun(saved, folder, True)
    assert cfg is not None
    run_dir = Path(out) if out is not None else Path("runs") / cfg.name
    folder = claim_new_run(run_dir, overwrite, clean)
    if max_steps is not None:
        cfg.train.max_steps = max_steps
    return PreparedRun(cfg, folder, False)
