"""Does a weights file fit the model built from a config? Checked from the safetensors header.

Before a tensor is read, every name, shape and dtype in the file's header is compared with the
model's state dict. A mismatch is one CheckpointError that names the tensor and both shapes, and,
where a single config field holds the dimension that differs, that field (``was model.d_model
changed?``): the usual cause is a config.yaml edited after its checkpoint was written.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from lmlab.errors import CheckpointError
from lmlab.safeio import regular_file


def _short(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def safetensors_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, safetensors dtype) of every tensor in a safetensors file, read from its
    header only. Raises CheckpointError for a file that is not safetensors or is truncated."""
    regular_file(path, "checkpoint file", None, CheckpointError)
    try:
        with safe_open(str(path), "pt") as f:
            out = {}
            for name in f.keys():  # noqa: SIM118 (safe_open is no dict)
                piece = f.get_slice(name)
                out[name] = (tuple(piece.get_shape()), piece.get_dtype())
            return out
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {_short(e)}") from None


def _changed_field(model: nn.Module, built: int) -> str:
    """': was model.X changed?' for the config field(s) whose value is the dimension the model
    builds (``built``) where the file has another; '' when no field holds it."""
    cfg = getattr(model, "cfg", None)
    if cfg is None:
        return ""
    values: dict[str, Any] = {
        "model.d_model": cfg.d_model,
        "model.vocab_size": cfg.vocab_size,
        "model.max_seq_len": cfg.max_seq_len,
        "model.n_layers": cfg.n_layers,
    }
    for name, attr in (("model.ffn.d_ff", "d_ff"), ("model.attention.head_dim", "head_dim")):
        with contextlib.suppress(Exception):
            values[name] = getattr(cfg, attr)
    with contextlib.suppress(Exception):  # heads x head_dim, where that is not d_model
        for name, heads in (("n_heads", cfg.attention.n_heads), ("n_kv_heads", cfg.n_kv_heads)):
            if heads * cfg.head_dim != cfg.d_model:
                values[f"model.attention.{name}"] = heads * cfg.head_dim
    fields = [name for name, value in values.items() if value == built]
    if not fields:
        return ""
    return f": was {' or '.join(fields)} changed?"


def _fit_error(path: Path, problem: str, hint: str = "") -> CheckpointError:
    hint = hint or (
        ": was the model section of the run's config changed after this checkpoint was written?"
    )
    return CheckpointError(f"{path} {problem}{hint}")


def check_weights_fit(
    path: Path, header: dict[str, tuple[tuple[int, ...], str]], model: nn.Module
) -> dict[str, str]:
    """Check a weights file's tensors against the model built from the config, by name, shape
    and dtype. Tied weights (one parameter under several names) need one of their names.
    Returns model state-dict name -> the file's tensor name. Raises CheckpointError naming the
    tensor, both shapes (or dtypes), and the config field that likely differs."""
    target = model.state_dict()
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    alias = {n: names for names in groups.values() for n in names}
    source: dict[str, str] = {}
    for name in target:
        present = [n for n in alias.get(name, [name]) if n in header]
        if not present:
            layer = re.match(r"layers\.\d+\.", name)  # decoder blocks: model.n_layers
            hint = ": was model.n_layers changed?" if layer else ""
            raise _fit_error(path, f"has no tensor {name}, which the model needs", hint)
        source[name] = present[0]
    for name in header:
        if name not in target:
            layer = re.match(r"layers\.\d+\.", name)  # decoder blocks: model.n_layers
            hint = ": was model.n_layers changed?" if layer else ""
            raise _fit_error(path, f"has {name}, which the model does not have", hint)
    for name, file_name in source.items():
        shape, dtype = header[file_name]
        want = target[name]
        if shape != tuple(want.shape):
            hint = next(
                (
                    _changed_field(model, b)
                    for a, b in zip(shape, want.shape, strict=False)
                    if a != b and _changed_field(model, b)
                ),
                "",
            )
            raise _fit_error(
                path,
                f"has {file_name} of shape {shape} but the model built from the config has "
                f"{tuple(want.shape)}",
                hint,
            )
        if _DTYPES.get(dtype) != want.dtype:
            raise _fit_error(
                path, f"has {file_name} as {dtype} but the model holds it as {want.dtype}",
                " (lmlab checkpoints keep the model's own dtype)",
            )  # fmt: skip
    return source


def check_finite(name: str, t: torch.Tensor, file: str | Path, label: str = "") -> None:
    """Raise CheckpointError ``{label}{file} is corrupt: non-finite values in {name}`` when a
    floating-point tensor holds NaN or inf (a weight that would turn every logit into NaN).
    Run checkpoints, Hugging Face folders and GGUF files all read weights through this."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise CheckpointError(f"{label}{file} is corrupt: non-finite values in {name}")
