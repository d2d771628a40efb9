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
    answer_loss: ClassVar[bool] = False  # True: honours data.loss_on=answers
    uses_token_cache: ClassVar[bool] = True  # False: reads its own data (seq2seq pairs)

    def __init__(
        self, cfg: RunConfig, tokenizer: Tokenizer, splits: Mapping[str, np.ndarray], seq_len: int
    ) -> None:
        self.cfg, self.tokenizer, self.splits, self.seq_len = cfg, tokenizer, splits, seq_len

    @classmethod
    def check(cls, cfg: RunConfig) -> None:
        """The registry's contract check (lmlab.validation): :meth:`validate_config`."""
        cls.validate_config(cfg)

    @classmethod
    def validate_config(cls, cfg: RunConfig) -> None:
        """Cross-field checks on the config alone; raises ConfigError naming the field."""
        if cfg.model.kind not in cls.model_kinds:
            raise ConfigError(
                f"train.objective={cls.name} needs model.kind {' or '.join(cls.model_kinds)}, "
                f"got {cfg.model.kind!r}"
            )
        if cfg.data.loss_on != "all" and not cls.answer_loss:
            raise ConfigError(
                f"data.loss_on={cfg.data.loss_on} applies to train.objective=clm only, not "
                f"{cls.name} (its targets are its own: masked tokens, spans or pairs)"
            )

    def batch(self, split: str, batch_size: int, rng: np.random.Generator) -> Batch:
        """The forward-pass keyword arguments of one micro-batch of ``batch_size`` sequences."""
        raise NotImplementedError

    def tokens_per_batch(self, batch_size: int) -> int:
        """Tokens a micro-batch counts towards ``tokens`` and tokens/s (input positions)."""
        return batch_size * self.seq_len

    @staticmethod
    def n_targets(batch: Batch) -> int:
        """The target tokens of a batch: its ``targets`` entries other than -100, the tokens
        the model's mean loss is taken over. The trainer weights each micro-batch's loss by this
        count, so an optimizer step sees the mean over all its targets (one big batch's loss)."""
        return int((batch["targets"] != -100).sum())


OBJECTIVES: Registry[type[Objective]] = Registry("objective", "train.objective")


@OBJECTIVES.register("clm", "Causal LM: predict each next token (Radford et al. 2018, GPT).")
class CausalLM(Objective):
    """Random windows of seq_len + 1 tokens: input_ids (B, T), targets (B, T) shifted by one.

    With ``data.loss_on: answers`` (passkey and recall corpora, :mod:`lmlab.data.answers`) the
    targets that are not answer tokens are -100, so the loss is the mean cross-entropy over the
    answer tokens only (train and val); a micro-batch whose windows hold no answer is redrawn
    from the same generator (at most :data:`ANSWER_DRAWS` times)."""

    name = "clm"
    answer_loss = True
    ANSWER_DRAWS = 100

    def __init__(
        self, cfg: RunConfig, tokenizer: Tokenizer, splits: Mapping[str, np.ndarray], seq_len: int
    ) -> None:
        super().__init__(cfg, tokenizer, splits, seq_len)
        self.answers: dict[str, np.ndarray] | None = None
        if cfg.data.loss_on == "answers":
            from lmlab.data.answers import token_answers

            self.answers = {
                name: token_answers(cfg.data.corpus, tokenizer, ids) for name, ids in splits.items()
            }

    def batch(self, split: str, batch_size: int, rng: np.random.Generator) -> Batch:
        if self.answers is None:
            x, y = sample_batch(self.splits[split], batch_size, self.seq_len, rng)
            return {"input_ids": x, "targets": y}
        for _ in range(self.ANSWER_DRAWS):
            x, y = sample_batch(
                self.splits[split], batch_size, self.seq_len, rng, self.answers[split]
            )
            if bool((y != -100).any()):
                return {"input_ids": x, "targets": y}
        raise DataError(
            f"data.loss_on=answers: {self.ANSWER_DRAWS} batches of the {split} split in a row "
            "held no answer token; use a longer train.seq_len or train.batch_size"
        )


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
    options = ("mask_prob", "whole_word_mask")

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


