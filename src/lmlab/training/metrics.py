"""Run metrics: ``metrics.jsonl`` (one JSON object per line), TensorBoard events, ``loss.png``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


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
        self._fh.write(json.dumps(record) + "\n")
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


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of ``metrics.jsonl`` (a torn last line from a crash is skipped)."""
    path = Path(run_dir) / METRICS_FILE
    out: list[dict[str, Any]] = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def truncate_metrics(run_dir: str | Path, last_step: int) -> None:
    """Drop records after ``last_step`` (written after the checkpoint a run resumes from).

    The file is replaced atomically, so a run killed while resuming keeps its history."""
    from lmlab.fsutil import atomic_write_text

    path = Path(run_dir) / METRICS_FILE
    if path.is_file():
        keep = [r for r in read_metrics(run_dir) if int(r.get("step", 0)) <= last_step]
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
        rows = [r for r in records if key in r]
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
