"""``lmlab.load(path)``: an lmlab run folder or a Hugging Face model folder -> (model, tokenizer).

A Hugging Face folder holds ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``), optionally ``tokenizer.json``. Nothing is downloaded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from lmlab.data.tokenizer import Tokenizer, load_tokenizer
from lmlab.errors import CheckpointError, DataError, LmlabError
from lmlab.interop.families import family_for
from lmlab.models.build import build_model
from lmlab.training.hardware import resolve_device


def read_hf_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face folder (single file or shards). Raises CheckpointError."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        pickled = [n for n in ("pytorch_model.bin", "model.pt") if (folder / n).is_file()]
        hint = (
            f" ({pickled[0]} is a pickle, which lmlab never loads: it can run code; convert it "
            "to safetensors with a tool you trust)"
            if pickled
            else ""
        )
        raise CheckpointError(f"{folder} has config.json but no model.safetensors{hint}")
    sd: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            sd.update(load_file(str(folder / name)))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{folder / name} is corrupt: {e}") from None
    return sd


def _check_shapes(
    tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], folder: Path
) -> None:
    """Raise CheckpointError naming the first tensor whose shape differs from the one its
    config.json implies (both shapes given)."""
    for key, want in expected.items():
        if key in tensors and tuple(tensors[key].shape) != tuple(want.shape):
            raise CheckpointError(
                f"{folder}: tensor {key} has shape {tuple(tensors[key].shape)} but config.json "
                f"implies {tuple(want.shape)}"
            )


def not_a_model_file(p: Path) -> str:
    """Why a plain file is not something ``load`` takes (looks at its first bytes)."""
    with open(p, "rb") as fh:
        head = fh.read(9)
    if head[:4] == b"GGUF":
        kind = "a GGUF file lmlab cannot read"
    elif len(head) == 9 and head[8:9] == b"{":  # 8-byte header length, then the JSON header
        kind = (
            "a bare safetensors file: lmlab needs the folder holding it with its config.json "
            "(Hugging Face) or config.yaml (lmlab run)"
        )
    else:
        kind = "neither a model folder, a safetensors file nor a GGUF file"
    return (
        f"{p} is {kind}; lmlab loads an lmlab run folder, a Hugging Face model folder "
        "(config.json + model.safetensors) or a .gguf file"
    )


def load_hf_folder(folder: str | Path, device: str = "cpu") -> tuple[nn.Module, Tokenizer | None]:
    """Build the lmlab model of a Hugging Face folder and load its weights (strict).

    Raises LmlabError for an unsupported ``model_type`` or a component lmlab lacks, and
    CheckpointError for missing or corrupt weight files.
    """
    p = Path(folder)
    try:
        raw = json.loads((p / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LmlabError(f"cannot read {p / 'config.json'}: {e}") from None
    if not isinstance(raw, dict):
        raise LmlabError(f"{p / 'config.json'} must hold a JSON object, got {type(raw).__name__}")
    family = family_for(str(raw.get("model_type")))
    tensors = read_hf_state_dict(p)
    try:
        cfg = family.to_config(SimpleNamespace(**raw))
    except AttributeError as e:  # a field the family needs is absent
        raise LmlabError(
            f"{p / 'config.json'} lacks {getattr(e, 'name', None) or e!s}, which a "
            f"{raw.get('model_type')} config needs"
        ) from None
    if family.fit_config is not None:
        cfg = family.fit_config(cfg, tensors)
    model = build_model(cfg)
    expected = family.from_state(model.state_dict(), cfg) if family.from_state else {}
    _check_shapes(tensors, expected, p)
    state = family.to_state(tensors, cfg)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except (
        RuntimeError
    ) as e:  # a shape config.json does not imply, under a name _check_shapes missed
        detail = next((ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln), str(e))
        raise CheckpointError(f"{p} does not fit its config.json: {detail}") from None
    absent = sorted(k for k in expected if k not in tensors)
    if missing and absent:
        raise CheckpointError(
            f"{p} lacks tensor {absent[0]} (shape {tuple(expected[absent[0]].shape)}), which its "
            f"config.json needs" + (f" ({len(absent) - 1} more missing)" if len(absent) > 1 else "")
        )
    if missing or unexpected:
        raise CheckpointError(
            f"{p} does not fit its config (missing {sorted(missing)[:5]}, unexpected "
            f"{sorted(unexpected)[:5]})"
        )
    tokenizer = None
    if (p / "tokenizer.json").is_file():
        try:
            tokenizer = load_tokenizer(p / "tokenizer.json")
        except DataError as e:
            print(f"warning: {e}; loading the model without a tokenizer", file=sys.stderr)
    return model.to(device).eval(), tokenizer


def load(path: str | Path, device: str = "cpu") -> tuple[nn.Module, Tokenizer | None]:
    """Load ``(model, tokenizer)`` from an lmlab run folder (latest checkpoint), a Hugging Face
    model folder of a supported family (``lmlab list hf_family``) or a Llama-family ``.gguf`` file
    (:mod:`lmlab.interop.gguf`: dequantized to float32, tokenizer and chat template from its
    metadata). The model is in eval mode;
    ``model(input_ids)`` returns an output whose ``.logits`` is (batch, seq, vocab).

    Raises LmlabError (or a subclass) when the path is neither, or its files are damaged.
    """
    p = Path(path)
    if (p / "config.yaml").is_file():
        from lmlab.run import load_run

        run = load_run(p, device)
        return run.model, run.tokenizer
    if p.exists():
        device = resolve_device(device).type  # "auto" -> cuda, mps or cpu
    if (p / "config.json").is_file():
        return load_hf_folder(p, device)
    if not p.exists():
        raise LmlabError(f"not found: {p}")
    if p.is_file():
        from lmlab.interop.gguf import is_gguf_file, load_gguf

        if is_gguf_file(p):
            return load_gguf(p, device)
        raise LmlabError(not_a_model_file(p))
    raise LmlabError(
        f"{p} is neither an lmlab run folder (config.yaml) nor a Hugging Face model folder "
        "(config.json + model.safetensors)"
    )
