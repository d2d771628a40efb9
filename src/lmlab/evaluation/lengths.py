"""Perplexity at several context lengths (length extrapolation), with inference-time overrides.

The same text is cut into non-overlapping windows of each length L; every token but the first is
scored exactly once at every length, so the losses compare. The text is first cut to 1 + k * M
tokens, M the longest length it holds, so every window of a length that divides M is full.

What each position kind does past the training context (``model.max_seq_len``):

- ``none`` (NoPE): no parameter depends on position; the causal mask alone carries order, so any
  length runs (Haviv et al. 2022).
- ``sinusoidal``: the table is computed for any position, but rows past the training length were
  never seen in training (Vaswani et al. 2017).
- ``learned``: the table has ``max_seq_len`` rows; longer windows cannot be scored at all and are
  reported as such, never crashed on (GPT-2).
- ``alibi``: a bias linear in the query-key distance, defined at any length and designed to
  extrapolate (Press et al. 2022, "Train Short, Test Long").
- ``rope``: rotations are defined at any position, but low-frequency pairs reach angles never seen
  in training; ``model.position.scaling`` (linear, ntk, dynamic_ntk, yarn) rescales them at
  inference (Chen et al. 2023; bloc97 2023; Peng et al. 2023), with the training length as
  ``original_max_seq_len`` unless set.

Nothing in the model enforces ``max_seq_len`` except the learned table, so evaluation needs no
relaxed check: the length is the window given to :func:`~lmlab.evaluation.evaluate.score_tokens`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from lmlab.config import MAX_TOKENS, ModelConfig, apply_override, config_from_dict
from lmlab.data.corpus import load_data, read_text
from lmlab.errors import ConfigError, LmlabError
from lmlab.evaluation.evaluate import score_tokens, token_byte_lengths

# Config fields that may change at evaluation: they change no weight, only how positions are read.
INFERENCE_FIELDS = ("model.position.scaling.",)


@dataclass
class LengthRow:
    """One context length. loss in nats/token (None: this length cannot be scored, see note)."""

    length: int
    loss: float | None
    perplexity: float | None
    tokens: int  # tokens scored
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class LengthsResult:
    """Scores of one model at several lengths. ``trained_len``: its ``model.max_seq_len``."""

    model: str
    position: str
    trained_len: int
    overrides: list[str]
    text: str
    rows: list[LengthRow] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["rows"] = [r.as_dict() for r in self.rows]
        return out


MAX_LENGTH = MAX_TOKENS  # tokens: the bound of model.max_seq_len


def parse_lengths(text: str | list[int]) -> list[int]:
    """``"128,256,512"`` (or a list) -> [128, 256, 512]. Raises LmlabError unless every item is a
    positive integer of at most MAX_LENGTH (duplicates are dropped, order kept)."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[int] = []
    for item in items:
        try:
            n = int(str(item).strip())
        except ValueError:
            n = 0
        if not 1 <= n <= MAX_LENGTH or str(item).strip() != str(n):
            raise LmlabError(
                f"--lengths expects comma-separated positive integers (tokens, at most "
                f"{MAX_LENGTH:,}), got {str(item)[:40]!r}"
            )
        if n not in out:
            out.append(n)
    if not out:
        raise LmlabError("--lengths needs at least one length")
    return out


def check_inference_override(item: str) -> None:
    """Refuse an override of a field that the trained weights fix (only position scaling may
    change at evaluation). ``item``: ``dotted.key=value``. Raises ConfigError naming the field."""
    key = item.split("=", 1)[0].strip()
    if "=" not in item:
        raise ConfigError(f"--set expects dotted.key=value, got {item!r}")
    if not key.startswith(INFERENCE_FIELDS):
        raise ConfigError(
            f"--set {key}: only inference-time position settings can change at evaluation "
            f"({', '.join(f + '*' for f in INFERENCE_FIELDS)}); the trained weights fix the rest"
        )


