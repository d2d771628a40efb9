"""Tokenizers: character-level and byte-level BPE, each saved as one HF ``tokenizer.json``.

Both round-trip any UTF-8 text exactly (the character tokenizer only over the characters it was
built from: others are refused with a message naming them). ``token_bytes(id)`` gives the exact
UTF-8 bytes a token stands for, so streams and bits-per-byte never split a character.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from functools import cache
from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from lmlab.config import TokenizerConfig
from lmlab.errors import DataError
from lmlab.registry import Registry

EOS_TOKEN = "<|endoftext|>"


class Tokenizer(ABC):
    """Text <-> token ids (int). ``eos_id`` is None when the vocabulary has no end token."""

    kind: str
    fit_on_all_splits = False  # True: built from every split's text, not just train

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def eos_id(self) -> int | None: ...

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; raises DataError if the text cannot be represented."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str: ...

    @abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes token ``token_id`` stands for (possibly part of a character)."""

    @abstractmethod
    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json`` (Hugging Face tokenizers format)."""


TOKENIZERS: Registry[type[Tokenizer]] = Registry("tokenizer", "data.tokenizer.kind")


def _char_hf_tokenizer(chars: list[str]) -> HFTokenizer:
    vocab = {c: i for i, c in enumerate(chars)}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok


@TOKENIZERS.register("char")
class CharTokenizer(Tokenizer):
    """One token per Unicode character of the corpus (all splits), ids in sorted order."""

    kind = "char"
    fit_on_all_splits = True  # a character missing from train must still encode in val/test

    def __init__(self, chars: list[str]) -> None:
        self.chars = list(chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def train(cls, text: str, cfg: TokenizerConfig) -> CharTokenizer:
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    @property
    def eos_id(self) -> int | None:
        return None

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError:
            unknown = sorted({c for c in text if c not in self.stoi})
            shown = ", ".join(repr(c) for c in unknown[:10])
            more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
            raise DataError(
                f"text has {len(unknown)} character(s) outside this character-level vocabulary "
                f"({self.vocab_size} characters): {shown}{more}"
            ) from None

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        return self.chars[token_id].encode("utf-8")

    def save(self, path: str | Path) -> None:
        _char_hf_tokenizer(self.chars).save(str(path))


@cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable-character table used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


@TOKENIZERS.register("bpe")
class BPETokenizer(Tokenizer):
    """Byte-level BPE (Radford et al. 2019; Sennrich et al. 2016) trained with ``tokenizers``."""

    kind = "bpe"

    def __init__(self, hf: HFTokenizer) -> None:
        self.hf = hf
        self._eos = hf.token_to_id(EOS_TOKEN)
        self._special = {i for t, i in hf.get_vocab().items() if t == EOS_TOKEN}
        table = _unicode_to_byte()
        self._bytes: list[bytes] = [b""] * hf.get_vocab_size()
        for tok, i in hf.get_vocab().items():
            if i in self._special:
                self._bytes[i] = tok.encode("utf-8")
            else:
                self._bytes[i] = bytes(table[c] for c in tok)

    @classmethod
    def train(cls, text: str, cfg: TokenizerConfig) -> BPETokenizer:
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=cfg.vocab_size,
            special_tokens=[EOS_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
        return cls(hf)

    @property
    def vocab_size(self) -> int:
        return int(self.hf.get_vocab_size())

    @property
    def eos_id(self) -> int | None:
        return self._eos

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return b"".join(self._bytes[i] for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    def save(self, path: str | Path) -> None:
        self.hf.save(str(path))


def train_tokenizer(text: str, cfg: TokenizerConfig) -> Tokenizer:
    """Build the tokenizer named by ``cfg.kind`` from ``text``."""
    cls = TOKENIZERS.get(cfg.kind, "data.tokenizer.kind")
    return cls.train(text, cfg)  # type: ignore[attr-defined]


def fit_tokenizer(splits: dict[str, str], cfg: TokenizerConfig) -> Tokenizer:
    """Build the tokenizer for a corpus: from the train split, or from every split for kinds
    that must cover every character (``fit_on_all_splits``)."""
    cls = TOKENIZERS.get(cfg.kind, "data.tokenizer.kind")
    text = "".join(splits.values()) if cls.fit_on_all_splits else splits["train"]
    return train_tokenizer(text, cfg)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Read a ``tokenizer.json`` written by :meth:`Tokenizer.save`. Raises DataError if it is
    missing, unreadable, or of a kind lmlab does not know."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"tokenizer file not found: {p}")
    try:
        spec = json.loads(p.read_text(encoding="utf-8"))
        model_type = spec["model"]["type"]
        if model_type == "WordLevel":
            vocab = spec["model"]["vocab"]
            return CharTokenizer(sorted(vocab, key=vocab.__getitem__))
        if model_type == "BPE":
            return BPETokenizer(HFTokenizer.from_file(str(p)))
    except Exception as e:  # the tokenizers library raises plain Exception
        raise DataError(f"tokenizer file {p} is corrupt or not a tokenizer.json: {e}") from None
    raise DataError(f"tokenizer file {p} holds a {model_type} model; lmlab reads WordLevel or BPE")
