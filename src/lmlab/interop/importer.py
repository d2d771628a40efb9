"""``lmlab import PATH --out RUN_DIR``: any model :func:`lmlab.interop.load.load` accepts, stored
as an lmlab run folder.

The run holds ``config.yaml`` (the model's ModelConfig; data and train sections at their
defaults, the tokenizer kind set to the model's), ``tokenizer.json`` (the model's own; with
``tokenizer_config.json`` / ``generation_config.json`` holding its chat template, bos / eos
tokens and stop ids, :mod:`lmlab.data.tokenizer_config`, when it has them) and one
checkpoint ``checkpoints/step-000000`` + ``latest`` written by the checkpoint code (weights only,
no optimizer state; its ``trainer_state.json`` records ``imported_from``). ``lmlab eval``,
``generate`` and ``train --init-from`` then take the run like any other. The folder is written
beside ``--out`` and renamed onto it at the end (:mod:`lmlab.interop.outdir`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from lmlab.config import ModelConfig, RunConfig, save_config
from lmlab.data.tokenizer import Tokenizer
from lmlab.data.tokenizer_config import save_tokenizer
from lmlab.errors import LmlabError
from lmlab.interop.load import load
from lmlab.interop.outdir import check_not_source, staged_folder
from lmlab.run import CONFIG_FILE
from lmlab.training.checkpoint import save_checkpoint


@dataclass
class ImportResult:
    """The run folder written and what it holds."""

    out: Path
    params: int
    vocab_size: int
    tokenizer_kind: str


def model_config(model: nn.Module) -> ModelConfig:
    """The ModelConfig of a model ``load`` returned (``model.cfg``)."""
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ModelConfig):
        raise LmlabError(f"{type(model).__name__} carries no lmlab ModelConfig (model.cfg)")
    return cfg


def check_tokenizer_fits(
    model: nn.Module, tokenizer: Tokenizer | None, source: str | Path
) -> Tokenizer:
    """The model's tokenizer, refused with LmlabError when absent or of another vocabulary size
    (an lmlab run's tokenizer must cover exactly the model's vocabulary)."""
    if tokenizer is None:
        raise LmlabError(
            f"{source} has no tokenizer lmlab can read (tokenizer.json of a WordLevel or BPE "
            "model); lmlab needs the model's own tokenizer to store or train it"
        )
    if tokenizer.vocab_size != model_config(model).vocab_size:
        raise LmlabError(
            f"{source}: its tokenizer has {tokenizer.vocab_size} tokens but the model's "
            f"vocabulary has {model_config(model).vocab_size} rows; lmlab needs the two to be equal"
        )
    return tokenizer


def run_config_for(model: nn.Module, tokenizer: Tokenizer, name: str) -> RunConfig:
    """A run config around a loaded model: its ModelConfig, the tokenizer kind, defaults else."""
    cfg = RunConfig(name=name, model=copy.deepcopy(model_config(model)))
    cfg.data.tokenizer.kind = tokenizer.kind
    if tokenizer.kind == "bpe":
        cfg.data.tokenizer.vocab_size = tokenizer.vocab_size
    return cfg.validate()


def write_run(
    model: nn.Module,
    tokenizer: Tokenizer,
    out: str | Path,
    force: bool = False,
    source: str | None = None,
) -> Path:
    """Store ``model`` (weights as they are) and ``tokenizer`` as a run folder ``out`` with one
    step-0 checkpoint. Raises LmlabError for an ``out`` that is a file or a non-empty folder
    (unless ``force``); nothing is left in ``out`` on error."""
    from lmlab.training.checkpoint import refuse_quantized

    refuse_quantized(model)  # before any work: integer codes are not a run folder's weights
    final = Path(out)
    cfg = run_config_for(model, tokenizer, final.name or "imported")
    with staged_folder(final, force) as tmp:
        save_config(cfg, tmp / CONFIG_FILE)
        save_tokenizer(tokenizer, tmp, cfg.model.max_seq_len)  # + its chat template, if any
        state = {"step": 0, "tokens": 0, "elapsed_s": 0.0, "imported_from": source}
        save_checkpoint(tmp, 0, model, None, state)
    return final


def import_model(source: str | Path, out: str | Path, force: bool = False) -> ImportResult:
    """Store the model at ``source`` (a run folder, a Hugging Face folder, or any other path
    ``load`` accepts) as the lmlab run folder ``out``.

    Raises LmlabError when ``source`` cannot be loaded (naming the file, tensor or architecture at
    fault), has no readable tokenizer or one of another size, or ``out`` is a file or a
    non-empty folder (unless ``force``). Nothing is left in ``out`` on error.
    """
    check_not_source(out, source)
    model, tokenizer = load(source, "cpu")
    tok = check_tokenizer_fits(model, tokenizer, source)
    path = write_run(model, tok, out, force, str(source))
    n = sum(p.numel() for p in model.parameters())
    return ImportResult(path, n, tok.vocab_size, tok.kind)
