"""Perplexity evaluation over a whole text, in windows of the model's context.

Every token but the first is predicted exactly once. With the default stride (= the context
length) the text is cut into non-overlapping windows, so early tokens of each window see little
context; a smaller ``stride`` slides the window and scores only each window's last ``stride``
tokens, giving every token up to ``max_seq_len - stride`` tokens of extra context (the
Hugging Face perplexity recipe).

loss = mean cross-entropy in nats/token; perplexity = exp(loss);
bits_per_byte = total nats / ln 2 / UTF-8 bytes of the scored tokens (tokenizer-independent).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lmlab.config import RunConfig
from lmlab.data.corpus import load_corpus, read_text
from lmlab.data.tokenizer import Tokenizer
from lmlab.errors import DataError, LmlabError
from lmlab.evaluation.seq2seq import Seq2SeqEvalResult
from lmlab.run import LoadedRun, load_run
from lmlab.training.hardware import autocast


@dataclass
class EvalResult:
    """Scores of one text. loss in nats/token; bits_per_byte in bits per UTF-8 byte."""

    loss: float
    perplexity: float
    bits_per_byte: float
    tokens: int
    bytes: int

    def as_dict(self) -> dict[str, float | int]:
        return {
            "loss": self.loss,
            "perplexity": self.perplexity,
            "bits_per_byte": self.bits_per_byte,
            "tokens": self.tokens,
            "bytes": self.bytes,
        }


@torch.no_grad()
def score_tokens(
    model: nn.Module,
    ids: np.ndarray,
    token_bytes: np.ndarray,
    max_seq_len: int,
    stride: int | None = None,
    batch_size: int = 8,
    precision: str = "fp32",
) -> EvalResult:
    """Score ``ids`` (N,) int. token_bytes (V,) int: UTF-8 length of each vocabulary entry.

    Raises DataError if fewer than 2 tokens are given or ``stride`` is not in 1..max_seq_len.
    """
    n = len(ids)
    if n < 2:
        raise DataError(f"need at least 2 tokens to score, got {n}")
    stride = max_seq_len if stride is None else stride
    if batch_size < 1:
        raise DataError(f"--batch-size must be >= 1, got {batch_size}")
    if not 1 <= stride <= max_seq_len:
        raise DataError(f"--stride must be between 1 and the context length {max_seq_len}")
    device = next(model.parameters()).device
    # (begin, end, first scored target index) of each window; targets are ids[begin+1 : end+1].
    windows: list[tuple[int, int, int]] = []
    begin, next_target = 0, 1
    while next_target < n:
        end = min(begin + max_seq_len, n - 1)
        windows.append((begin, end, next_target))
        next_target = end + 1
        begin += stride
    total_nats, total_tokens, total_bytes = 0.0, 0, 0
    all_ids = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    for i in range(0, len(windows), batch_size):
        chunk = windows[i : i + batch_size]
        width = max(e - b for b, e, _ in chunk)
        x = torch.zeros(len(chunk), width, dtype=torch.long)
        y = torch.full((len(chunk), width), -100, dtype=torch.long)
        for row, (b, e, first) in enumerate(chunk):
            x[row, : e - b] = all_ids[b:e]
            tgt = all_ids[b + 1 : e + 1].clone()
            tgt[: first - (b + 1)] = -100  # already scored by an earlier window
            y[row, : e - b] = tgt
        with autocast(device, precision):
            logits = model(x.to(device)).logits
        nll = F.cross_entropy(
            logits.float().transpose(1, 2), y.to(device), ignore_index=-100, reduction="sum"
        )
        total_nats += float(nll)
        mask = y >= 0
        total_tokens += int(mask.sum())
        total_bytes += int(token_bytes[y[mask].numpy()].sum())
    loss = total_nats / total_tokens
    return EvalResult(
        loss,
        math.exp(min(loss, 700.0)),
        total_nats / math.log(2) / max(1, total_bytes),
        total_tokens,
        total_bytes,
    )


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """(V,) int64: UTF-8 bytes each token stands for."""
    return np.array(
        [len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size)], dtype=np.int64
    )


MLM_EVAL_SEED = 0  # the masking of `lmlab eval` on an encoder run: the same at every call


@dataclass
class MaskedEvalResult:
    """Masked-LM scores of one text (fixed masking): loss in nats per masked token, perplexity
    = exp(loss), accuracy = share of masked tokens whose argmax prediction is the original."""

    loss: float
    perplexity: float
    accuracy: float
    masked_tokens: int
    tokens: int

    def as_dict(self) -> dict[str, float | int]:
        return {
            "loss": self.loss,
            "perplexity": self.perplexity,
            "masked_accuracy": self.accuracy,
            "masked_tokens": self.masked_tokens,
            "tokens": self.tokens,
        }


@torch.no_grad()
def score_masked(
    model: nn.Module,
    tokenizer: Tokenizer,
    ids: np.ndarray,
    cfg: RunConfig,
    batch_size: int = 8,
    seed: int = MLM_EVAL_SEED,
) -> MaskedEvalResult:
    """Masked-LM loss and accuracy over ``ids`` (N,) int cut into non-overlapping windows of the
    model's context (framed [CLS] ... [SEP] as in training), masked as the run's mlm objective
    masks (``train.mask_prob``, 80/10/10, whole words if set) with a generator seeded ``seed``.
    Raises DataError if the text fills no window."""
    from lmlab.training.objectives import MaskedLM

    seq_len = cfg.model.max_seq_len
    objective = MaskedLM(cfg, tokenizer, {}, seq_len)
    inner = seq_len - (2 if objective.frame else 0)
    n = len(ids) // inner
    if n == 0:
        raise DataError(f"need at least {inner} tokens to score a masked LM, got {len(ids)}")
    rows = np.asarray(ids[: n * inner], dtype=np.int64).reshape(n, inner)
    if objective.frame:
        cls_col, sep_col = (np.full((n, 1), i, dtype=np.int64) for i in objective.frame)
        rows = np.concatenate([cls_col, rows, sep_col], axis=1)
    rng = np.random.default_rng(seed)
    device = next(model.parameters()).device
    nats, correct, count = 0.0, 0, 0
    for i in range(0, n, batch_size):
        batch = objective.mask(rows[i : i + batch_size], rng)
        x, y = batch["input_ids"].to(device), batch["targets"].to(device)
        logits = model(x).logits.float()
        sel = y >= 0
        nats += float(F.cross_entropy(logits[sel], y[sel], reduction="sum"))
        correct += int((logits[sel].argmax(-1) == y[sel]).sum())
        count += int(sel.sum())
    loss = nats / count
    return MaskedEvalResult(loss, math.exp(min(loss, 700.0)), correct / count, count, n * inner)


def evaluate(
    run_dir: str,
    split: str = "val",
    data: str | None = None,
    stride: int | None = None,
    max_tokens: int | None = None,
    device: str = "auto",
    batch_size: int = 8,
) -> EvalResult | MaskedEvalResult | Seq2SeqEvalResult:
    """Score a run's latest checkpoint on its corpus split (``val`` or ``test``) or on ``data``
    (a UTF-8 text file scored whole). ``max_tokens`` keeps the first N tokens.

    An encoder run (masked LM) is scored by :func:`score_masked` (``stride`` does not apply); an
    encoder-decoder run by :func:`lmlab.evaluation.seq2seq.score_pairs` on its corpus's pairs of
    ``split`` (train or val) or on ``data`` (a .tsv/.jsonl pairs file).
    Raises LmlabError for a run without checkpoint, a split the corpus lacks, or bad text.
    """
    if max_tokens is not None and max_tokens < 2:
        raise LmlabError(
            f"--max-tokens must be >= 2 (one token predicts the next), got {max_tokens}"
        )
    run = load_run(run_dir, device)
    if run.config.model.kind == "encoder_decoder":  # seq2seq: exact match on held-out pairs
        return _evaluate_seq2seq(run, split, data, stride, max_tokens, batch_size)
    if data is not None:
        text = read_text(data)
    else:
        if split not in ("train", "val", "test"):
            raise LmlabError(f"--split must be train, val or test, got {split!r}")
        corpus = load_corpus(run.config.data.corpus, run.config.data.val_fraction)
        text = corpus.split(split)
    ids = np.asarray(run.tokenizer.encode(text), dtype=np.int64)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if run.config.model.kind == "encoder":  # a masked LM: accuracy and perplexity on masks
        if stride is not None:
            raise LmlabError("--stride applies to decoder runs; an encoder run is scored whole")
        return score_masked(run.model, run.tokenizer, ids, run.config, batch_size)
    return score_tokens(
        run.model,
        ids,
        token_byte_lengths(run.tokenizer),
        run.config.model.max_seq_len,
        stride,
        batch_size,
    )


def _evaluate_seq2seq(
    run: LoadedRun,
    split: str,
    data: str | None,
    stride: int | None,
    max_tokens: int | None,
    batch_size: int,
) -> Seq2SeqEvalResult:
    from lmlab.data.pairs import is_pairs_source, load_pairs, read_pairs
    from lmlab.evaluation.seq2seq import score_pairs
    from lmlab.training.objectives import encode_pairs

    if stride is not None or max_tokens is not None:
        raise LmlabError("--stride and --max-tokens apply to decoder runs, not seq2seq ones")
    cfg = run.config
    if data is not None:
        text, where, first = read_pairs(data), data, 1
    else:
        if not is_pairs_source(cfg.data.corpus):
            raise LmlabError(
                f"{run.path} was trained on raw text ({cfg.data.corpus}, e.g. span corruption), "
                "which holds no (source, target) pairs: score it with --data PAIRS.tsv"
            )
        splits = load_pairs(cfg.data.corpus, cfg.data.val_fraction)
        if split not in splits:
            raise LmlabError(
                f"corpus {cfg.data.corpus!r} has no {split!r} split; it has: {', '.join(splits)}"
            )
        text, where = splits[split], cfg.data.corpus
        first = 1 if split == "train" else len(splits["train"]) + 1
    eos = cfg.model.seq2seq.eos_token_id
    if eos is None:
        raise LmlabError("model.seq2seq.eos_token_id is not set: the run cannot be scored")
    pairs = encode_pairs(text, run.tokenizer, eos, cfg.model.max_seq_len, where, first)
    return score_pairs(run.model, pairs, batch_size)
