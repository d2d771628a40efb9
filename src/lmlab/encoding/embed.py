"""Sentence embeddings from an encoder: the model's own pooling and normalisation when its
folder describes them (a sentence-transformers folder: ``modules.json`` with a Pooling module's
``config.json`` and optionally a Normalize module), else mean pooling over the real tokens
(Reimers & Gurevych 2019, Sentence-BERT).

Legend: N texts, T tokens, D d_model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from lmlab.encoding.common import encode_batch, load_encoder
from lmlab.errors import LmlabError

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
    without normalisation. Raises LmlabError for a pooling mode lmlab does not implement."""
    p = Path(path)
    modules_file = p / "modules.json"
    if not p.is_dir() or not modules_file.is_file():
        return Pooling()
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
        pooling = Pooling()
        for m in modules:
            kind = str(m.get("type", "")).rsplit(".", 1)[-1]
            if kind == "Pooling":
                cfg = json.loads((p / m["path"] / "config.json").read_text(encoding="utf-8"))
                on = [mode for mode in POOLING_MODES if cfg.get(f"pooling_mode_{mode}_tokens")] + (
                    ["cls"] if cfg.get("pooling_mode_cls_token") else []
                )
                if len(on) != 1:
                    raise LmlabError(
                        f"{p / m['path'] / 'config.json'} asks for pooling {on or 'none'}; lmlab "
                        f"supports exactly one of {', '.join(POOLING_MODES)}"
                    )
                pooling.mode = on[0]
            elif kind == "Normalize":
                pooling.normalize = True
        st = p / "sentence_bert_config.json"
        if st.is_file():
            pooling.max_len = json.loads(st.read_text(encoding="utf-8")).get("max_seq_length")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # e.g. a list, not {}
        raise LmlabError(f"cannot read the sentence-transformers files of {p}: {e}") from None
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
