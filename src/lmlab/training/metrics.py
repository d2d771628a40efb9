"""Run metrics: ``metrics.jsonl`` (one JSON object per line), TensorBoard events, ``loss.png``.

A record holds ``step`` (optimizer steps) and ``tokens`` (tokens seen), both non-negative
integers, and ``elapsed_s`` (seconds of training); the other numbers (``lr``, ``train_loss``,
``val_loss`` in nats/token, ``tokens_per_s``, ``mfu``, ``grad_norm``, ``aux_loss``) are finite or
null (a non-finite value is written as null, so the file stays strict JSON). Reading checks every
line (:func:`read_metrics`).
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

from lmlab.errors import LmlabError
from lmlab.safeio import GiB, read_text

METRICS_FILE = "metrics.jsonl"
METRICS_BYTES = 1 * GiB  # about three million records
MAX_STEP = 10**12
MAX_TOKENS = 10**18
# finite numbers or null; elapsed_s is also required and >= 0
NUMBER_FIELDS = ("lr", "train_loss", "val_loss", "tokens_per_s", "mfu", "grad_norm", "aux_loss")


class MetricsLogger:
    """Appends records to ``RUN/metrics.jsonl`` and mirrors scalars to TensorBoard (``RUN/tb``)."""

    def __init__(
        self, run_dir: str | Path, tensorboard: bool = True, purge_step: int | None = None
    ) -> None:
        """``purge_step``: on resume, TensorBoard drops events logged after this step."""
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self._fh = self.path.open("a", encoding="utf-8")
        self._tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=purge_step)
            except ImportError:  # tensorboard is a dependency; tolerate a broken install
                self._tb = None

    def log(self, record: dict[str, Any]) -> None:
        """Append ``record`` (non-finite numbers written as null) and mirror its scalars."""
        record = {k: None if _non_finite(v) else v for k, v in record.items()}
        self._fh.write(json.dumps(record, allow_nan=False) + "\n")
        self._fh.flush()
        if self._tb is not None:
            step = int(record["step"])
            for key, value in record.items():
                if (
                    key != "step"
                    and isinstance(value, (int, float))
                    and not isinstance(value, bool)
                ):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._fh.close()
        if self._tb is not None:
            self._tb.close()


def _non_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_record(record: Any, where: str) -> dict[str, Any]:
    """``record`` (one parsed line of metrics.jsonl) when it is an object with non-negative
    integer ``step`` and ``tokens``, a finite ``elapsed_s`` >= 0, finite-or-null numbers in
    :data:`NUMBER_FIELDS`, and well-typed ``clipped``, ``skipped``, ``expert_counts``. Raises
    LmlabError naming ``where`` (file and line) and the field."""
    if not isinstance(record, dict):
        raise LmlabError(f"{where} is not a JSON object")
    for key, hi in (("step", MAX_STEP), ("tokens", MAX_TOKENS)):
        value = record.get(key)
        if not (_number(value) and isinstance(value, int) and 0 <= value <= hi):
            raise LmlabError(f"{where}: {key} must be an integer from 0 to {hi:,}, not {value!r}")
    elapsed: Any = record.get("elapsed_s")
    if not (_number(elapsed) and math.isfinite(elapsed) and elapsed >= 0):
        raise LmlabError(f"{where}: elapsed_s must be a finite number >= 0, not {elapsed!r}")
    for key in NUMBER_FIELDS:
        value = record.get(key)
        if value is not None and not (_number(value) and math.isfinite(value)):
            raise LmlabError(f"{where}: {key} must be a finite number or null, not {value!r}")
    if "clipped" in record and not isinstance(record["clipped"], bool):
        raise LmlabError(f"{where}: clipped must be true or false")
    if "skipped" in record and not isinstance(record["skipped"], str):
        raise LmlabError(f"{where}: skipped must be a string")
    counts = record.get("expert_counts")
    if counts is not None and not (
        isinstance(counts, list)
        and all(isinstance(row, list) and all(_number(c) for c in row) for row in counts)
    ):
        raise LmlabError(f"{where}: expert_counts must be a list of lists of numbers")
    return record


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of ``metrics.jsonl`` ([] when there is none), each checked by
    :func:`check_record`. A torn last line (no newline: a crash mid-write) is skipped; any other
    line that is not a valid record raises LmlabError naming the file, line and field (also for
    a file that is not UTF-8 or is over 1 GiB, a FIFO or other special file, or a symlink that
    leads outside ``run_dir``)."""
    from lmlab.safeio import inside, parse_json

    path = Path(run_dir) / METRICS_FILE
    if not path.exists() and not path.is_symlink():
        return []
    inside(run_dir, METRICS_FILE, "metrics file")
    text = read_text(path, "metrics file", METRICS_BYTES)
    lines = text.split("\n")
    torn = lines.pop()  # '' when the file ends with a newline
    out: list[dict[str, Any]] = []
    for n, line in enumerate(lines, 1):
        where = f"metrics file {path} line {n}"
        out.append(check_record(parse_json(line, where), where))
    if torn.strip():
        where = f"metrics file {path} line {len(lines) + 1}"
        with contextlib.suppress(LmlabError):  # else a record cut short by a crash: dropped
            out.append(check_record(parse_json(torn, where), where))
    return out


def truncate_metrics(run_dir: str | Path, last_step: int) -> None:
    """Drop records after ``last_step`` (written after the checkpoint a run resumes from).

    Every line is checked first (:func:`read_metrics`): a damaged file raises LmlabError and is
    left as it was. The file is replaced atomically, so a run killed while resuming keeps its
    history."""
    from lmlab.fsutil import atomic_write_text

    path = Path(run_dir) / METRICS_FILE
    if path.exists() or path.is_symlink():  # a FIFO or a link out is refused, not skipped
        keep = [r for r in read_metrics(run_dir) if r["step"] <= last_step]
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in keep))


def plot_losses(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``loss.png``: train and val loss (nats/token) vs step (left) and vs tokens (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    target = Path(out) if out else Path(run_dir) / "loss.png"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key, style in (("train_loss", "-"), ("val_loss", "o-")):
        rows = [r for r in records if r.get(key) is not None]
        for ax, xkey in zip(axes, ("step", "tokens"), strict=True):
            ax.plot([r[xkey] for r in rows], [r[key] for r in rows], style, label=key, ms=3)
    for ax, xlabel in zip(axes, ("optimizer step", "tokens seen"), strict=True):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(Path(run_dir).name)
    fig.tight_layout()
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target