def set_seq2seq_ids(cfg: RunConfig, tokenizer: Tokenizer) -> None:
    """Fill ``model.seq2seq`` pad, decoder start (= pad, as T5) and eos ids that are unset
    from the tokenizer's special tokens (encoder-decoder models only; a no-op otherwise)."""
    if cfg.model.kind != "encoder_decoder":
        return
    s = cfg.model.seq2seq
    if s.pad_token_id is None:
        s.pad_token_id = tokenizer.pad_id
    if s.eos_token_id is None:
        s.eos_token_id = tokenizer.eos_id
    if s.decoder_start_token_id is None:
        s.decoder_start_token_id = s.pad_token_id


def _need_seq2seq_specials(cfg: RunConfig, what: str) -> None:
    """An explicit train.objective whose tokenizer config cannot give <pad> and </s>. (The
    default objective of a model-only config (lmlab verify, inspect) is not checked; training
    still stops with the unset model.seq2seq id named, by :func:`_special_ids`.)"""
    t = cfg.data.tokenizer
    if cfg.train.objective is None:
        return
    if t.kind == "char" or (t.kind in ("bpe", "wordlevel") and t.special_tokens != "seq2seq"):
        raise ConfigError(
            f"train.objective={what} needs a tokenizer with <pad> and </s> tokens: set "
            "data.tokenizer.kind=bpe (or wordlevel) and data.tokenizer.special_tokens=seq2seq"
        )


def _special_ids(cfg: RunConfig, what: str) -> tuple[int, int, int]:
    """(pad, decoder start, eos) of ``model.seq2seq``; LmlabError naming an unset one."""
    s = cfg.model.seq2seq
    ids = (s.pad_token_id, s.decoder_start_token_id, s.eos_token_id)
    for name, value in zip(
        ("pad_token_id", "decoder_start_token_id", "eos_token_id"), ids, strict=True
    ):
        if value is None:
            raise LmlabError(
                f"train.objective={what} needs model.seq2seq.{name} (the tokenizer has no such "
                "token: use data.tokenizer.special_tokens=seq2seq)"
            )
    return int(ids[0]), int(ids[1]), int(ids[2])  # type: ignore[arg-type]


def collate_pairs(pairs: list[tuple[list[int], list[int]]], pad: int, start: int) -> Batch:
    """Pad (source ids, target ids ending with EOS) pairs to the longest of the batch.

    Returns input_ids (B, S) int64 (right-padded with ``pad``), attention_mask (B, S) int64
    (1 = real token), targets (B, T) int64 (-100 on padding) and decoder_input_ids (B, T)
    int64: ``start`` then the targets shifted right by one, padding as ``pad`` (teacher
    forcing; the same rule as ``EncoderDecoderLM.shift_right``)."""
    b = len(pairs)
    s = max(len(x) for x, _ in pairs)
    t = max(len(y) for _, y in pairs)
    src = np.full((b, s), pad, dtype=np.int64)
    mask = np.zeros((b, s), dtype=np.int64)
    tgt = np.full((b, t), -100, dtype=np.int64)
    for i, (x, y) in enumerate(pairs):
        src[i, : len(x)], mask[i, : len(x)], tgt[i, : len(y)] = x, 1, y
    dec = np.full((b, t), start, dtype=np.int64)
    dec[:, 1:] = np.where(tgt[:, :-1] == -100, pad, tgt[:, :-1])
    return {
        "input_ids": torch.from_numpy(src),
        "attention_mask": torch.from_numpy(mask),
        "targets": torch.from_numpy(tgt),
        "decoder_input_ids": torch.from_numpy(dec),
    }


