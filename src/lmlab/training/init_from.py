"""``lmlab train --init-from PATH``: fine-tuning starts from a loaded model instead of a new one.

The trainer calls :func:`start_from` where a new run would fit a tokenizer and build a model with
fresh weights: the run takes the loaded model's ModelConfig and its own tokenizer (the corpus is
tokenized with it), and training starts from its weights. The data and train sections stay the
user's. From then on the run is like any other (its checkpoints hold the whole model; resume
rebuilds it from ``config.yaml``).
"""

from __future__ import annotations

import copy
from pathlib import Path

from torch import nn

from lmlab.config import RunConfig
from lmlab.data.tokenizer import Tokenizer
from lmlab.interop.importer import check_tokenizer_fits, model_config
from lmlab.interop.load import load


def start_from(path: str | Path, cfg: RunConfig) -> tuple[Tokenizer, nn.Module]:
    """Load the model at ``path`` (anything :func:`lmlab.interop.load.load` accepts) on the CPU
    and make ``cfg.model`` its config (``cfg.data.tokenizer.kind`` its tokenizer's kind).

    Returns (tokenizer, model in train mode). Raises LmlabError when ``path`` cannot be loaded
    or has no tokenizer of the model's vocabulary size.
    """
    model, tokenizer = load(path, "cpu")
    tok = check_tokenizer_fits(model, tokenizer, path)
    cfg.model = copy.deepcopy(model_config(model))
    cfg.data.tokenizer.kind = tok.kind
    if tok.kind == "bpe":
        cfg.data.tokenizer.vocab_size = tok.vocab_size
    return tok, model.float().train()
