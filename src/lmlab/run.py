"""A run folder: its layout, and loading a trained model back from it.

``RUN/config.yaml`` (the resolved config), ``RUN/tokenizer.json``, ``RUN/data/`` (token cache),
``RUN/checkpoints/step-NNNNNN/`` + ``latest``, ``RUN/metrics.jsonl``, ``RUN/tb/``, ``RUN/loss.png``.
A run folder never holds ``config.json`` (that marks a Hugging Face model folder). lmlab reads
a run's files only inside its folder: a file or checkpoint that is a symlink leading out of it is
refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lmlab.config import RunConfig, load_config
from lmlab.data.tokenizer import Tokenizer, load_tokenizer
from lmlab.errors import LmlabError
from lmlab.models.build import build_model
from lmlab.safeio import inside
from lmlab.training.checkpoint import latest_checkpoint, load_checkpoint
from lmlab.training.hardware import resolve_device

CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.json"


@dataclass
class LoadedRun:
    """A trained model ready to use: eval mode, on ``device``."""

    path: Path
    config: RunConfig
    tokenizer: Tokenizer
    model: nn.Module
    step: int
    checkpoint: Path
    device: torch.device


def run_file(run_dir: str | Path, name: str) -> Path:
    """``run_dir / name``, refused with LmlabError when it is a symlink leading out of the run."""
    outside = (
        f"{Path(run_dir) / name} leads outside the run folder {run_dir} (a symlink); lmlab "
        "reads a run's files only inside it"
    )
    return inside(run_dir, name, "run file", outside=outside)


def read_run_config(run_dir: str | Path) -> RunConfig:
    """The resolved config of a run folder. Raises LmlabError if the folder is not a run."""
    p = Path(run_dir)
    if not p.is_dir():
        raise LmlabError(f"run folder not found: {p}")
    if not (p / CONFIG_FILE).is_file():
        hint = " (it looks like a Hugging Face folder)" if (p / "config.json").is_file() else ""
        raise LmlabError(f"{p} is not an lmlab run folder: it has no {CONFIG_FILE}{hint}")
    return load_config(run_file(p, CONFIG_FILE))


def load_run_tokenizer(run_dir: str | Path, cfg: RunConfig) -> Tokenizer:
    """The run's ``tokenizer.json``. Raises LmlabError if it is missing or corrupt, or if its
    vocabulary differs from the model's (a tokenizer.json copied from another run)."""
    path = run_file(run_dir, TOKENIZER_FILE)
    tokenizer = load_tokenizer(path)
    if tokenizer.vocab_size != cfg.model.vocab_size:
        raise LmlabError(
            f"{path} has {tokenizer.vocab_size} tokens but {CONFIG_FILE} says model.vocab_size "
            f"is {cfg.model.vocab_size}: the two files come from different runs"
        )
    return tokenizer


def load_run(run_dir: str | Path, device: str = "auto") -> LoadedRun:
    """Load the latest checkpoint of a run folder.

    Raises LmlabError (or its CheckpointError subclass) when the folder is missing, is not a run,
    has no checkpoint yet, or holds a corrupt one.
    """
    p = Path(run_dir)
    cfg = read_run_config(p)
    ckpt = latest_checkpoint(p)
    tokenizer = load_run_tokenizer(p, cfg)
    dev = resolve_device(device)
    model = build_model(cfg.model)
    state = load_checkpoint(ckpt, model)
    model.to(dev).eval()
    return LoadedRun(p, cfg, tokenizer, model, int(state["step"]), ckpt, dev)