def encode_pairs(
    pairs: list[tuple[str, str]],
    tokenizer: Tokenizer,
    eos: int,
    max_len: int,
    where: str,
    first: int = 1,
) -> list[tuple[list[int], list[int]]]:
    """Token ids of (source, target) text pairs: the source as the model reads it
    (``encode_for_model``), the target followed by ``eos``. Raises DataError naming pair
    ``where`` N (the N-th pair of the file, counting from ``first``) when a side exceeds
    ``max_len`` tokens (the decoder reads the start token + target) or a source encodes to
    nothing."""
    out = []
    for n, (src, tgt) in enumerate(pairs, start=first):
        x = tokenizer.encode_for_model(src)
        y = [*tokenizer.encode(tgt), eos]
        side = "source" if len(x) > max_len else "target + </s>" if len(y) > max_len else None
        if side is not None:
            size = len(x) if side == "source" else len(y)
            raise DataError(
                f"{where} pair {n}: the {side} has {size} tokens, more than model.max_seq_len="
                f"{max_len}"
            )
        if not x:
            raise DataError(f"{where} pair {n}: the source has no tokens")
        out.append((x, y))
    return out


@OBJECTIVES.register(
    "seq2seq", "Sequence-to-sequence on (source, target) pairs (Sutskever et al. 2014; T5)."
)
class Seq2Seq(Objective):
    """Teacher-forced seq2seq on the pairs of ``data.corpus`` (:mod:`lmlab.data.pairs`): each
    micro-batch draws ``batch_size`` pairs uniformly with the generator and pads them to the
    longest (:func:`collate_pairs`); the loss is the mean cross-entropy over target tokens
    (EOS included, padding excluded). The token cache is not used."""

    name = "seq2seq"
    model_kinds = ("encoder_decoder",)
    uses_token_cache = False

    def __init__(
        self, cfg: RunConfig, tokenizer: Tokenizer, splits: Mapping[str, np.ndarray], seq_len: int
    ) -> None:
        super().__init__(cfg, tokenizer, splits, seq_len)
        from lmlab.data.pairs import load_pairs

        self.pad, self.start, eos = _special_ids(cfg, self.name)
        text = load_pairs(cfg.data.corpus, cfg.data.val_fraction)
        n_train = len(text["train"])  # pairs are numbered in file order: train, then val
        self.pairs = {
            split: encode_pairs(
                p,
                tokenizer,
                eos,
                cfg.model.max_seq_len,
                cfg.data.corpus,
                1 if split == "train" else n_train + 1,
            )
            for split, p in text.items()
        }
        train = self.pairs["train"]
        self.mean_len = sum(len(x) + len(y) for x, y in train) / len(train)

    @classmethod
    def validate_config(cls, cfg: RunConfig) -> None:
        super().validate_config(cfg)
        _need_seq2seq_specials(cfg, cls.name)

    def batch(self, split: str, batch_size: int, rng: np.random.Generator) -> Batch:
        pairs = self.pairs[split]
        idx = rng.integers(0, len(pairs), size=batch_size)
        return collate_pairs([pairs[i] for i in idx], self.pad, self.start)

    def tokens_per_batch(self, batch_size: int) -> int:
        """Source + target tokens of an average batch (padding not counted)."""
        return round(batch_size * self.mean_len)


SENTINELS = [f"<extra_id_{i}>" for i in range(100)]  # T5's spelling; ids appended in order


def random_segmentation(n_items: int, n_segments: int, rng: np.random.Generator) -> np.ndarray:
    """Lengths (n_segments,) int, each >= 1, summing to ``n_items``: a uniformly random
    composition (``n_segments - 1`` distinct cut points among the ``n_items - 1`` gaps), as
    T5's ``random_spans_noise_mask``."""
    cuts = np.sort(rng.choice(np.arange(1, n_items), size=n_segments - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [n_items]])).astype(np.int64)


