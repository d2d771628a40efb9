"""Atomic checkpoints: ``RUN/checkpoints/step-NNNNNN/`` folders and a ``latest`` pointer.

A checkpoint folder holds ``model.safetensors``, ``optimizer.safetensors`` and
``trainer_state.json``. It is written under a temporary name, every file fsynced, then renamed into
place; ``checkpoints/latest`` (a one-line text file naming the folder) is replaced last. A run
killed at any moment therefore always finds a complete checkpoint through ``latest``. The free
space is checked before writing; a full disk or read-only folder is one LmlabError, with the
temporary folder removed and the previous checkpoint and ``latest`` untouched.

This is the only checkpoint format, in one process, DDP and FSDP2 alike (FSDP2 gathers its
shards first: :mod:`.sharded_checkpoint`); nothing in it is a pickle. Reading trusts nothing:
``latest`` must hold a ``step-NNNNNN`` name; ``checkpoints/``, the folder and its files must not
lead outside the run (symlinks); ``trainer_state.json`` is strict JSON with typed, ranged fields;
every weight is checked by name, shape and dtype against the model before it is loaded (an
error names the tensor, both shapes and the config field that likely changed); optimizer state
is checked for keys, shapes, dtype and finiteness before the optimizer sees it. Reading writes
nothing.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file, save_model
from torch import nn

from lmlab.errors import CheckpointError, LmlabError
from lmlab.fsutil import check_free_space, writing
from lmlab.safeio import KiB, MiB, inside, read_bytes, read_json_object
from lmlab.training.weights_fit import check_finite, check_weights_fit, safetensors_header

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
# optimizer.safetensors header metadata: a JSON list of the parameters that have state, so a file
# that lost some of them is told from a run whose parameters never got a gradient (which have no
# state either: an encoder's pooler, an MoE expert no token reached)
STATE_PARAMS_KEY = "lmlab.params_with_state"
STATE_FILE = "trainer_state.json"
LATEST = "latest"
LEGACY_SHARDED_DIR = "sharded"  # earlier lmlab's torch.distributed.checkpoint shards: refused
POINTER_BYTES = 4 * KiB  # checkpoints/latest
STATE_BYTES = 1 * MiB  # trainer_state.json
MAX_STEP = 10**12  # optimizer steps
MAX_TOKENS = 10**18


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
    """The optimizer state as flat tensors keyed ``<param name>::<state key>``.

    The state of FSDP2-sharded parameters (DTensors) is gathered into whole tensors: then the
    call is collective (every rank calls it, in the same order)."""
    names = _optimizer_param_names(optimizer, model)
    out: dict[str, torch.Tensor] = {}
    for idx, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            out[f"{names[idx]}::{key}"] = whole_tensor(t).detach().cpu().contiguous()
    return out


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole (global) tensor, gathered from every rank (collective); else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _place(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``whole`` laid out like ``like``: for a DTensor, this rank's shard of it under the same
    mesh and placements (cut from the local copy, no communication: every rank has read the same
    file); else ``whole`` itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return whole
    local = whole.to(like.device)
    return distribute_tensor(local, like.device_mesh, like.placements, src_data_rank=None)


def _known_state_keys(optimizer: torch.optim.Optimizer) -> tuple[str, ...] | None:
    """The per-parameter state keys of Adam/AdamW or Muon (None for another optimizer: not
    checked)."""
    if isinstance(optimizer, torch.optim.Muon):
        return ("momentum_buffer",)
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return None
    amsgrad = any(g.get("amsgrad") for g in optimizer.param_groups)
    return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())


def _state_keys(optimizer: torch.optim.Optimizer) -> list[tuple[str, tuple[str, ...] | None]]:
    """For each parameter (in ``param_groups`` order) the name of the optimizer that holds it
    and the state keys it keeps (a combined optimizer such as
    :class:`~lmlab.training.optim.MuonWithAdamW` lists its parts in ``optimizers``)."""
    out: list[tuple[str, tuple[str, ...] | None]] = []
    for part in getattr(optimizer, "optimizers", (optimizer,)):
        n = sum(len(g["params"]) for g in part.param_groups)
        name = "Muon" if isinstance(part, torch.optim.Muon) else type(part).__name__
        out += [(name, _known_state_keys(part))] * n
    return out


# Bounds on the optimizer state read from a file (module docstring of load_optimizer_tensors):
# a first moment or momentum buffer of |x| <= MAX_MOMENT and a second moment in
# [0, MAX_MOMENT**2] keep the first step after a resume finite (an AdamW update is at most
# lr x 10 x MAX_MOMENT / eps = lr x 1e24 at step 1, far inside float32), while no gradient of a
# finite loss comes near them.
MAX_MOMENT = 1e15
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")


def _check_state_values(
    value: torch.Tensor, key: str, skey: str, source: str, max_step: int | None
) -> None:
    """Raise CheckpointError naming ``source`` and ``key`` unless the tensor's values are ones an
    optimizer could hold: finite; ``step`` an integer from 0 to ``max_step`` (the run's step
    count; :data:`MAX_STEP` when unknown); a second moment in [0, MAX_MOMENT**2]; any other
    state within +-MAX_MOMENT."""
    if not bool(value.isfinite().all()):
        raise CheckpointError(f"{source} holds non-finite values (inf or NaN) in {key}")
    if skey == "step":
        top = MAX_STEP if max_step is None else max_step
        step = float(value)
        if step < 0 or step != math.floor(step) or step > top:
            raise CheckpointError(
                f"{source} holds {key} = {step:g}: it must be a whole number of optimizer "
                f"steps from 0 to {top} (the checkpoint's step)"
            )
        return
    if value.numel() == 0:
        return
    if skey in SECOND_MOMENTS:
        lo, hi = float(value.min()), float(value.max())
        if lo < 0 or hi > MAX_MOMENT**2:
            raise CheckpointError(
                f"{source} holds {key} from {lo:g} to {hi:g}: a second moment lies in "
                f"[0, {MAX_MOMENT**2:g}]"
            )
    elif float(value.abs().max()) > MAX_MOMENT:
        raise CheckpointError(
            f"{source} holds {key} up to {float(value.abs().max()):g} in magnitude: optimizer "
            f"state lies within +-{MAX_MOMENT:g}"
        )


def load_optimizer_tensors(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    tensors: dict[str, torch.Tensor],
    source: str = "the optimizer state",
    max_step: int | None = None,
) -> None:
    """Inverse of :func:`optimizer_tensors`. Every tensor is checked before the optimizer sees
    it: its key names a parameter the optimizer holds and (Adam/AdamW, Muon) a state key the
    optimizer holding that parameter keeps, with all of that parameter's keys present (a
    Muon-held parameter, a block's matrix that every step updates, must have its state when
    any parameter has state; an AdamW-held one may have none: a parameter training never
    reaches, such as an encoder's pooler, never gets state); it is a finite floating-point
    tensor; ``step`` is a scalar holding a whole number from 0 to ``max_step`` (the
    checkpoint's step; :data:`MAX_STEP` when None) and every other tensor has its parameter's
    whole shape; ``exp_avg_sq`` / ``max_exp_avg_sq`` lie in [0, MAX_MOMENT**2] and
    ``exp_avg`` / ``momentum_buffer`` within +-:data:`MAX_MOMENT` (so the first step after a
    resume stays finite). State of an FSDP2-sharded parameter is cut to this rank's shard.
    Raises CheckpointError naming ``source``, the tensor, and (for a shape) both shapes."""
    names = _optimizer_param_names(optimizer, model)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    index = {n: i for i, n in enumerate(names)}
    keys_of = _state_keys(optimizer)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key in sorted(tensors):
        value = tensors[key]
        pname, sep, skey = key.partition("::")
        if not sep or pname not in index:
            raise CheckpointError(
                f"{source} holds {key!r}, which names no parameter of this model's optimizer"
            )
        owner, keys = keys_of[index[pname]]
        if keys is not None and skey not in keys:
            raise CheckpointError(
                f"{source} holds {key!r}: {skey!r} is not {owner} state ({', '.join(keys)})"
            )
        if not value.is_floating_point():
            raise CheckpointError(f"{source} holds {key} as {value.dtype}, not floating point")
        param = params[index[pname]]
        scalar = skey == "step" if keys is not None else value.ndim == 0
        want = () if scalar else tuple(param.shape)
        if tuple(value.shape) != want:
            raise CheckpointError(
                f"{source} has {key} of shape {tuple(value.shape)}, but parameter {pname} "
                f"needs {want}"
            )
        if keys is not None:
            _check_state_values(value, key, skey, source, max_step)
        elif not bool(value.isfinite().all()) or (scalar and float(value) < 0):
            raise CheckpointError(f"{source} holds non-finite or negative values in {key}")
        state.setdefault(index[pname], {})[skey] = value if scalar else _place(value, param)
    for i, (owner, keys) in enumerate(keys_of):
        got = state.get(i)
        if got is None and not (state and owner == "Muon"):
            continue  # no state: a parameter no step has reached (AdamW), or a fresh optimizer
        lacking = [k for k in keys or () if k not in (got or {})]
        if lacking:
            raise CheckpointError(f"{source} lacks {names[i]}::{lacking[0]}")
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


def refuse_quantized(model: nn.Module) -> None:
    """Raise LmlabError when ``model`` has weight-only quantized layers
    (:class:`lmlab.nn.quant.QuantLinear`): their integer weights and scales are not a format
    lmlab saves or reloads (a run folder stores float weights; quantize at load time)."""
    from lmlab.nn.quant import QuantLinear

    names = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    if names:
        raise LmlabError(
            f"this model has {len(names)} weight-only quantized layers (e.g. {names[0]}); lmlab "
            "saves float weights only: save the float model and quantize when loading "
            "(--quantize int8|int4, or lmlab.load(path, quantize=...))"
        )


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
    refuse_quantized(model)
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
                save_file(
                    tensors, str(tmp / OPTIMIZER_FILE), metadata=state_params_metadata(tensors)
                )
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


def _in_run(folder: Path, rel: str, what: str) -> Path:
    """``folder / rel``, refused when it leads outside ``folder`` (through a symlink)."""
    outside = (
        f"{folder / rel} leads outside {folder} (a symlink); lmlab reads a run's {what} only "
        "inside its folder"
    )
    return inside(folder, rel, what, CheckpointError, outside)


def latest_checkpoint(run_dir: str | Path) -> Path:
    """The folder ``latest`` points at (else the newest complete ``step-*`` folder).

    Raises CheckpointError if the run has no checkpoint, when ``latest`` does not hold a
    ``step-NNNNNN`` name, and when ``checkpoints/``, ``latest`` or the folder it names leads
    outside the run folder (a symlink).
    """
    run = Path(run_dir)
    root = run / "checkpoints"
    if os.path.lexists(root):
        _in_run(run, "checkpoints", "checkpoints")
    pointer = root / LATEST
    if os.path.lexists(pointer):
        _in_run(run, f"checkpoints/{LATEST}", "checkpoint pointer")
        data = read_bytes(pointer, "checkpoint pointer", POINTER_BYTES, CheckpointError)
        name = data.decode("utf-8", errors="replace").strip()
        if not re.fullmatch(r"step-\d{1,12}", name):
            raise CheckpointError(
                f"{pointer} is empty or damaged; write a step-NNNNNN name into it"
            )
        ckpt = _in_run(run, f"checkpoints/{name}", "checkpoints")
        if not ckpt.is_dir():
            raise CheckpointError(f"{pointer} names {ckpt.name}, which does not exist")
        return ckpt
    complete = sorted(
        p
        for p in (root.glob("step-*") if root.is_dir() else ())
        if re.fullmatch(r"step-\d{1,12}", p.name) and not p.is_symlink() and p.is_dir()
        if os.path.isfile(p / STATE_FILE)
    )
    if complete:
        return complete[-1]
    raise CheckpointError(f"{run_dir} has no checkpoint yet; {_train_hint(Path(run_dir))}")


def _train_hint(run_dir: Path) -> str:
    """How to train ``run_dir`` from the start with its own config.yaml (not the defaults)."""
    from lmlab.runlock import LOCK_FILE

    config = run_dir / "config.yaml"
    if config.is_file():
        if (run_dir / LOCK_FILE).exists():  # lmlab's folder: train it in place from its config
            command = f"--config {shlex.quote(str(config))} --out {shlex.quote(str(run_dir))}"
            return f"train it first with its own config: lmlab train {command}"
        # a folder lmlab did not make: train never writes into it, so train into a new one
        out = shlex.quote(f"{run_dir}-run")
        return (
            f"{run_dir} is not a run lmlab made; train its config into a new folder: "
            f"lmlab train --config {shlex.quote(str(config))} --out {out}"
        )
    return f"train it first: lmlab train --config CONFIG.yaml --out {shlex.quote(str(run_dir))}"


def _checkpoint_file(ckpt: Path, name: str) -> Path:
    """A file of a checkpoint folder, refused when it is a symlink leading out of the folder."""
    return _in_run(ckpt, name, "checkpoint files")


# trainer_state.json: key -> (kind, lowest, highest); "count" is an int, "seconds" a finite
# number >= 0, "loss" a finite number or null, "text" a string or null. Unknown keys are kept
# as read.
STATE_FIELDS: dict[str, tuple[str, float, float]] = {
    "step": ("count", 0, MAX_STEP),
    "tokens": ("count", 0, MAX_TOKENS),
    "elapsed_s": ("seconds", 0, 1e12),
    "train_loss": ("loss", -1e9, 1e9),
    "val_loss": ("loss", -1e9, 1e9),
    "val_loss_step": ("count?", 0, MAX_STEP),
    "world_size": ("count", 1, 1 << 20),
    "grad_accum_steps": ("count", 1, 1 << 20),
    "imported_from": ("text", 0, 0),
}
REQUIRED_STATE = ("step", "tokens")


def check_trainer_state(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """``data`` (a parsed trainer_state.json) when every known field has its type and range
    (:data:`STATE_FIELDS`; ``step`` and ``tokens`` required). Raises CheckpointError naming
    ``path`` and the field."""
    for key in REQUIRED_STATE:
        if key not in data:
            raise CheckpointError(f"trainer state {path} has no {key}")
    for key, (kind, lo, hi) in STATE_FIELDS.items():
        if key not in data:
            continue
        value = data[key]
        if value is None and kind in ("loss", "count?", "text"):  # null: not recorded
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if kind == "text":
            ok = isinstance(value, str)
            want = "a string or null"
        elif kind.startswith("count"):
            ok = number and isinstance(value, int) and lo <= value <= hi
            want = f"an integer from {lo:,} to {hi:,}" + (" or null" if kind == "count?" else "")
        else:
            ok = number and math.isfinite(value) and lo <= value <= hi
            want = f"a finite number from {lo:g} to {hi:g}" + (" or null" if kind == "loss" else "")
        if not ok:
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
            raise CheckpointError(f"trainer state {path}: {key} must be {want}, not {shown}")
    return data


def read_trainer_state(ckpt: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint folder (strict JSON object of at most 1 MiB, checked by
    :func:`check_trainer_state`). Raises CheckpointError naming the file and the field."""
    path = _checkpoint_file(ckpt, STATE_FILE)
    data = read_json_object(path, "trainer state", STATE_BYTES, CheckpointError)
    return check_trainer_state(data, path)


def load_model_weights(ckpt: Path, model: nn.Module) -> None:
    """Load ``model.safetensors`` into ``model`` (every tensor, checked first by
    :func:`check_weights_fit`; FSDP2-sharded parameters take this rank's shard). Raises
    CheckpointError if the file is missing, truncated or corrupt, holds non-finite values, or
    its tensors do not fit the model."""
    path = _checkpoint_file(ckpt, MODEL_FILE)
    if not os.path.lexists(path):
        raise CheckpointError(f"checkpoint {ckpt} is incomplete: {MODEL_FILE} is missing")
    source = check_weights_fit(path, safetensors_header(path), model)
    try:
        with safe_open(str(path), "pt") as f:
            tensors = {n: f.get_tensor(n) for n in sorted(set(source.values()))}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {_short(e)}") from None
    for name, t in tensors.items():
        check_finite(name, t, path, label="checkpoint file ")
    target = model.state_dict()
    model.load_state_dict({n: _place(tensors[f], target[n]) for n, f in source.items()})


def load_optimizer(
    ckpt: Path, optimizer: torch.optim.Optimizer, model: nn.Module, max_step: int | None = None
) -> None:
    """Load ``optimizer.safetensors`` into ``optimizer`` (checked by
    :func:`load_optimizer_tensors`; ``max_step``: the checkpoint's step). Raises
    CheckpointError when it is missing, corrupt or does not fit; a folder in the old
    torch.distributed.checkpoint layout (``sharded/``, whose metadata is a pickle) is refused
    without reading it."""
    path = _checkpoint_file(ckpt, OPTIMIZER_FILE)
    if not os.path.lexists(path):
        if os.path.lexists(ckpt / LEGACY_SHARDED_DIR):
            raise CheckpointError(
                f"checkpoint {ckpt} keeps its optimizer state in {LEGACY_SHARDED_DIR}/, the "
                "torch.distributed.checkpoint layout of older lmlab versions, whose metadata is a "
                "pickle that lmlab never reads: it cannot be resumed; its model.safetensors still "
                f"serves lmlab eval / generate, and lmlab train --init-from {ckpt.parent.parent} "
                "starts a new run from it"
            )
        raise CheckpointError(f"checkpoint {ckpt} is incomplete: {OPTIMIZER_FILE} is missing")
    safetensors_header(path)
    try:
        with safe_open(str(path), "pt") as f:
            listed = (f.metadata() or {}).get(STATE_PARAMS_KEY)
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {_short(e)}") from None
    source = f"optimizer state {path}"
    if listed is not None:  # written by this version: every listed parameter must have state
        _check_state_params(listed, tensors, source)
    load_optimizer_tensors(optimizer, model, tensors, source, max_step)


def state_params_metadata(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The header metadata of optimizer.safetensors: :data:`STATE_PARAMS_KEY` -> the JSON list
    of the parameters (``<param name>`` of ``<param name>::<state key>``) that have state."""
    return {STATE_PARAMS_KEY: json.dumps(sorted({k.partition("::")[0] for k in tensors}))}


def _check_state_params(listed: str, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Raise CheckpointError when the file's header lists a parameter with state whose tensors
    are gone, or the list itself is malformed."""
    try:
        names = json.loads(listed)
    except (ValueError, RecursionError):  # RecursionError: [[[[...]]]] nested past the stack
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"{source} has a malformed {STATE_PARAMS_KEY} header entry")
    present = {k.partition("::")[0] for k in tensors}
    missing = [n for n in names if n not in present]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"{source} lacks the state of {missing[0]}{more}, which its header lists: the file "
            "lost tensors; resume from an earlier checkpoint"
        )


def _short(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


def load_checkpoint(
    ckpt: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load weights (and optimizer state) from a checkpoint folder; return its trainer state.

    Works for a plain model and for an FSDP2-sharded one (each rank reads the whole files and
    keeps its shards), whatever world size wrote the checkpoint. Nothing is written. Raises
    CheckpointError naming the damaged file and any older checkpoints beside it.
    """
    try:
        state = read_trainer_state(ckpt)
        load_model_weights(ckpt, model)
        if optimizer is not None:
            load_optimizer(ckpt, optimizer, model, int(state["step"]))
    except CheckpointError as e:
        raise CheckpointError(f"{e}{other_checkpoints(ckpt)}") from None
    return state
