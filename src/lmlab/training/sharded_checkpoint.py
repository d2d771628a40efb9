"""Sharded checkpoints of FSDP runs: torch.distributed.checkpoint (DCP) in the atomic layout.

A sharded checkpoint folder ``RUN/checkpoints/step-NNNNNN/`` holds

| path | what |
|---|---|
| ``sharded/.metadata`` | DCP's index of every tensor and shard (a Python pickle) |
| ``sharded/__R_0.distcp`` | rank R's shards of the model parameters and AdamW state |
| ``model.safetensors`` | the whole model, consolidated on rank 0 (``lmlab eval``/``generate``) |
| ``trainer_state.json`` | step, tokens, losses, world size (as in every checkpoint) |
| ``manifest.json`` | the SHA-256 of every file above, recorded at save time |

It is written under a temporary name, fsynced, renamed into place and published through
``checkpoints/latest`` exactly like a single-process checkpoint (:mod:`.checkpoint`), so a run
killed at any moment still resumes from a complete one. DCP stores each tensor with its global
shape, so a checkpoint written by W ranks loads into any number of ranks, or into one plain
process (DCP reshards on load).

DCP's ``.metadata`` is unpickled when read, so lmlab reads a sharded checkpoint only when every
file in it matches the manifest (no file missing, none added, none changed); anything else is
refused with :class:`~lmlab.errors.CheckpointError` before DCP opens a file. Only tensors are
saved (the optimizer's hyper-parameters come from the config), so DCP never needs to unpickle
non-tensor values from the shard files either.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_model
from torch import nn

from lmlab.config import ModelConfig
from lmlab.errors import CheckpointError, LmlabError
from lmlab.training.checkpoint import (
    MODEL_FILE,
    STATE_FILE,
    checkpoint_name,
    publish_checkpoint,
    read_trainer_state,
)

SHARDED_DIR = "sharded"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "lmlab-sharded-checkpoint-1"


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every save/load without a process group, even when asked for one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield


def is_sharded(ckpt: Path) -> bool:
    """Whether a checkpoint folder is a sharded (DCP) one."""
    return (ckpt / SHARDED_DIR).exists() or (ckpt / MANIFEST).exists()


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(folder: Path) -> dict[str, Path]:
    """Every entry under ``folder`` except folders and the manifest, by POSIX relative path."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_dir() and not p.is_symlink():
            continue
        rel = p.relative_to(folder).as_posix()
        if rel != MANIFEST:
            out[rel] = p
    return out


def write_manifest(folder: Path) -> dict[str, str]:
    """Record the SHA-256 of every file in ``folder`` in ``folder/manifest.json``; return it."""
    hashes = {rel: sha256(p) for rel, p in _files(folder).items()}
    data = {"format": MANIFEST_FORMAT, "sha256": hashes}
    (folder / MANIFEST).write_text(json.dumps(data, indent=1) + "\n")
    return hashes


def verify_manifest(ckpt: Path) -> None:
    """Check every file of a sharded checkpoint against its manifest before anything reads it.

    Raises CheckpointError naming the first file that is missing, added, a link, or whose
    SHA-256 differs from the one recorded at save time (and when the manifest itself is missing
    or unreadable).
    """
    refuse = (
        f"refusing to read checkpoint {ckpt}: DCP's metadata is a pickle, so lmlab reads a "
        f"sharded checkpoint only when every file matches the SHA-256 in its {MANIFEST}"
    )
    path = ckpt / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{refuse}, and there is no {MANIFEST}")
    try:
        data = json.loads(path.read_text())
        recorded = data["sha256"]
        if data.get("format") != MANIFEST_FORMAT or not isinstance(recorded, dict):
            raise ValueError("unknown format")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{refuse}, and the manifest is unreadable ({e})") from None
    present = _files(ckpt)
    for rel in sorted(set(present) | set(recorded)):
        if rel not in recorded:
            raise CheckpointError(f"{refuse}: {rel} is not in the manifest")
        if rel not in present:
            raise CheckpointError(f"{refuse}: {rel} is listed in the manifest but missing")
        p = present[rel]
        if p.is_symlink() or not p.is_file():
            raise CheckpointError(f"{refuse}: {rel} is a link or not a regular file")
        if sha256(p) != recorded[rel]:
            raise CheckpointError(
                f"{refuse}: {rel} does not match the manifest (it changed after it was saved)"
            )