def span_corrupt(
    tokens: np.ndarray,
    sentinels: list[int],
    rng: np.random.Generator,
    noise_density: float = 0.15,
    mean_span_length: float = 3.0,
) -> tuple[list[int], list[int]]:
    """T5 span corruption (Raffel et al. 2020, section 3.1.4) of ``tokens`` (L,) int.

    round(L x noise_density) tokens (at least 1, at most L - 1) are dropped in
    round(noise / mean_span_length) spans (at least 1): noise and kept lengths are random
    compositions (:func:`random_segmentation`), interleaved kept, noise, kept, noise, ... (the
    text starts with kept tokens and ends with a noise span). Returns (source, target) ids:
    source = the kept tokens with span k replaced by ``sentinels[k]``; target = ``sentinels[k]``
    followed by span k's tokens for each span, then ``sentinels[n_spans]``. Raises LmlabError
    when ``sentinels`` are too few for the spans."""
    n = len(tokens)
    n_noise = min(max(round(n * noise_density), 1), n - 1)
    n_spans = min(max(round(n_noise / mean_span_length), 1), n - n_noise)
    if n_spans + 1 > len(sentinels):
        raise LmlabError(
            f"{n_spans} spans need {n_spans + 1} sentinel tokens, got {len(sentinels)}"
        )
    noise = random_segmentation(n_noise, n_spans, rng)
    keep = random_segmentation(n - n_noise, n_spans, rng)
    src: list[int] = []
    tgt: list[int] = []
    pos = 0
    for k in range(n_spans):
        src += tokens[pos : pos + keep[k]].tolist()
        pos += int(keep[k])
        src.append(sentinels[k])
        tgt += [sentinels[k], *tokens[pos : pos + noise[k]].tolist()]
        pos += int(noise[k])
    tgt.append(sentinels[n_spans])
    return src, tgt


@OBJECTIVES.register(
    "span_corruption", "T5 span corruption: 15% noise, mean span 3 (Raffel et al. 2020)."
)
class SpanCorruption(Objective):
    """Raw text windows of ``seq_len`` tokens from the token cache, each corrupted by
    :func:`span_corrupt` (``train.noise_density`` 0.15, mean span length 3) with the batch
    generator; the model reads the source and predicts the sentinel-framed spans + EOS.
    Sentinels ``<extra_id_0>`` ... ``<extra_id_99>`` are added to the tokenizer as special
    tokens when the run starts (:meth:`prepare_tokenizer`)."""

    name = "span_corruption"
    model_kinds = ("encoder_decoder",)
    noise_density = 0.15
    mean_span_length = 3.0
    special_tokens = SENTINELS

    def __init__(
        self, cfg: RunConfig, tokenizer: Tokenizer, splits: Mapping[str, np.ndarray], seq_len: int
    ) -> None:
        super().__init__(cfg, tokenizer, splits, seq_len)
        self.pad, self.start, self.eos = _special_ids(cfg, self.name)
        ids = [tokenizer.encode(t) for t in SENTINELS]
        if any(len(i) != 1 for i in ids):
            raise LmlabError(
                "train.objective=span_corruption needs the sentinel tokens <extra_id_N> in the "
                "tokenizer (a run adds them when it starts; this tokenizer lacks them)"
            )
        self.sentinels = [i[0] for i in ids]

    @classmethod
    def validate_config(cls, cfg: RunConfig) -> None:
        super().validate_config(cfg)
        _need_seq2seq_specials(cfg, cls.name)

    def batch(self, split: str, batch_size: int, rng: np.random.Generator) -> Batch:
        x, _ = sample_batch(self.splits[split], batch_size, self.seq_len, rng)
        rows = []
        for row in x.numpy():
            src, tgt = span_corrupt(
                row, self.sentinels, rng, self.noise_density, self.mean_span_length
            )
            rows.append((src, [*tgt, self.eos]))
        return collate_pairs(rows, self.pad, self.start)

    def tokens_per_batch(self, batch_size: int) -> int:
        """Window tokens (the source's kept tokens plus the target's dropped ones)."""
        return batch_size * self.seq_len


def prepare_tokenizer(cfg: RunConfig, tokenizer: Tokenizer) -> Tokenizer:
    """The tokenizer a new run trains with: ``tokenizer`` plus the special tokens its objective
    needs (span corruption: the sentinels), appended after the fitted vocabulary."""
    cls = OBJECTIVES.get(objective_name(cfg), "train.objective")
    extra = [t for t in getattr(cls, "special_tokens", []) if len(tokenizer.encode(t)) != 1]
    hf = getattr(tokenizer, "hf", None)
    if not extra:
        return tokenizer
    if hf is None:
        raise LmlabError(
            f"train.objective={cls.name} needs special tokens that a {tokenizer.kind} tokenizer "
            "cannot hold; use data.tokenizer.kind=bpe or wordlevel"
        )
    from tokenizers import AddedToken

    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra])
    return type(tokenizer)(hf)  # type: ignore[call-arg]


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
