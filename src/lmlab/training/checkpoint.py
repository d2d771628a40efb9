"""Atomic checkpoints: ``RUN/checkpoints/step-NNNNNN/`` folders and a ``latest`` pointer.

A checkpoint folder holds ``model.safetensors``, ``optimizer.safetensors`` and
``trainer_state.json``. It is written under a temporary name, every file fsynced, then renamed into
place; ``checkpoints/latest`` (a one-line text file naming the folder) is replaced last. A run
killed at any moment therefore always finds a complete checkpoint through ``latest``. The free
space is checked before writing; a full disk or read-only folder is one LmlabError, with the
temporary folder removed and the previous checkpoint and ``latest`` untouched.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

from lmlab.errors import CheckpointError
from lmlab.fsutil import check_free_space, writing

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "trainer_state.json"
LATEST = "latest"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def optimizer_tensors(
    optimizer: torch.optim.Optimizer, model: nn.Module
) -> dict[str, torch.Tensor]:
    """The optimizer state as flat tensors keyed ``<param name>::<state key>``."""
    names = _optimizer_param_names(optimizer, model)
    out: dict[str, torch.Tensor] = {}
    for idx, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            out[f"{names[idx]}::{key}"] = t.detach().cpu().contiguous()
    return out


def load_optimizer_tensors(
    optimizer: torch.optim.Optimizer, model: nn.Module, tensors: dict[str, torch.Tensor]
) -> None:
    """Inverse of :func:`optimizer_tensors`. Raises CheckpointError on a parameter mismatch."""
    names = _optimizer_param_names(optimizer, model)
    index = {n: i for i, n in enumerate(names)}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        pname, _, skey = key.partition("::")
        if pname not in index:
            raise CheckpointError(f"optimizer state names unknown parameter {pname!r}")
        state.setdefault(index[pname], {})[skey] = value
    sd = optimizer.state_dict()
    sd["state"] = state
    optimizer.load_state_dict(sd)


def _optimizer_param_names(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]


def checkpoint_bytes(model: nn.Module, optimizer_state: dict[str, torch.Tensor] | None) -> int:
    """Bytes a checkpoint of ``model`` (tied weights once) and ``optimizer_state`` takes on
    disk, within the safetensors headers (a few kB per file)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in model.state_dict().values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())  # a tied weight: once
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    for t in (optimizer_state or {}).values():
        total += t.numel() * t.element_size()
    return total + 64 * 1024


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any],
    keep: int = 3,
) -> Path:
    """Write checkpoint ``step`` atomically, point ``latest`` at it, keep the newest ``keep``.

    Returns the checkpoint folder. Tied weights are stored once (safetensors ``save_model``).
    The free space is checked first (:func:`checkpoint_bytes`); raises LmlabError naming the
    folder and the bytes needed when it is short or a write meets a full disk or a read-only
    folder. On any failure the temporary folder is removed and the previous checkpoint and
    ``latest`` are left as they were.
    """
    root = Path(run_dir) / "checkpoints"
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}-{os.getpid()}"
    tensors = optimizer_tensors(optimizer, model) if optimizer is not None else None
    needed = checkpoint_bytes(model, tensors)
    with writing(root, needed):
        root.mkdir(parents=True, exist_ok=True)
        check_free_space(root, needed, f"checkpoint {final.name}")
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            save_model(model, str(tmp / MODEL_FILE))
            if tensors is not None:
                save_file(tensors, str(tmp / OPTIMIZER_FILE))
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
            publish_checkpoint(tmp, final, keep)
        except SafetensorError as e:  # safetensors reports a failed write as its own error
            if "No space left" in str(e) or "os error 28" in str(e):
                raise OSError(errno.ENOSPC, "No space left on device", str(tmp)) from None
            raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def publish_checkpoint(tmp: Path, final: Path, keep: int) -> None:
    """Make a fully written temporary checkpoint folder the latest one, atomically: fsync every
    file, rename the folder into place, then replace ``latest``; prune to the newest ``keep``.

    A failure before ``latest`` is replaced leaves ``latest`` and every older checkpoint as they
    were (a checkpoint renamed into place but never pointed at is removed again)."""
    root = final.parent
    for f in sorted(tmp.rglob("*"), reverse=True):  # files before the folders holding them
        if f.is_file():
            os.chmod(f, 0o644)  # safetensors creates 0600 files; a run folder is shareable
        _fsync(f)
    _fsync(tmp)
    old = root / f".old-{final.name}-{os.getpid()}"
    if final.exists():  # re-saving the same step (e.g. a resumed run that was already complete)
        os.replace(final, old)
    os.replace(tmp, final)
    pointer = root / f".{LATEST}.tmp"
    try:
        _fsync(root)
        pointer.write_text(final.name + "\n")
        _fsync(pointer)
        os.replace(pointer, root / LATEST)
    except BaseException:
        pointer.unlink(missing_ok=True)
        shutil.rmtree(final, ignore_errors=True)
        if old.exists():
            os.replace(old, final)
        raise
    _fsync(root)
    shutil.rmtree(old, ignore_errors=True)
    _prune(root, keep, final.name)


