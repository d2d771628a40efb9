"""Validate a run config against the component registries: the step above config and components.

:mod:`lmlab.config` is the schema and knows no component; each variant declares its own options
and ``check`` next to its forward (:class:`lmlab.registry.Contract`). This driver walks every
family whose :attr:`~lmlab.registry.Registry.field` is a config field (``model.position.kind``,
``model.attention.mask``, ``train.objective`` ...), a section's outer kind before the kinds of
its nested sections (``model.position.kind`` before ``model.position.scaling.kind``), and for
each:

1. looks the selected name up (an unknown one: a did-you-mean error listing the registered ones);
2. applies the generic option rule: an option some kind of the family declares, set (different
   from the section's default) while the selected kind does not declare it, is refused naming
   its owners: ``model.position.offset applies to kind=learned only, not rope``;

then the cross-family rules below (:func:`_model_rules`: ``d_model % n_heads`` ...), then the
selected variants' own ``check`` (given the ModelConfig for a ``model.*`` family, the RunConfig
for a ``data.*`` or ``train.*`` one), and last :func:`lmlab.config_ranges.check_ranges`. Every
error is one :class:`~lmlab.errors.ConfigError` naming the dotted field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import lmlab.data.tokenizer  # noqa: F401  (each import registers its component families)
import lmlab.models.build  # noqa: F401
import lmlab.models.init  # noqa: F401
import lmlab.nn as lnn
import lmlab.training.objectives as objectives
from lmlab.checks import choice, positive
from lmlab.config import ModelConfig, RunConfig, TrainConfig, variant_fields
from lmlab.config_ranges import check_ranges
from lmlab.data import passkey
from lmlab.data.answers import ANSWER_MASKS, LOSS_ON
from lmlab.errors import ConfigError
from lmlab.registry import Registry, families
from lmlab.training.optim import DECAY_SHAPES, OPTIMIZERS, SCHEDULES

SECTIONS = ("model", "data", "train")

# A family field whose None means "derived": how to find the name it stands for.
_DERIVED: dict[str, Callable[[RunConfig], str]] = {"train.objective": objectives.objective_name}


def validate_run_config(cfg: RunConfig) -> None:
    """Check every section of ``cfg`` (module docstring). Raises ConfigError."""
    if not cfg.name or cfg.name in (".", "..") or any(c in cfg.name for c in "/\\\0"):
        raise ConfigError(f"name: {cfg.name!r} must be a plain folder name (no slashes)")
    _validate_section(cfg, "model", lambda: _model_rules(cfg.model))
    _validate_section(cfg, "data", lambda: _data_rules(cfg))
    _validate_section(cfg, "train", lambda: _train_rules(cfg))
    check_ranges(cfg)  # last: the rules above give the more specific messages


def validate_model(m: ModelConfig) -> None:
    """Check a model config alone (its kinds, options, rules and ranges). Raises ConfigError."""
    cfg = RunConfig(model=m)
    _validate_section(cfg, "model", lambda: _model_rules(m))
    check_ranges(cfg, only="model.")


# ----------------------------------------------------------------------------- the driver


def config_families(section: str | None = None) -> list[tuple[str, Registry]]:
    """(field, registry) of every family chosen by a config field, in checking order: by
    section (model, data, train), then outer fields before nested ones, a section's ``kind``
    before its other choices (``mask``, ``router``), then registration.
    A second registry on a field already taken (``decoder_block`` on ``model.block.kind``) is
    the first one's sub-family, checked by the model kind that uses it."""
    found: dict[str, tuple[int, Registry]] = {}
    for i, reg in enumerate(families().values()):
        top = (reg.field or "").split(".")[0]
        if top in SECTIONS and reg.field not in found:
            found[reg.field] = (i, reg)  # type: ignore[index]

    def rank(f: str) -> tuple[int, int, bool, int]:  # a section's kind before its other choices
        return SECTIONS.index(f.split(".")[0]), f.count("."), not f.endswith(".kind"), found[f][0]

    order = sorted(found, key=rank)
    return [(f, found[f][1]) for f in order if section is None or f.startswith(section + ".")]


def selected(cfg: RunConfig, field: str) -> Any:
    """The value of the dotted ``field`` of ``cfg`` (a derived field's resolved name)."""
    if field in _DERIVED:
        return _DERIVED[field](cfg)
    return getattr(section_of(cfg, field), field.rsplit(".", 1)[1])


def section_of(cfg: RunConfig, field: str) -> Any:
    """The section holding ``field`` (``model.position`` for ``model.position.kind``)."""
    node: Any = cfg
    for part in field.split(".")[:-1]:
        node = getattr(node, part)
    return node


