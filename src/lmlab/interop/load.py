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
    family = family_for(str(raw.get("model_type")))
    tensors = read_hf_state_dict(p)
    try:
        cfg = family.to_config(SimpleNamespace(**raw))
    except AttributeError as e:  # a field the family needs is absent
        raise LmlabError(
            f"{p / 'config.json'} lacks {getattr(e, 'name', None) or e!s}, which a "
            f"{raw.get('model_type')} config needs"
        ) from None
    model = build_model(cfg)
    state = family.to_state(tensors, cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
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
        raise LmlabError(
            f"{p} is a file but not a GGUF file (it does not start with the GGUF magic bytes); "
            "give an lmlab run folder, a Hugging Face model folder or a .gguf file"
        )
    raise LmlabError(
        f"{p} is neither an lmlab run folder (config.yaml) nor a Hugging Face model folder "
        "(config.json + model.safetensors)"
    )
