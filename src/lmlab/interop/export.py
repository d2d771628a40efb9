"""``lmlab export MODEL --format hf --out DIR``: an lmlab model as a Hugging Face model folder.

The folder holds ``config.json`` (the ``transformers`` config of the one family whose class
computes exactly what the model does, :func:`lmlab.interop.families.match_family`),
``model.safetensors`` (float32, the tied LM head left out as ``save_pretrained`` does),
``tokenizer.json`` + ``tokenizer_config.json`` (``PreTrainedTokenizerFast``, so ``AutoTokenizer``
loads it, with the model's chat template and bos / eos / pad tokens, so ``apply_chat_template``
works) and ``generation_config.json`` (every stop id) when the tokenizer has an end-of-text token.

When ``transformers`` is importable the folder is loaded back with
``AutoModelForCausalLM.from_pretrained`` (every tensor must be used, none missing) and its
logits compared with lmlab's on random token ids (float32, max |diff| <= 1e-5), and its
tokenizer with ``AutoTokenizer``; only then is the folder renamed onto ``--out``.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from lmlab.data.tokenizer import Tokenizer
from lmlab.data.tokenizer_config import generation_config_json, tokenizer_config_json
from lmlab.errors import LmlabError
from lmlab.interop.families import hf_config_json, match_family
from lmlab.interop.importer import model_config
from lmlab.interop.load import load
from lmlab.interop.outdir import check_not_source, staged_folder

ATOL = 1e-5
FORMATS = ("hf",)


@dataclass
class ExportResult:
    """What an export wrote. ``max_abs_diff`` (logits, float32) is None when not verified."""

    out: Path
    model_type: str
    hf_class: str
    files: list[str]
    max_abs_diff: float | None
    verify_note: str


def _distinct_tensors(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU float tensors, none sharing memory (safetensors refuses shared storage)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in sd.items():
        t = value.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[key] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def _write_tokenizer(tokenizer: Tokenizer, folder: Path, max_len: int) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template and bos / eos / pad
    spellings, as Hugging Face writes them) and, with an end token, generation_config.json."""
    tokenizer.save(folder / "tokenizer.json")
    spec = tokenizer_config_json(tokenizer, max_len)
    (folder / "tokenizer_config.json").write_text(
        json.dumps(spec, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    generation = generation_config_json(tokenizer)
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def verify_hf_folder(
    folder: Path, model: nn.Module, tokenizer: Tokenizer | None
) -> tuple[float | None, str]:
    """Load ``folder`` with ``transformers`` and compare its logits with ``model``'s on two
    random sequences of min(max_seq_len, 16 + window) tokens, float32. Returns (max |diff|,
    note); (None, note) when transformers is not importable. Raises LmlabError when a tensor
    is missing or unused, the logits differ by more than 1e-5, or the tokenizer encodes a
    sample differently."""
    try:
        transformers = importlib.import_module("transformers")
    except ImportError:
        return None, "skipped the transformers check (transformers is not installed)"
    cfg = model_config(model)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # no progress bar or notes on stdout
    transformers.logging.disable_progress_bar()
    try:
        hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch.float32, output_loading_info=True
        )
        hf_tok = transformers.AutoTokenizer.from_pretrained(str(folder)) if tokenizer else None
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.logging.enable_progress_bar()
    bad = {k: v for k, v in info.items() if v and k != "error_msgs"} | (
        {"errors": info["error_msgs"]} if info.get("error_msgs") else {}
    )
    if bad:
        raise LmlabError(f"transformers loaded the exported folder with problems: {bad}")
    gen = torch.Generator().manual_seed(0)
    t = min(cfg.max_seq_len, 16 + (cfg.attention.window or 0))
    x = torch.randint(0, cfg.vocab_size or 2, (2, t), generator=gen)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        ours = model(x).logits.float()
        theirs = hf_model.eval()(x).logits.float()
    model.train(was_training)
    diff = float((ours - theirs).abs().max())
    if not diff <= ATOL:
        raise LmlabError(
            f"transformers {type(hf_model).__name__} computes different logits from the lmlab "
            f"model (max |diff| {diff:.2e} > {ATOL:g}); nothing was written"
        )
    note = (
        f"transformers {type(hf_model).__name__} loads it: max |logit diff| {diff:.1e} "
        f"(float32, allowed {ATOL:g})"
    )
    if tokenizer is not None and hf_tok is not None:
        n = min(64, cfg.max_seq_len)
        sample = tokenizer.decode(
            torch.randint(0, tokenizer.vocab_size, (n,), generator=gen).tolist()
        )
        ids = tokenizer.encode(sample)
        if list(hf_tok.encode(sample, add_special_tokens=False)) != ids:
            raise LmlabError(
                f"transformers {type(hf_tok).__name__} tokenizes a sample differently from "
                "lmlab's tokenizer; nothing was written"
            )
        note += f"; {type(hf_tok).__name__} tokenizes like lmlab"
    return diff, note


def _umask_mode() -> int:
    """The mode ``open`` gives a new file under the process umask (0644 under umask 022)."""
    mask = os.umask(0o22)
    os.umask(mask)
    return 0o666 & ~mask


def export_model(
    source: str | Path,
    out: str | Path,
    format: str = "hf",
    force: bool = False,
    verify: bool = True,
) -> ExportResult:
    """Write the model at ``source`` (anything :func:`lmlab.interop.load.load` accepts: a run
    folder's latest checkpoint, a Hugging Face folder, ...) as a Hugging Face folder ``out``.

    ``verify``: check the folder with ``transformers`` when it is installed (see the module
    docstring). Raises NotRepresentable (an LmlabError) naming each component the closest
    Hugging Face family lacks; LmlabError for an unknown format, an ``out`` that is a file or a
    non-empty folder (unless ``force``), or a failed check. Nothing is left in ``out`` on error.
    """
    if format not in FORMATS:
        raise LmlabError(f"unknown export format {format!r}; supported: {', '.join(FORMATS)}")
    check_not_source(out, source)
    model, tokenizer = load(source, "cpu")
    model = model.float()
    cfg = model_config(model)
    family, kwargs = match_family(cfg)
    if tokenizer is not None and tokenizer.eos_id is not None:
        kwargs["eos_token_id"] = tokenizer.eos_id
    assert family.from_state is not None
    tensors = _distinct_tensors(family.from_state(model.state_dict(), cfg))
    final = Path(out)
    size = sum(t.numel() * t.element_size() for t in tensors.values())  # + small JSON files
    with staged_folder(final, force, size) as tmp:
        (tmp / "config.json").write_text(
            json.dumps(hf_config_json(family, kwargs), indent=2) + "\n"
        )
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(tmp / "model.safetensors", _umask_mode())  # safetensors creates it 0600
        if tokenizer is not None:
            _write_tokenizer(tokenizer, tmp, cfg.max_seq_len)
        files = sorted(p.name for p in tmp.iterdir())
        diff, note = verify_hf_folder(tmp, model, tokenizer) if verify else (None, "not checked")
    return ExportResult(final, family.model_type, family.hf_class, files, diff, note)
