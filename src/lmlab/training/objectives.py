"""Training objectives, chosen by ``train.objective``: each owns its batches and its loss.

An :class:`Objective` is built once per run from the config, the tokenizer and the token cache
(split -> (N,) ids); ``batch(split, batch_size, rng)`` returns the keyword arguments of the
model's forward pass (``input_ids``, ``targets``, and whatever else the objective needs), so the
model computes the loss. Batches are pure functions of the generator, which the trainer derives
from (seed, step, micro-batch, rank): a resumed run redraws exactly the same batches.

Legend: B batch, T tokens per sequence.

- ``clm``: causal language modelling, next-token prediction on random windows (Radford et al.).
- ``mlm``: masked language modelling (Devlin et al. 2019, BERT): 15% of the tokens are selected,
  of which 80% become [MASK], 10% a random token and 10% stay; the loss is over the selected.
  Special and whitespace-only tokens are never selected.

A new objective (seq2seq on its own (source, target) data, span corruption) registers a subclass
here; it may ignore the token cache and read its own data in ``__init__``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from lmlab.data.dataset import sample_batch
from lmlab.errors import ConfigError, DataError, LmlabError
from lmlab.registry import Registry

if TYPE_CHECKING:
    from lmlab.config import RunConfig
    from lmlab.data.tokenizer import Tokenizer

Batch = dict[str, torch.Tensor]


class Objective:
    """Base class. ``splits``: split name -> (N,) token ids (the run's token cache)."""

    name: ClassVar[str]
    model_kinds: ClassVar[tuple[str, ...]] = ("decoder",)  # model.kind values it trains

    def __init__(
        self, cfg: RunConfig, tokenizer: Tokenizer, splits: Mapping[str, np.ndarray], seq_len: int
    ) -> None:
        self.cfg, self.tokenizer, self.splits, self.seq_len = cfg, tokenizer, splits, seq_len

    @classmethod
    def validate_config(cls, cfg: RunConfig) -> None:
        """Cross-field checks on the config alone; raises ConfigError naming the field."""
        if cfg.model.kind not in cls.model_kinds:
            raise ConfigError(
                f"train.objective={cls.name} needs model.kind {' or '.join(cls.model_kinds)}, "
                f"got {cfg.model.kind!r}"
            )

    def batch(self, split: str, batch_size: int, rng: np.random.Generator) -> Batch:
        """The forward-pass keyword arguments of one micro-batch of ``batch_size`` sequences."""
        raise NotImplementedError

    def tokens_per_batch(self, batch_size: int) -> int:
        """Tokens a micro-batch counts towards ``tokens`` and tokens/s (input positions)."""
        return batch_size * self.seq_len


OBJECTIVES: Registry[type[Objective]] = Registry("objective", "train.objective")


@OBJECTIVES.register("clm", "Causal LM: predict each next token (Radford et al. 2018, GPT).")
class CausalLM(Objective):
    """Random windows of seq_len + 1 tokens: input_ids (B, T), targets (B, T) shifted by one."""

    name = "clm"

    def batch(self, split: str, batch_size: int, rng: np.random.Generator) -> Batch:
        x, y = sample_batch(self.splits[split], batch_size, self.seq_len, rng)
        return {"input_ids": x, "targets": y}


@OBJECTIVES.register("mlm", "Masked LM: 15% selected, 80/10/10 (Devlin et al. 2019, BERT).")
class MaskedLM(Objective):
    """Random windows framed [CLS] ... [SEP] (when the tokenizer has both), with
    ``train.mask_prob`` of the maskable tokens (round(p * n), at least 1 per sequence) selected
    for prediction: 80% replaced by [MASK], 10% by a random ordinary token, 10% kept
    (Devlin et al. 2019). Special tokens are never selected, nor are whitespace-only tokens
    (the newline and space runs of a word-level or byte-level BPE vocabulary): BERT's WordPiece
    has no such tokens, and in verse they are so frequent (11% of tinyshakespeare's word-level
    tokens) and so easy that a small model learns to answer "\n" to every mask; they stay in
    the input as context. With ``train.whole_word_mask`` whole words are selected until the
    budget is filled (Cui et al. 2019, "whole word masking").

    Batch: input_ids (B, T) int64 with the replacements, targets (B, T) int64 = the original
    token at selected positions, -100 elsewhere.
    """

    name = "mlm"
    model_kinds = ("encoder",)

    def __init__(
        self, cfg: RunConfig, tokenizer: Tokenizer, splits: Mapping[str, np.ndarray], seq_len: int
    ) -> None:
        super().__init__(cfg, tokenizer, splits, seq_len)
        self.mask_prob = cfg.train.mask_prob
        self.whole_word = cfg.train.whole_word_mask
        mask_id = tokenizer.mask_id
        if mask_id is None:
            raise LmlabError(
                "train.objective=mlm needs a tokenizer with a mask token; set "
                "data.tokenizer.kind=wordlevel (or bpe with data.tokenizer.special_tokens=bert)"
            )
        self.mask_id = mask_id
        v = tokenizer.vocab_size
        self.is_special = np.zeros(v, dtype=bool)
        self.is_special[list(tokenizer.special_ids())] = True
        self.ordinary = np.flatnonzero(~self.is_special)  # random replacements come from here
        blank = np.array([tokenizer.token_bytes(i).isspace() for i in range(v)], dtype=bool)
        self.maskable = ~self.is_special & ~blank  # tokens that may be selected for prediction
        cls_id, sep_id = tokenizer.cls_id, tokenizer.sep_id
        self.frame = (cls_id, sep_id) if cls_id is not None and sep_id is not None else None
        self.starts_word = np.array([tokenizer.starts_word(i) for i in range(v)], dtype=bool)
        self.ends_space = np.array(
            [tokenizer.token_bytes(i)[-1:].isspace() for i in range(v)], dtype=bool
        )

    @classmethod
    def validate_config(cls, cfg: RunConfig) -> None:
        super().validate_config(cfg)
        if not 0.0 < cfg.train.mask_prob < 1.0:
            raise ConfigError(f"train.mask_prob must be in (0, 1), got {cfg.train.mask_prob}")
        if cfg.data.tokenizer.kind == "char":
            raise ConfigError(
                "train.objective=mlm needs a tokenizer with a [MASK] token: "
                "data.tokenizer.kind=wordlevel, or bpe with data.tokenizer.special_tokens=bert "
                "(a character vocabulary cannot fill a word)"
            )
        if cfg.data.tokenizer.kind == "bpe" and cfg.data.tokenizer.special_tokens != "bert":
            raise ConfigError(
                "train.objective=mlm with data.tokenizer.kind=bpe needs "
                "data.tokenizer.special_tokens=bert (for its [MASK] token)"
            )

    def windows(self, split: str, batch_size: int, rng: np.random.Generator) -> np.ndarray:
        """(B, T) int64 token windows, framed [CLS] ... [SEP] when the tokenizer has both."""
        inner = self.seq_len - (2 if self.frame else 0)
        x, _ = sample_batch(self.splits[split], batch_size, inner, rng)
        rows = x.numpy()
        if self.frame:
            cls_col = np.full((batch_size, 1), self.frame[0], dtype=np.int64)
            sep_col = np.full((batch_size, 1), self.frame[1], dtype=np.int64)
            rows = np.concatenate([cls_col, rows, sep_col], axis=1)
        return rows

    def batch(self, split: str, batch_size: int, rng: np.random.Generator) -> Batch:
        return self.mask(self.windows(split, batch_size, rng), rng)

    def word_ids(self, row: np.ndarray) -> np.ndarray:
        """(T,) -> (T,) int: the index of the word each token belongs to. A token begins a word
        when :meth:`Tokenizer.starts_word` says so or the token before it ends in whitespace
        (or is special); with whole-word masking off every token is its own word."""
        if not self.whole_word:
            return np.arange(len(row))
        starts = self.starts_word[row].copy()
        starts[1:] |= self.ends_space[row[:-1]] | self.is_special[row[:-1]]
        starts[0] = True
        return np.cumsum(starts) - 1

    def mask(self, rows: np.ndarray, rng: np.random.Generator) -> Batch:
        """Apply BERT's masking to (B, T) int64 token rows with ``rng``. Returns input_ids and
        targets (B, T) int64. Raises DataError if a row has no maskable token (only special
        or whitespace-only ones)."""
        inputs = rows.copy()
        targets = np.full_like(rows, -100)
        for b, row in enumerate(rows):
            words = self.word_ids(row)
            candidates = self.maskable[row]
            n = int(candidates.sum())
            if n == 0:
                raise DataError(
                    "a masked-LM sequence holds only special and whitespace tokens: nothing to mask"
                )
            budget = max(1, round(self.mask_prob * n))
            chosen = np.zeros(len(row), dtype=bool)
            count = 0
            for w in rng.permutation(np.unique(words[candidates])):
                members = (words == w) & candidates
                k = int(members.sum())
                if count + k > budget and count > 0:
                    continue
                chosen |= members
                count += k
                if count >= budget:
                    break
            idx = np.flatnonzero(chosen)
            targets[b, idx] = row[idx]
            u = rng.random(len(idx))
            replace = idx[u < 0.8]
            inputs[b, replace] = self.mask_id
            randomise = idx[(u >= 0.8) & (u < 0.9)]
            inputs[b, randomise] = rng.choice(self.ordinary, size=len(randomise))
        return {"input_ids": torch.from_numpy(inputs), "targets": torch.from_numpy(targets)}


# The objective a model kind trains with when train.objective is not set.
DEFAULT_OBJECTIVE = {"decoder": "clm", "encoder": "mlm", "encoder_decoder": "seq2seq"}


def objective_name(cfg: RunConfig) -> str:
    """``train.objective``, or the model kind's default (decoder clm, encoder mlm)."""
    return cfg.train.objective or DEFAULT_OBJECTIVE.get(cfg.model.kind, "clm")


def build_objective(
    cfg: RunConfig, tokenizer: Tokenizer, splits: Mapping[str, np.ndarray], seq_len: int
) -> Objective:
    """The objective named by ``cfg.train.objective`` for this run's tokenizer and data."""
    return OBJECTIVES.get(objective_name(cfg), "train.objective")(cfg, tokenizer, splits, seq_len)
