"""Sequence-to-sequence evaluation on held-out (source, target) pairs.

- ``loss``: mean cross-entropy over the target tokens and EOS, teacher-forced (nats/token);
  ``perplexity`` = exp(loss);
- ``token_accuracy``: share of those tokens whose teacher-forced argmax is right;
- ``exact_match``: share of pairs whose greedy decoding (temperature 0, KV cache, stops at EOS)
  equals the target token ids exactly, whole sequence.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from lmlab.config import ModelConfig
from lmlab.errors import LmlabError
from lmlab.generation.generate import SamplingParams
from lmlab.generation.seq2seq import generate_seq2seq


@dataclass
class Seq2SeqEvalResult:
    """Scores of a seq2seq model on ``pairs`` pairs (``tokens`` target tokens incl. EOS)."""

    exact_match: float
    token_accuracy: float
    loss: float
    perplexity: float
    pairs: int
    tokens: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


@torch.no_grad()
def score_pairs(
    model: nn.Module,
    pairs: list[tuple[list[int], list[int]]],
    batch_size: int = 64,
) -> Seq2SeqEvalResult:
    """Score (source ids, target ids ending with EOS) pairs with an encoder-decoder ``model``
    (``model.seq2seq`` pad, start and eos ids set). Raises LmlabError for no pairs or a batch
    size < 1."""
    from lmlab.training.objectives import collate_pairs

    if not pairs:
        raise LmlabError("no pairs to score")
    if batch_size < 1:
        raise LmlabError(f"--batch-size must be >= 1, got {batch_size}")
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    pad, start = cfg.seq2seq.pad_token_id, cfg.seq2seq.decoder_start_token_id
    if pad is None or start is None:
        raise LmlabError("model.seq2seq.pad_token_id and decoder_start_token_id must be set")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    nats, correct, tokens, exact = 0.0, 0, 0, 0
    longest = max(len(y) for _, y in pairs)
    params = SamplingParams(max_new_tokens=longest + 1, temperature=0.0)
    try:
        for i in range(0, len(pairs), batch_size):
            chunk = pairs[i : i + batch_size]
            batch = {k: v.to(device) for k, v in collate_pairs(chunk, pad, start).items()}
            logits = model(**{k: v for k, v in batch.items() if k != "targets"}).logits
            tgt = batch["targets"]
            real = tgt != -100
            logp = torch.log_softmax(logits.float(), -1)
            picked = logp.gather(-1, tgt.clamp_min(0)[..., None])[..., 0]  # (B, T)
            nats -= float(picked[real].sum())
            correct += int((logits.argmax(-1) == tgt)[real].sum())
            tokens += int(real.sum())
            outs = generate_seq2seq(model, [x for x, _ in chunk], params)
            exact += sum(o == y[:-1] for o, (_, y) in zip(outs, chunk, strict=True))
    finally:
        model.train(was_training)
    loss = nats / tokens
    return Seq2SeqEvalResult(
        exact / len(pairs), correct / tokens, loss, math.exp(min(loss, 700.0)), len(pairs), tokens
    )
