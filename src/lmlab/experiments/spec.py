"""An experiment file: a base config, named variants, seeds, one budget, an optional eval.

```yaml
name: attention-heads            # a plain folder name
claim: "GQA keeps MHA's quality at a fraction of the KV cache"
base: ../configs/tiny.yaml       # a config path (relative to this file) or an inline mapping
variants:                        # name -> {dotted.field: value}; the first is the reference
  mha: {}
  gqa: {model.attention.n_kv_heads: 2}
seeds: [1, 2]                    # train.seed of each run
budget: {steps: 400}             # exactly one of: steps, tokens, time_s
eval:                            # optional
  lengths: [128, 256, 512]       # loss at each context length (lmlab eval --lengths)
  max_tokens: 16385              # text scored per length (default: the whole val split)
  inference:                     # extra rows: a trained variant with inference-time overrides
    gqa-ntk: {variant: gqa, set: {model.position.scaling.kind: ntk}}
  passkey: {distances: [24, 64, 192], samples: 100}   # data.corpus passkey or recall only:
                                 # retrieval accuracy per distance (lmlab.evaluation.passkey)
decode_tokens: 64                # decode tokens/s is timed over this many cached steps
```

Budgets, per run (each variant x seed):

- ``steps``: ``train.max_steps`` optimizer steps.
- ``tokens``: ceil(tokens / (batch_size x grad_accum_steps x seq_len)) steps of the variant, so
  variants with another batch shape see the same number of tokens (rounded up to whole steps).
- ``time_s``: seconds of training time as the trainer counts it (``elapsed_s`` in the checkpoint:
  steps, periodic evals and checkpoints, from the first step, summed over resumed sessions), capped
  by ``train.max_steps``, which also stays the length of the cosine schedule. A run is finished
  once its checkpoint's ``elapsed_s`` reaches ``time_s`` (or it reached max_steps); a stopped run
  resumes from its checkpoint with ``time_s - elapsed_s`` left. Steps taken after the last
  checkpoint of a killed run are redone and their time is not counted. Unlike the other budgets,
  the number of steps depends on the machine's speed.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmlab.config import RunConfig, config_from_dict, read_yaml
from lmlab.errors import ConfigError, LmlabError
from lmlab.safeio import short_repr

TOP_LEVEL = (
    "name",
    "claim",
    "description",
    "base",
    "variants",
    "seeds",
    "budget",
    "eval",
    "decode_tokens",
)
BUDGET_KINDS = ("steps", "tokens", "time_s")
EVAL_FIELDS = ("lengths", "max_tokens", "inference", "batch_size", "passkey")
# Upper bounds of the experiment's own numbers (a run's config fields have theirs in lmlab.config)
BUDGET_MAX = {"steps": 1e9, "tokens": 1e15, "time_s": 1e8}  # 1e8 s is three years
MAX_EVAL_TOKENS = 1 << 40
MAX_EVAL_BATCH = 1 << 16
MAX_DECODE = 1 << 16


@dataclass
class Budget:
    """Exactly one of steps (optimizer steps), tokens (training tokens) or time_s (seconds)."""

    kind: str
    value: float

    def steps_for(self, cfg: RunConfig) -> int:
        """Optimizer steps a run of ``cfg`` trains for (the cap, for a time budget)."""
        if self.kind == "steps":
            return int(self.value)
        if self.kind == "tokens":
            t = cfg.train
            per_step = t.batch_size * t.grad_accum_steps * (t.seq_len or cfg.model.max_seq_len)
            return max(1, math.ceil(self.value / per_step))
        return cfg.train.max_steps

    @property
    def time_s(self) -> float | None:
        return self.value if self.kind == "time_s" else None

    def describe(self) -> str:
        unit = {"steps": "optimizer steps", "tokens": "training tokens", "time_s": "seconds"}
        value = int(self.value) if self.kind != "time_s" else self.value
        return f"{value:,} {unit[self.kind]} per run"


@dataclass
class InferenceVariant:
    """A trained variant evaluated again with inference-time overrides
    (``model.position.scaling.*``)."""

    variant: str
    overrides: list[str]


@dataclass
class EvalSpec:
    lengths: list[int] = field(default_factory=list)
    max_tokens: int | None = None
    batch_size: int = 8
    inference: dict[str, InferenceVariant] = field(default_factory=dict)
    passkey: Any = None  # a lmlab.evaluation.passkey.PasskeyEval, or None


@dataclass
class Experiment:
    """A parsed, validated experiment file. ``variants`` keep the file's order; the first is the
    reference the report compares every other one with."""

    name: str
    claim: str
    path: Path | None
    base: dict[str, Any]
    variants: dict[str, dict[str, Any]]
    seeds: list[int]
    budget: Budget
    eval: EvalSpec
    decode_tokens: int = 64
    is_smoke: bool = False

    def config(self, variant: str, seed: int) -> RunConfig:
        """The validated run config of one variant and seed (a fresh object at each call)."""
        data = copy.deepcopy(self.base)
        for key, value in self.variants[variant].items():
            _set_dotted(data, key, copy.deepcopy(value), f"variant {variant!r}")
        data["name"] = f"{self.name}-{variant}-seed{seed}"
        data.setdefault("train", {})
        if not isinstance(data["train"], dict):
            raise ConfigError(f"{self._where()}: train must be a section (mapping)")
        data["train"]["seed"] = seed
        try:
            cfg = config_from_dict(data).validate()
        except ConfigError as e:
            raise ConfigError(f"{self._where()}: variant {variant!r}: {e}") from None
        cfg.train.max_steps = self.budget.steps_for(cfg)
        if self.is_smoke:  # 2 sequences per step; val loss at steps 0 and 2, from one batch
            cfg.train.batch_size = min(cfg.train.batch_size, 2)
            cfg.train.eval_batches, cfg.train.eval_every = 1, 2
        return cfg

    def smoke(self) -> Experiment:
        """The CI version: every variant 2 steps of 2 sequences, the first seed, one eval batch,
        one window per eval length, 2 passkey prompts per distance, 4 decode tokens."""
        lengths = self.eval.lengths
        pk = self.eval.passkey
        ev = dataclasses.replace(
            self.eval,
            max_tokens=(max(lengths) + 1) if lengths else None,
            batch_size=1,
            passkey=dataclasses.replace(pk, samples=2) if pk is not None else None,
        )
        return dataclasses.replace(
            self,
            is_smoke=True,
            seeds=self.seeds[:1],
            budget=Budget("steps", 2),
            eval=ev,
            decode_tokens=4,
        )

    def _where(self) -> str:
        return str(self.path) if self.path else f"experiment {self.name!r}"


def _set_dotted(data: dict[str, Any], key: str, value: Any, where: str) -> None:
    if not isinstance(key, str) or not key or any(not p for p in key.split(".")):
        raise ConfigError(
            f"{where}: {short_repr(key)} is not a dotted config field (e.g. model.d_model)"
        )
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{where}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def _plain_name(value: Any, what: str, where: str) -> str:
    """``value``: a non-empty string usable as one folder name: no slash, backslash or control
    character (a newline would split report.md's table rows), not ``.``/``..``/``seed-*``."""
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {what} {short_repr(value)} must be a string")
    if not value or value in (".", "..") or "/" in value:
        raise ConfigError(
            f"{where}: {what} {short_repr(value)} must be a plain folder name (no slashes)"
        )
    if any(c == "\\" or not c.isprintable() for c in value) or value.startswith("seed-"):
        raise ConfigError(
            f"{where}: {what} {short_repr(value)} must be a plain folder name "
            "(no backslash or control characters, not seed-*)"
        )
    return value


def _load_base(base: Any, path: Path | None, where: str) -> dict[str, Any]:
    if isinstance(base, dict):
        return copy.deepcopy(base)
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{where}: base must be a config file path or a config mapping")
    p = Path(base)
    if not p.is_absolute() and path is not None:
        p = path.parent / p
    try:
        loaded = read_yaml(p, "base config")
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{where}: base config {p} must hold a mapping")
    return loaded or {}


def _budget(raw: Any, where: str) -> Budget:
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(
            f"{where}: budget must be a mapping with exactly one of {', '.join(BUDGET_KINDS)} "
            "(e.g. budget: {steps: 400})"
        )
    unknown = [k for k in raw if k not in BUDGET_KINDS]
    if unknown:
        raise ConfigError(
            f"{where}: budget.{unknown[0]} is not a budget; allowed: {', '.join(BUDGET_KINDS)}"
        )
    if len(raw) != 1:
        raise ConfigError(
            f"{where}: budget sets {' and '.join(raw)}; give exactly one of "
            f"{', '.join(BUDGET_KINDS)}"
        )
    ((kind, value),) = raw.items()
    ok_type = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind != "time_s":
        ok_type = ok_type and float(value).is_integer()
    if not ok_type or not 0 < value <= BUDGET_MAX[kind]:  # also refuses NaN and inf
        what = "a positive number of seconds" if kind == "time_s" else "a positive integer"
        what += f" (at most {BUDGET_MAX[kind]:.0e})"
        raise ConfigError(f"{where}: budget.{kind} must be {what}, got {short_repr(value)}")
    return Budget(kind, float(value))


def _eval(raw: Any, variants: dict[str, Any], where: str) -> EvalSpec:
    from lmlab.evaluation.lengths import check_inference_override, parse_lengths

    if raw is None:
        return EvalSpec()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: eval must be a mapping ({', '.join(EVAL_FIELDS)})")
    for key in raw:
        if key not in EVAL_FIELDS:
            raise ConfigError(f"{where}: eval.{key} is unknown; allowed: {', '.join(EVAL_FIELDS)}")
    spec = EvalSpec()
    if raw.get("passkey") is not None:
        from lmlab.evaluation.passkey import parse_passkey_eval

        spec.passkey = parse_passkey_eval(raw["passkey"], where)
    if raw.get("lengths") is not None:
        if not isinstance(raw["lengths"], list):
            raise ConfigError(f"{where}: eval.lengths must be a list of context lengths")
        try:
            spec.lengths = parse_lengths(raw["lengths"])
        except LmlabError as e:
            raise ConfigError(f"{where}: eval.lengths: {e}") from None
    for name in ("max_tokens", "batch_size"):
        value = raw.get(name)
        if value is None:
            continue
        low, high = (2, MAX_EVAL_TOKENS) if name == "max_tokens" else (1, MAX_EVAL_BATCH)
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ConfigError(
                f"{where}: eval.{name} must be an integer >= {low} (at most {high:,}), got "
                f"{short_repr(value)}"
            )
        setattr(spec, name, value)
    inference = raw.get("inference") or {}
    if not isinstance(inference, dict):
        raise ConfigError(f"{where}: eval.inference must map names to {{variant, set}}")
    if inference and not spec.lengths:
        raise ConfigError(f"{where}: eval.inference needs eval.lengths (the lengths to score)")
    for name, item in inference.items():
        _plain_name(name, "eval.inference name", where)
        if name in variants:
            raise ConfigError(f"{where}: eval.inference.{name} has the name of a variant")
        if not isinstance(item, dict) or set(item) - {"variant", "set"} or "variant" not in item:
            raise ConfigError(
                f"{where}: eval.inference.{name} must be {{variant: NAME, set: {{field: value}}}}"
            )
        if item["variant"] not in variants:
            raise ConfigError(
                f"{where}: eval.inference.{name}.variant {short_repr(item['variant'])} is not a "
                f"variant; variants: {', '.join(variants)}"
            )
        sets = item.get("set") or {}
        if not isinstance(sets, dict):
            raise ConfigError(f"{where}: eval.inference.{name}.set must map fields to values")
        overrides = [f"{k}={json.dumps(v)}" for k, v in sets.items()]  # JSON is YAML
        for o in overrides:
            try:
                check_inference_override(o)
            except ConfigError as e:
                raise ConfigError(f"{where}: eval.inference.{name}: {e}") from None
        spec.inference[name] = InferenceVariant(item["variant"], overrides)
    return spec


def experiment_from_dict(raw: Any, path: Path | None = None) -> Experiment:
    """Parse and validate an experiment mapping; every variant's config is built and validated.

    Raises ConfigError naming the file and the field (or variant) at fault."""
    where = str(path) if path else "experiment"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must hold a mapping ({', '.join(TOP_LEVEL)})")
    for key in raw:
        if key not in TOP_LEVEL:
            raise ConfigError(
                f"{where}: unknown field {short_repr(key)}; allowed: {', '.join(TOP_LEVEL)}"
            )
    for key in ("name", "base", "variants", "seeds", "budget"):
        if raw.get(key) is None:
            raise ConfigError(f"{where}: {key} is missing")
    name = _plain_name(raw["name"], "name", where)
    claim = str(raw.get("claim") or raw.get("description") or "").strip()
    variants = raw["variants"]
    if not isinstance(variants, dict) or not variants:
        raise ConfigError(
            f"{where}: variants must map at least one name to its overrides "
            "(e.g. variants: {base: {}, wide: {model.d_model: 256}})"
        )
    parsed: dict[str, dict[str, Any]] = {}
    for vname, overrides in variants.items():
        _plain_name(vname, "variant name", where)
        if overrides is None:
            overrides = {}
        if not isinstance(overrides, dict):
            raise ConfigError(
                f"{where}: variant {vname!r} must map dotted fields to values, got "
                f"{short_repr(overrides)}"
            )
        parsed[str(vname)] = dict(overrides)
    seeds = raw["seeds"]
    if (
        not isinstance(seeds, list)
        or not seeds
        or any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in seeds)
    ):
        raise ConfigError(
            f"{where}: seeds must be a non-empty list of integers >= 0, got {short_repr(seeds)}"
        )
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"{where}: seeds repeat a value: {short_repr(seeds)}")
    decode = raw.get("decode_tokens", 64)
    if not isinstance(decode, int) or isinstance(decode, bool) or not 1 <= decode <= MAX_DECODE:
        raise ConfigError(
            f"{where}: decode_tokens must be an integer >= 1 (at most {MAX_DECODE:,}), got "
            f"{short_repr(decode)}"
        )
    exp = Experiment(
        name=name,
        claim=claim,
        path=path,
        base=_load_base(raw["base"], path, where),
        variants=parsed,
        seeds=list(seeds),
        budget=_budget(raw["budget"], where),
        eval=_eval(raw.get("eval"), parsed, where),
        decode_tokens=decode,
    )
    owned = {"train.seed": "seeds"}  # fields the experiment sets itself, after the overrides
    if exp.budget.kind != "time_s":  # (a time budget keeps train.max_steps as its cap)
        owned["train.max_steps"] = "budget"
    for vname, overrides in parsed.items():
        for key in overrides:
            if key in owned:
                raise ConfigError(
                    f"{where}: variant {vname!r} sets {key}, which the experiment's "
                    f"{owned[key]} field sets for every variant; remove it"
                )
    for vname in parsed:  # every variant's config must be valid before anything trains
        cfg = exp.config(vname, seeds[0])
        if exp.eval.passkey is not None:
            from lmlab.evaluation.passkey import check_passkey_config

            check_passkey_config(
                exp.eval.passkey,
                cfg.data.corpus,
                cfg.model.max_seq_len,
                f"{where}: variant {vname!r}",
            )
    return exp


def load_experiment(path: str | Path) -> Experiment:
    """Read and validate an experiment YAML (a regular file of at most
    :data:`lmlab.config.CONFIG_MAX_BYTES`, parsed by :func:`lmlab.safeio.parse_yaml`: duplicate
    keys refused, aliases bounded). Raises ConfigError naming the file and field."""
    p = Path(path)
    return experiment_from_dict(read_yaml(p, "experiment file"), p)