def _prune(root: Path, keep: int, current: str) -> None:
    steps = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))
    for old in steps[: max(0, len(steps) - keep)]:
        if old.name != current:
            shutil.rmtree(old, ignore_errors=True)
    for stale in [*root.glob(".tmp-*"), *root.glob(".old-*")]:
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


def has_checkpoint(run_dir: str | Path) -> bool:
    """Whether a folder holds at least one checkpoint (complete or pointed at)."""
    root = Path(run_dir) / "checkpoints"
    return (root / LATEST).exists() or any(root.glob("step-*"))


def other_checkpoints(ckpt: Path) -> str:
    """A hint naming the other checkpoints beside ``ckpt`` (for a corrupt latest one)."""
    others = sorted(p.name for p in ckpt.parent.glob("step-*") if p != ckpt and p.is_dir())
    if not others:
        return ""
    return (
        f"; older checkpoints exist ({', '.join(others)}): to use one, write its name into "
        f"{ckpt.parent / LATEST}"
    )


def latest_checkpoint(run_dir: str | Path) -> Path:
    """The folder ``latest`` points at. Raises CheckpointError if the run has no checkpoint."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / LATEST
    if pointer.is_file():
        try:
            name = pointer.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            name = ""
        if not re.fullmatch(r"step-\d+", name):
            raise CheckpointError(
                f"{pointer} is empty or damaged; write a step-NNNNNN name into it"
            )
        ckpt = root / name
        if not ckpt.is_dir():
            raise CheckpointError(f"{pointer} names {ckpt.name}, which does not exist")
        return ckpt
    complete = sorted(p for p in root.glob("step-*") if (p / STATE_FILE).is_file())
    if complete:
        return complete[-1]
    raise CheckpointError(
        f"{run_dir} has no checkpoint yet; train it first (lmlab train --out {run_dir} starts it "
        "afresh)"
    )


def read_trainer_state(ckpt: Path) -> dict[str, Any]:
    """The JSON trainer state of a checkpoint folder. Raises CheckpointError if unreadable."""
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {ckpt} is corrupt: cannot read {STATE_FILE} ({e})"
        ) from None
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: {STATE_FILE} has no step")
    return state


def load_model_weights(ckpt: Path, model: nn.Module) -> None:
    """Load ``model.safetensors`` into ``model`` (strict). Raises CheckpointError if the file is
    missing, truncated or corrupt, or its tensors do not fit the model."""
    path = ckpt / MODEL_FILE
    if not path.is_file():
        raise CheckpointError(f"checkpoint {ckpt} is incomplete: {MODEL_FILE} is missing")
    try:
        missing, unexpected = load_model(model, str(path), strict=False)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {_short(e)}") from None
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path} does not fit this model (missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]})"
        )
    bad = [
        n for n, t in model.state_dict().items() if t.is_floating_point() and not t.isfinite().all()
    ]
    if bad:
        raise CheckpointError(f"checkpoint file {path} is corrupt: non-finite values in {bad[0]}")


def load_optimizer(ckpt: Path, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Load ``optimizer.safetensors`` into ``optimizer``. Raises CheckpointError when corrupt."""
    path = ckpt / OPTIMIZER_FILE
    if not path.is_file():
        raise CheckpointError(f"checkpoint {ckpt} is incomplete: {OPTIMIZER_FILE} is missing")
    try:
        tensors = load_file(str(path))
        load_optimizer_tensors(optimizer, model, tensors)
    except (SafetensorError, OSError, ValueError, RuntimeError, KeyError) as e:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {_short(e)}") from None


def _short(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


def load_checkpoint(
    ckpt: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load weights (and optimizer state) from a checkpoint folder; return its trainer state.

    Raises CheckpointError naming the damaged file and any older checkpoints beside it.
    """
    try:
        state = read_trainer_state(ckpt)
        load_model_weights(ckpt, model)
        if optimizer is not None:
            load_optimizer(ckpt, optimizer, model)
    except CheckpointError as e:
        raise CheckpointError(f"{e}{other_checkpoints(ckpt)}") from None
    return state
