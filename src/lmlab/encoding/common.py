"""Loading an encoder for a command, and turning texts into a padded batch."""

from __future__ import annotations

from pathlib import Path

import torch

from lmlab.data.tokenizer import Tokenizer
from lmlab.errors import LmlabError
from lmlab.interop.load import load
from lmlab.models.encoder import EncoderLM
from lmlab.training.hardware import resolve_device


def load_encoder(
    path: str | Path, command: str, device: str = "auto"
) -> tuple[EncoderLM, Tokenizer]:
    """``(model, tokenizer)`` of any path :func:`lmlab.interop.load.load` accepts, in eval mode.

    Raises LmlabError when the path is not a model, the model is not an encoder
    (``model.kind=encoder``), or it has no tokenizer."""
    model, tokenizer = load(path, str(resolve_device(device)))
    if not isinstance(model, EncoderLM):
        kind = getattr(getattr(model, "cfg", None), "kind", type(model).__name__)
        raise LmlabError(
            f"{command} needs an encoder model (model.kind=encoder, e.g. BERT); {path} holds a "
            f"{kind} model"
        )
    if tokenizer is None:
        raise LmlabError(f"{path} has no tokenizer (tokenizer.json), which {command} needs")
    return model, tokenizer


def encode_batch(
    tokenizer: Tokenizer, texts: list[str], max_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Texts -> input_ids (B, T) int64 framed as in training ([CLS] ... [SEP] for BERT),
    right-padded with the pad token (or 0), and attention_mask (B, T) int64, 1 = real token.

    Raises LmlabError for an empty text or one longer than ``max_len`` tokens."""
    rows = [tokenizer.encode_for_model(t) for t in texts]
    for text, ids in zip(texts, rows, strict=True):  # ids: list[int]
        if not text.strip():
            raise LmlabError("--text is empty")
        if len(ids) > max_len:
            raise LmlabError(
                f"the text {text[:40]!r}{'...' if len(text) > 40 else ''} is {len(ids)} tokens "
                f"long, more than the model's context of {max_len} tokens"
            )
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return input_ids.to(device), mask.to(device)