def apply_inference_overrides(model: nn.Module, overrides: list[str]) -> nn.Module:
    """A copy of ``model`` built from its config with ``overrides`` (``dotted.key=value``, each a
    ``model.position.scaling.*`` field) and the same weights (strict load).

    Raises ConfigError for another field, an unknown one, or a value the config refuses (e.g.
    scaling on a non-RoPE model)."""
    if not overrides:
        return model
    for item in overrides:
        check_inference_override(item)
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    data: dict[str, Any] = {"model": cfg.to_dict()}
    for item in overrides:
        apply_override(data, item)
    new_cfg = config_from_dict(data).validate().model
    from lmlab.models.build import build_model

    device = next(model.parameters()).device
    new = build_model(new_cfg)
    new.load_state_dict(model.state_dict(), strict=True)
    return new.to(device).eval()


def extrapolation_note(cfg: ModelConfig, length: int) -> str:
    """Why ``length`` cannot be scored by this model, or '' if it can."""
    if cfg.position.kind == "learned" and length > cfg.max_seq_len:
        return (
            f"cannot extrapolate: learned positions have no embedding past position "
            f"{cfg.max_seq_len - 1} (model.max_seq_len={cfg.max_seq_len})"
        )
    return ""


def equal_token_ids(ids: np.ndarray, lengths: list[int]) -> np.ndarray:
    """Cut ``ids`` (N,) to 1 + k * M tokens, M the longest of ``lengths`` that is <= N - 1, so
    every window of a length dividing M is full; unchanged if no length fits."""
    targets = len(ids) - 1
    fitting = [n for n in lengths if n <= targets]
    if not fitting:
        return ids
    m = max(fitting)
    return ids[: 1 + (targets // m) * m]


def score_lengths(
    model: nn.Module,
    ids: np.ndarray,
    token_bytes: np.ndarray,
    lengths: list[int],
    batch_size: int = 8,
) -> list[LengthRow]:
    """Loss at each context length over ``ids`` (N,) int64, non-overlapping windows.

    A length the model cannot run (learned positions past max_seq_len) gives a row with loss None
    and a note. Raises DataError for fewer than 2 tokens."""
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    rows = []
    for n in lengths:
        note = extrapolation_note(cfg, n)
        if note:
            rows.append(LengthRow(n, None, None, 0, note))
            continue
        res = score_tokens(model, ids, token_bytes, n, None, batch_size)
        rows.append(LengthRow(n, res.loss, res.perplexity, res.tokens))
    return rows


def eval_lengths(
    path: str | Path,
    lengths: list[int] | str | None,
    overrides: list[str] | None = None,
    split: str = "val",
    data: str | None = None,
    max_tokens: int | None = None,
    device: str = "auto",
    batch_size: int = 8,
) -> LengthsResult:
    """Perplexity of the model at ``path`` (anything :func:`lmlab.load` accepts) at each context
    length (None: only the trained context ``max_seq_len``), on a run's corpus split or on
    ``data`` (a UTF-8 text file; needed for a model folder that is not an lmlab run).
    ``overrides``: ``model.position.scaling.*=value`` items applied at inference.
    ``max_tokens``: keep the first N tokens of the text.

    Raises LmlabError for bad lengths or overrides, a model without tokenizer, a missing text."""
    from lmlab.interop.load import load
    from lmlab.run import CONFIG_FILE, read_run_config
    from lmlab.training.hardware import resolve_device

    wanted = None if lengths is None else parse_lengths(lengths)
    overrides = list(overrides or [])
    for item in overrides:
        check_inference_override(item)
    if max_tokens is not None and max_tokens < 2:
        raise LmlabError(
            f"--max-tokens must be >= 2 (one token predicts the next), got {max_tokens}"
        )
    p = Path(path)
    model, tokenizer = load(p, str(resolve_device(device)))
    if tokenizer is None:
        raise LmlabError(f"{p} has no tokenizer.json, so no text can be scored with it")
    if data is not None:
        text, where = read_text(data), str(data)
    elif (p / CONFIG_FILE).is_file():
        if split not in ("train", "val", "test"):
            raise LmlabError(f"--split must be train, val or test, got {split!r}")
        run_cfg = read_run_config(p)
        text = load_data(run_cfg.data).split(split)
        where = f"{run_cfg.data.corpus} {split} split"
    else:
        raise LmlabError(f"{p} is not an lmlab run folder, so it has no corpus: give --data FILE")
    model = apply_inference_overrides(model, overrides)
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    if cfg.kind != "decoder":  # next-token loss only means something for a causal LM
        raise LmlabError(
            f"--lengths scores next-token loss, which needs a decoder; {p} is model.kind="
            f"{cfg.kind} (use plain lmlab eval for it)"
        )
    lengths = wanted or [cfg.max_seq_len]
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    ids = equal_token_ids(ids, lengths)
    rows = score_lengths(model, ids, token_byte_lengths(tokenizer), lengths, batch_size)
    return LengthsResult(str(p), cfg.position.kind, cfg.max_seq_len, overrides, where, rows)


def format_lengths(res: LengthsResult) -> str:
    """The table ``lmlab eval --lengths`` prints."""
    extra = f", overrides {' '.join(res.overrides)}" if res.overrides else ""
    lines = [
        f"{res.model}: position {res.position}, trained context {res.trained_len} tokens{extra}",
        f"text: {res.text}",
        f"{'length':>8}  {'loss':>8}  {'perplexity':>10}  {'tokens':>8}",
    ]
    for r in res.rows:
        if r.loss is None:
            lines.append(f"{r.length:>8}  {'n/a':>8}  {'n/a':>10}  {'-':>8}  {r.note}")
        else:
            past = "  (past the trained context)" if r.length > res.trained_len else ""
            lines.append(
                f"{r.length:>8}  {r.loss:>8.4f}  {r.perplexity:>10.3f}  {r.tokens:>8}{past}"
            )
    return "\n".join(lines)


def plot_lengths(
    curves: dict[str, list[tuple[int, float | None]]],
    out: str | Path,
    trained_len: int | None = None,
    title: str = "loss vs context length",
    bands: dict[str, tuple[list[float], list[float]]] | None = None,
) -> Path:
    """Write a PNG: loss (nats/token) against context length (log2 axis), one line per curve.

    curves: name -> [(length, loss or None)]; None points (lengths a model cannot run) are left
    out. bands: name -> (low, high) per point, drawn as a shaded min/max band. A dashed line marks
    ``trained_len``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in curves.items():
        xs = [n for n, v in points if v is not None and math.isfinite(v)]
        ys = [v for _, v in points if v is not None and math.isfinite(v)]
        if not xs:
            continue
        (line,) = ax.plot(xs, ys, "o-", label=name, ms=4)
        if bands and name in bands:
            lo, hi = bands[name]
            keep = [i for i, (_, v) in enumerate(points) if v is not None and math.isfinite(v)]
            ax.fill_between(
                xs, [lo[i] for i in keep], [hi[i] for i in keep], color=line.get_color(), alpha=0.2
            )
    if trained_len:
        ax.axvline(trained_len, ls="--", color="gray", lw=1, label=f"trained ({trained_len})")
    ax.set_xscale("log", base=2)
    ticks = sorted({n for points in curves.values() for n, _ in points})
    ax.set_xticks(ticks, [str(n) for n in ticks])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    target = Path(out)
    if target.suffix.lower() != ".png":  # matplotlib would add .png to a bare name, or refuse
        plt.close(fig)
        raise LmlabError(f"--plot {target}: give a .png file name")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(target, dpi=100)
    except OSError as e:
        raise LmlabError(f"cannot write plot {target}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return target
