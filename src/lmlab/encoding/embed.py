"""Sentence embeddings from an encoder: the model's own pooling and normalisation when its
folder describes them (a sentence-transformers folder: ``modules.json`` with a Pooling module's
``config.json`` and optionally a Normalize module), else mean pooling over the real tokens
(Reimers & Gurevych 2019, Sentence-BERT).

Legend: N texts, T tokens, D d_model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from lmlab.encoding.common import encode_batch, load_encoder
from lmlab.errors import LmlabError
from lmlab.safeio import inside, read_json, read_json_object

POOLING_MODES = ("cls", "mean", "max", "mean_sqrt_len")


@dataclass
class Pooling:
    """How token states become one vector: ``mode`` in POOLING_MODES, then optional L2 norm.
    ``max_len``: the folder's own maximum sequence length in tokens (None: the model's)."""

    mode: str = "mean"
    normalize: bool = False
    max_len: int | None = None


def read_pooling(path: str | Path) -> Pooling:
    """The pooling a model folder declares (sentence-transformers layout), else mean pooling
    without normalisation. A module's ``path`` must lie inside the folder (no absolute path,
    ``..`` or symlink out); every file is read with a size bound. Raises LmlabError for a
    pooling mode lmlab does not implement or a malformed file, naming it."""
    p = Path(path)
    modules_file = p / "modules.json"
    if not p.is_dir() or not os.path.lexists(modules_file):
        return Pooling()
    what = f"the sentence-transformers files of {p}"
    modules = read_json(inside(p, "modules.json", what), "modules.json")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise LmlabError(f"{modules_file} must hold a list of module objects")
    pooling = Pooling()
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            folder = m.get("path")
            if not isinstance(folder, str):
                raise LmlabError(f"{modules_file}: the Pooling module's path is {folder!r}")
            cfg_file = inside(p, str(Path(folder) / "config.json"), f"{modules_file} (Pooling)")
            cfg = read_json_object(cfg_file, f"{what}: pooling config")
            on = [mode for mode in POOLING_MODES if cfg.get(f"pooling_mode_{mode}_tokens")] + (
                ["cls"] if cfg.get("pooling_mode_cls_token") else []
            )
            if len(on) != 1:
                raise LmlabError(
                    f"{cfg_file} asks for pooling {on or 'none'}; lmlab supports exactly one of "
                    f"{', '.join(POOLING_MODES)}"
                )
            pooling.mode = on[0]
        elif kind == "Normalize":
            pooling.normalize = True
    st = p / "sentence_bert_config.json"
    if os.path.lexists(st):
        raw = read_json_object(inside(p, st.name, what), f"{what}: sentence_bert_config.json")
        max_len = raw.get("max_seq_length")
        if max_len is not None and (
            isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1
        ):
            raise LmlabError(f"{st}: max_seq_length is {max_len!r}; it must be an integer >= 1")
        pooling.max_len = max_len
    return pooling


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """hidden (N, T, D) float, mask (N, T) 1 = real token -> (N, D) float32 (cls: the first
    token; mean: the mean over real tokens; max: the channel-wise max over them; mean_sqrt_len:
    the sum over real tokens / sqrt(count))."""
    h = hidden.float()
    m = mask.to(h.dtype).unsqueeze(-1)  # (N, T, 1)
    if mode == "cls":
        return h[:, 0]
    if mode == "max":
        return h.masked_fill(m == 0, float("-inf")).max(dim=1).values
    total, count = (h * m).sum(dim=1), m.sum(dim=1).clamp_min(1.0)
    return total / count if mode == "mean" else total / count.sqrt()


@torch.no_grad()
def embed(path: str | Path, texts: list[str], device: str = "auto") -> torch.Tensor:
    """Sentence embeddings (N, D) float32 of ``texts`` with the model at ``path`` (any path
    :func:`lmlab.load` accepts): its final hidden states pooled as :func:`read_pooling` says,
    L2-normalised when the folder has a Normalize module.

    Raises LmlabError for a path that is not an encoder model, no texts, an empty text or one
    longer than the context (the folder's max_seq_length when it sets one)."""
    if not texts:
        raise LmlabError("give at least one --text to embed")
    model, tokenizer = load_encoder(path, "embed", device)
    pooling = read_pooling(path)
    max_len = min(model.cfg.max_seq_len, pooling.max_len or model.cfg.max_seq_len)
    dev = next(model.parameters()).device
    ids, mask = encode_batch(tokenizer, texts, max_len, dev)
    out = model(ids, attention_mask=mask, output_hidden_states=True)
    vectors = pool(out.hidden_states[-1], mask, pooling.mode)
    return F.normalize(vectors, dim=-1) if pooling.normalize else vectors