def default_of(section: Any, name: str) -> Any:
    """The default of field ``name`` of ``section``: the schema's, or the declaring variant's."""
    for f in dataclasses.fields(section):
        if f.name == name:
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            return f.default
    return variant_fields(section._path)[name][1]


def _validate_section(cfg: RunConfig, section: str, rules: Callable[[], None]) -> None:
    chosen: list[tuple[str, Registry, str]] = []
    for field, reg in config_families(section):
        kind = selected(cfg, field)
        unset = getattr(section_of(cfg, field), field.rsplit(".", 1)[1]) is None
        if field in _DERIVED and unset and kind not in reg:
            continue  # a model kind's default objective may be registered later
        reg.get(kind, field)
        refuse_foreign_options(cfg, field, reg, kind)
        chosen.append((field, reg, kind))
    rules()
    for _, reg, kind in chosen:
        check = reg.contract(kind).check
        if check is not None:
            check(cfg.model if section == "model" else cfg)


def refuse_foreign_options(cfg: RunConfig, field: str, reg: Registry, kind: str) -> None:
    """The generic option rule (module docstring) for the family ``reg`` at ``field``."""
    section = section_of(cfg, field)
    prefix = field.rsplit(".", 1)[0]
    own = set(reg.contract(kind).options)
    for option in dict.fromkeys(o for name in reg for o in reg.contract(name).options):
        if option in own:
            continue
        value = getattr(section, option)
        if value == default_of(section, option):
            continue
        owners = reg.owners(option)
        # name the selector relative to the section (kind=rope), in full at a section's top
        # level, where a bare "kind" would be ambiguous (model.kind=encoder)
        key = field if prefix in SECTIONS else field.rsplit(".", 1)[1]
        who = f"{key}={owners[0]}" if len(owners) == 1 else f"{key}s {', '.join(owners)}"
        msg = f"{prefix}.{option} applies to {who} only, not {kind}"
        if not dataclasses.is_dataclass(value):
            msg += f" ({option}={_yaml(value)} has no effect with {field}={kind})"
        raise ConfigError(msg)


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


# ----------------------------------------------------------------------------- cross-family rules


def _model_rules(m: ModelConfig) -> None:
    """Rules between families or on fields every kind reads."""
    if m.block.parallel and m.block.kind != "pre":
        raise ConfigError(
            f"model.block.parallel needs model.block.kind=pre (got {m.block.kind!r}): a parallel "
            "block normalises each branch's input"
        )
    if m.init_zero_residual and not m.block.residual:
        raise ConfigError(
            "model.init_zero_residual needs model.block.residual: true: without the skip "
            "connections a zeroed output projection makes every layer output zero"
        )
    choice(m.ffn.activation, sorted(lnn.ACTIVATIONS), "model.ffn.activation")
    choice(m.attention.backend, list(lnn.ATTENTION_BACKENDS), "model.attention.backend")
    for name in ("d_model", "n_layers", "max_seq_len", "vocab_size"):
        positive(getattr(m, name), f"model.{name}")
    for name in ("n_heads", "n_kv_heads", "head_dim"):
        positive(getattr(m.attention, name), f"model.attention.{name}")
    positive(m.ffn.d_ff, "model.ffn.d_ff")
    positive(m.ffn.multiple_of, "model.ffn.multiple_of")
    positive(m.init_std, "model.init_std")
    for name, value in (
        ("model.dropout", m.dropout),
        ("model.attention.dropout", m.attention.dropout),
    ):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{name} must be in [0, 1), got {value}")
    if m.attention.head_dim is None and m.d_model % m.attention.n_heads:
        raise ConfigError(
            f"model.d_model ({m.d_model}) must be divisible by model.attention.n_heads "
            f"({m.attention.n_heads}), or set model.attention.head_dim"
        )
    if m.attention.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.attention.n_heads ({m.attention.n_heads}) must be a multiple of "
            f"model.attention.n_kv_heads ({m.n_kv_heads})"
        )


def _data_rules(cfg: RunConfig) -> None:
    d = cfg.data
    if not 0.0 < d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be in (0, 1), got {d.val_fraction}")
    if not d.corpus:
        raise ConfigError("data.corpus must name a bundled corpus, a text file or a folder")
    choice(d.loss_on, LOSS_ON, "data.loss_on")
    if d.loss_on == "answers":
        if d.corpus not in ANSWER_MASKS:
            raise ConfigError(
                f"data.loss_on=answers needs a corpus with answer positions "
                f"({', '.join(ANSWER_MASKS)}); data.corpus {d.corpus!r} has none"
            )
        if d.tokenizer.kind != "char":
            raise ConfigError(
                "data.loss_on=answers needs data.tokenizer.kind=char (the answer positions are "
                f"characters), got {d.tokenizer.kind!r}"
            )
    t_len = cfg.train.seq_len  # a bad one is refused by the train rules, after these
    seq_len = t_len if t_len is not None and t_len > 0 else cfg.model.max_seq_len
    passkey.check_distance_range(d.passkey_min_distance, d.passkey_max_distance, d.corpus, seq_len)