def _check_tensors(tree: Mapping[str, Any], where: str = "") -> None:
    for key, value in tree.items():
        name = f"{where}.{key}" if where else str(key)
        if isinstance(value, Mapping):
            _check_tensors(value, name)
        elif not isinstance(value, torch.Tensor):
            raise LmlabError(  # a new optimizer with non-tensor state: DCP would pickle it
                f"sharded checkpoints store tensors only; {name} is a {type(value).__name__}"
            )


def _consolidated_model(model: nn.Module, model_cfg: ModelConfig) -> nn.Module | None:
    """The whole model on the CPU, on rank 0 (None elsewhere): the FSDP2 shards gathered into
    a plain model of the same config (collective: call on every rank). A plain (unsharded)
    model is returned as it is."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return model
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    if dist.get_rank() != 0:
        return None
    from lmlab.models.build import build_model

    with torch.device("meta"):
        plain = build_model(model_cfg)
    names: dict[int, list[str]] = {}  # tied weights: one parameter under several names
    for name, p in plain.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    plain.to_empty(device="cpu")  # new storage per module: re-tie below
    for first, *aliases in names.values():
        for alias in aliases:
            owner, _, attr = alias.rpartition(".")
            setattr(plain.get_submodule(owner), attr, plain.get_parameter(first))
    plain.load_state_dict(full)
    return plain


def save_sharded_checkpoint(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep: int,
    model_cfg: ModelConfig,
) -> Path:
    """Write a sharded checkpoint of ``step`` (layout in the module docstring) atomically, point
    ``latest`` at it and keep the newest ``keep``. Collective: every rank calls it (in one
    plain process it writes a single shard). The run folder must be on a filesystem every rank
    sees. Returns the checkpoint folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    distributed = dist.is_available() and dist.is_initialized()
    main = not distributed or dist.get_rank() == 0
    root = Path(run_dir) / "checkpoints"
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}-sharded"
    if main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    if distributed:
        dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    payload = {"model": model_sd, "optim": optim_sd["state"]}
    _check_tensors(payload)
    with _single_process_quiet():
        dcp.save(payload, checkpoint_id=tmp / SHARDED_DIR, no_dist=not distributed)
    plain = _consolidated_model(model, model_cfg)
    if main:
        assert plain is not None
        save_model(plain, str(tmp / MODEL_FILE))
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        write_manifest(tmp)
        publish_checkpoint(tmp, final, keep)
    if distributed:
        dist.barrier()
    return final


def load_sharded_checkpoint(
    ckpt: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load a sharded checkpoint into ``model`` (FSDP2-sharded over any number of ranks, or
    plain) and ``optimizer``; return its trainer state. Every file is checked against the
    manifest first (:func:`verify_manifest`). Collective in a process group. Raises
    CheckpointError for a tampered, incomplete or mismatched checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    verify_manifest(ckpt)
    state = read_trainer_state(ckpt)
    distributed = dist.is_available() and dist.is_initialized()
    if optimizer is None:
        model_sd = get_model_state_dict(model)
        payload: dict[str, Any] = {"model": model_sd}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        payload = {"model": model_sd, "optim": optim_sd["state"]}
    try:
        with _single_process_quiet():
            dcp.load(payload, checkpoint_id=ckpt / SHARDED_DIR, no_dist=not distributed)
    except Exception as e:  # DCP wraps every rank's failure in its own exception types
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {ckpt} does not fit this model: {first}") from None
    if optimizer is None:
        set_model_state_dict(model, payload["model"])
    else:
        optim_sd["state"] = payload["optim"]
        set_state_dict(
            model, optimizer, model_state_dict=payload["model"], optim_state_dict=optim_sd
        )
    return state
