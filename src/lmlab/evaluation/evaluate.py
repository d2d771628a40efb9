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
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lmlab.config import ModelConfig, RunConfig
from lmlab.data.corpus import load_data, read_text
from lmlab.data.tokenizer import Tokenizer
from lmlab.errors import DataError, LmlabError
from lmlab.evaluation.seq2seq import Seq2SeqEvalResult
from lmlab.interop.load import load
from lmlab.run import CONFIG_FILE, read_run_config
from lmlab.training.hardware import autocast

LOGITS_BYTES = 1 << 30  # bound on the logits one forward pass of score_tokens holds


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
    # at most ~LOGITS_BYTES of float32 logits per forward pass (a 49k vocabulary x 8k context
    # is 1.6 GB per window)
    per_window = max_seq_len * max(1, len(token_bytes)) * 4
    batch_size = max(1, min(batch_size, LOGITS_BYTES // per_window))
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
        logits = model(x, targets=y).logits.float()  # (M, V): the masked positions only
        y = y[y != -100]  # (M,), the same row-major order
        nats += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(-1) == y).sum())
        count += len(y)
    loss = nats / count
    return MaskedEvalResult(loss, math.exp(min(loss, 700.0)), correct / count, count, n * inner)


def evaluate(
    model_path: str,
    split: str = "val",
    data: str | None = None,
    stride: int | None = None,
    max_tokens: int | None = None,
    device: str = "auto",
    batch_size: int = 8,
    quantize: str | None = None,
) -> EvalResult | MaskedEvalResult | Seq2SeqEvalResult:
    """Score a model on ``data`` (a UTF-8 text file scored whole) or, for an lmlab run folder,
    on its corpus split (``train``, ``val`` or ``test``). ``model_path`` is anything
    :func:`lmlab.interop.load.load` accepts (run folder, Hugging Face folder, ``.gguf`` file);
    windows are the model's context (``model.cfg.max_seq_len``). ``max_tokens`` keeps the first
    N tokens.

    Raises LmlabError for a run without checkpoint, a split asked of a model that is not a run
    folder (it has no corpus), a model without tokenizer, a split the corpus lacks, bad text, or
    an encoder-decoder model (it has no single text to score).

    An encoder (masked LM) is scored by :func:`score_masked` (``stride`` does not apply); an
    encoder-decoder by :func:`lmlab.evaluation.seq2seq.score_pairs` on its run's pairs of
    ``split`` (train or val) or on ``data`` (a .tsv/.jsonl pairs file).
    """
    if max_tokens is not None and max_tokens < 2:
        raise LmlabError(
            f"--max-tokens must be >= 2 (one token predicts the next), got {max_tokens}"
        )
    if (
        data is None
        and Path(model_path).exists()
        and not (Path(model_path) / CONFIG_FILE).is_file()
    ):
        raise LmlabError(
            f"{model_path} is not an lmlab run folder, so it has no corpus split: give --data FILE"
        )
    if data is None and split not in ("train", "val", "test"):
        raise LmlabError(f"--split must be train, val or test, got {split!r}")
    if quantize is not None:  # a bad spec fails before the load
        from lmlab.nn.quant import parse_spec

        parse_spec(quantize)
    text = read_text(data) if data is not None else None  # bad text fails before loading
    model, tokenizer = load(model_path, device, quantize)
    if tokenizer is None:
        from lmlab.interop.load import no_tokenizer

        raise no_tokenizer(model_path, "scored")
    if getattr(model.cfg, "kind", None) == "encoder_decoder":  # seq2seq: exact match on pairs
        return _evaluate_seq2seq(model_path, model, tokenizer, split, data, stride, max_tokens,
                                 batch_size)  # fmt: skip
    if text is None:
        cfg = read_run_config(model_path)
        text = load_data(cfg.data).split(split)
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    model_cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    if model_cfg.kind not in ("decoder", "encoder"):  # no source/target pairs to score here
        raise LmlabError(
            f"lmlab eval scores decoders (next-token loss) and encoders (masked tokens); "
            f"{model_path} is model.kind={model_cfg.kind}"
        )
    if model_cfg.kind == "encoder":  # a masked LM: accuracy and perplexity on masks
        if stride is not None:
            raise LmlabError("--stride applies to decoder runs; an encoder run is scored whole")
        is_run = (Path(model_path) / CONFIG_FILE).is_file()
        run_cfg = read_run_config(model_path) if is_run else RunConfig(model=model_cfg)
        return score_masked(model, tokenizer, ids, run_cfg, batch_size)
    return score_tokens(
        model,
        ids,
        token_byte_lengths(tokenizer),
        int(model.cfg.max_seq_len),  # type: ignore[union-attr,arg-type]
        stride,
        batch_size,
    )


def _evaluate_seq2seq(
    model_path: str,
    model: nn.Module,
    tokenizer: Tokenizer,
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
    model_cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    if data is not None:
        text, where, first = read_pairs(data), data, 1
    else:
        cfg = read_run_config(model_path)
        if not is_pairs_source(cfg.data.corpus):
            raise LmlabError(
                f"{model_path} was trained on raw text ({cfg.data.corpus}, e.g. span corruption), "
                "which holds no (source, target) pairs: score it with --data PAIRS.tsv"
            )
        splits = load_pairs(cfg.data.corpus, cfg.data.val_fraction)
        if split not in splits:
            raise LmlabError(
                f"corpus {cfg.data.corpus!r} has no {split!r} split; it has: {', '.join(splits)}"
            )
        text, where = splits[split], cfg.data.corpus
        first = 1 if split == "train" else len(splits["train"]) + 1
    eos = model_cfg.seq2seq.eos_token_id
    if eos is None:
        raise LmlabError("model.seq2seq.eos_token_id is not set: the model cannot be scored")
    pairs = encode_pairs(text, tokenizer, eos, model_cfg.max_seq_len, where, first)
    return score_pairs(model, pairs, batch_size)