def _train_rules(cfg: RunConfig) -> None:
    t, m = cfg.train, cfg.model
    for name in ("max_steps", "batch_size", "grad_accum_steps", "eval_every", "eval_batches"):
        positive(getattr(t, name), f"train.{name}")
    for name in ("log_every", "keep_checkpoints", "checkpoint_every", "lr_decay_steps"):
        positive(getattr(t, name), f"train.{name}")
    positive(t.seq_len, "train.seq_len")
    positive(t.lr, "train.lr")
    for name in ("min_lr", "warmup_steps", "weight_decay", "grad_clip", "max_skipped_steps"):
        positive(getattr(t, name), f"train.{name}", allow_zero=True)
    positive(t.checkpoint_interval_s, "train.checkpoint_interval_s")
    if (
        not 0 <= t.seed < 2**32
    ):  # NumPy refuses < 0; seed x 1,000,003 + ... must fit torch's 64 bits
        raise ConfigError(f"train.seed must be an integer in 0..{2**32 - 1}, got {t.seed}")
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr ({t.min_lr}) must not exceed train.lr ({t.lr})")
    for name, beta in (("train.beta1", t.beta1), ("train.beta2", t.beta2)):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"{name} must be in [0, 1), got {beta}")
    if t.seq_len is not None and t.seq_len > m.max_seq_len:
        raise ConfigError(
            f"train.seq_len ({t.seq_len}) must not exceed model.max_seq_len ({m.max_seq_len})"
        )
    choice(t.precision, ["bf16", "fp32", "auto"], "train.precision")
    choice(t.device, ["auto", "cpu", "cuda", "mps"], "train.device")
    choice(t.parallel, ["ddp", "fsdp"], "train.parallel")
    _optimizer_rules(t)


def _optimizer_rules(t: TrainConfig) -> None:
    """train.optimizer / schedule and their fields (:mod:`lmlab.training.optim`)."""
    choice(t.optimizer, OPTIMIZERS, "train.optimizer")
    choice(t.schedule, SCHEDULES, "train.schedule")
    choice(t.decay_shape, DECAY_SHAPES, "train.decay_shape")
    positive(t.muon_lr, "train.muon_lr")
    positive(t.muon_weight_decay, "train.muon_weight_decay", allow_zero=True)
    if not 0.0 <= t.muon_momentum < 1.0:
        raise ConfigError(f"train.muon_momentum must be in [0, 1), got {t.muon_momentum}")
    if not 0.0 <= t.decay_fraction <= 1.0:
        raise ConfigError(f"train.decay_fraction must be in [0, 1], got {t.decay_fraction}")
    # a field read only under one optimizer / schedule, set off its default under another, has
    # no effect: refused by name, as the generic option rule refuses a variant's foreign option
    for fields, selector, owner in (
        (("muon_lr", "muon_momentum", "muon_weight_decay"), "optimizer", "muon"),
        (("decay_fraction", "decay_shape"), "schedule", "wsd"),
    ):
        chosen = getattr(t, selector)
        if chosen == owner:
            continue
        off = [n for n in fields if getattr(t, n) != default_of(t, n)]
        if off:
            # every such field at once, and how to switch (a preset such as configs/minigpt.yaml
            # sets them: overriding only train.optimizer would otherwise fail field by field)
            name, value = off[0], getattr(t, off[0])
            others = "".join(f", train.{n}={_yaml(getattr(t, n))}" for n in off[1:])
            resets = " ".join(f"--set train.{n}={_yaml(default_of(t, n))}" for n in off)
            raise ConfigError(
                f"train.{name} applies to {selector}={owner} only, not {chosen} "
                f"({name}={_yaml(value)}{others} has no effect with train.{selector}={chosen}); "
                f"drop {'them' if others else 'it'} from the config or set "
                f"{'them' if others else 'it'} back to the default: {resets}"
            )
    if t.optimizer == "muon" and t.parallel == "fsdp":
        raise ConfigError(
            "train.optimizer=muon does not run with train.parallel=fsdp: Muon orthogonalises each "
            "whole matrix, which FSDP2 shards across ranks; use train.parallel=ddp"
        )
