"""Tokenizers: character-level, byte-level BPE and word-level, each saved as one HF
``tokenizer.json``; any other ``tokenizer.json`` (WordPiece, Unigram, ...) loads through the
``tokenizers`` library as :class:`HFTokenizer`.

char and bpe round-trip any UTF-8 text exactly (the character tokenizer only over the characters
it was built from: others are refused with a message naming them); wordlevel round-trips text
whose words are all in its vocabulary (others become [UNK]). ``token_bytes(id)`` gives the exact
UTF-8 bytes a token stands for, so streams and bits-per-byte never split a character.

Special tokens have roles (cls, sep, mask, pad, unk, bos, eos): ``special_id(role)`` is the id,
None when the vocabulary has no such token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from lmlab.checks import choice
from lmlab.config import TokenizerConfig
from lmlab.errors import ConfigError, DataError
from lmlab.registry import Registry

if TYPE_CHECKING:
    from lmlab.config import RunConfig

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_MAX_BYTES = 256 << 20  # tokenizer.json: large multilingual ones are ~35 MB

# Named sets of special tokens (data.tokenizer.special_tokens): role -> spelling.
SPECIAL_TOKEN_SETS: dict[str, dict[str, str]] = {
    "bert": {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"},
    "seq2seq": {"pad": "<pad>", "unk": "<unk>", "bos": "<s>", "eos": "</s>"},
}
# Spellings recognised in any tokenizer.json (BERT, RoBERTa/BART, T5, GPT-2 conventions).
ROLE_OF_SPELLING = {
    "[CLS]": "cls",
    "[SEP]": "sep",
    "[MASK]": "mask",
    "<mask>": "mask",
    "[PAD]": "pad",
    "<pad>": "pad",
    "[UNK]": "unk",
    "<unk>": "unk",
    "<s>": "bos",
    "</s>": "eos",
    EOS_TOKEN: "eos",
}


def _roles(hf: HFTokenizer) -> dict[str, int]:
    """role -> id of the special tokens a HF tokenizer defines, by their usual spellings."""
    out: dict[str, int] = {}
    for i, tok in sorted(hf.get_added_tokens_decoder().items()):
        role = ROLE_OF_SPELLING.get(str(tok.content))
        if role is not None and role not in out:
            out[role] = i
    return out


class Tokenizer(ABC):
    """Text <-> token ids (int). ``eos_id`` is None when the vocabulary has no end token."""

    kind: str
    fit_on_all_splits = False  # True: built from every split's text, not just train
    roles: dict[str, int] = {}  # special-token role -> id (cls, sep, mask, pad, unk, bos, eos)

    def special_id(self, role: str) -> int | None:
        """The id of the special token with ``role`` (cls, sep, mask, pad, unk, bos, eos), or
        None when the vocabulary has none."""
        return self.roles.get(role)

    @property
    def cls_id(self) -> int | None:
        return self.special_id("cls")

    @property
    def sep_id(self) -> int | None:
        return self.special_id("sep")

    @property
    def mask_id(self) -> int | None:
        return self.special_id("mask")

    @property
    def pad_id(self) -> int | None:
        return self.special_id("pad")

    @property
    def bos_id(self) -> int | None:
        return self.special_id("bos")

    def special_ids(self) -> set[int]:
        """Ids of every special token (never masked, never a random replacement)."""
        return set(self.roles.values())

    def mask_token(self) -> str | None:
        """The spelling of the mask token in text (e.g. ``[MASK]``, ``<mask>``), or None."""
        i = self.mask_id
        return None if i is None else self.token_bytes(i).decode("utf-8").strip()

    def encode_for_model(self, text: str) -> list[int]:
        """Token ids framed as the model saw them in training: [CLS] ids [SEP] when the
        vocabulary has both (BERT), else the plain ids."""
        ids = self.encode(text)
        if self.cls_id is not None and self.sep_id is not None:
            return [self.cls_id, *ids, self.sep_id]
        return ids

    def starts_word(self, token_id: int) -> bool:
        """Whether a token begins a new word by itself: a special token, or one whose text
        starts with whitespace (byte-level BPE, wordlevel). A token after whitespace also begins
        one (the caller checks that)."""
        b = self.token_bytes(token_id)
        return token_id in self.special_ids() or not b or b[:1].isspace()

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
TOKENIZERS.notes = """
When to use: `char` (Karpathy 2015, char-rnn) for tinyshakespeare and teaching; `bpe` for any
other text, multilingual without unknown characters; `wordlevel` (or `bpe` with
`special_tokens: bert`) for masked LMs; `hf` is what a model that ships its own
`tokenizer.json` imports as, and is never fitted to a corpus.
"""


def check_special_tokens(cfg: RunConfig) -> None:
    """``data.tokenizer.special_tokens``, when set, names a set of SPECIAL_TOKEN_SETS."""
    name = cfg.data.tokenizer.special_tokens
    if name is not None:
        choice(name, SPECIAL_TOKEN_SETS, "data.tokenizer.special_tokens")


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
    options = ("special_tokens",)

    @staticmethod
    def check(cfg: RunConfig) -> None:
        """A known special-token set; vocab_size >= 258 (256 bytes, <|endoftext|>, a merge)."""
        check_special_tokens(cfg)
        if cfg.data.tokenizer.vocab_size < 258:
            raise ConfigError(
                "data.tokenizer.vocab_size must be >= 258 for bpe (256 bytes + <|endoftext|> + "
                f"1 merge), got {cfg.data.tokenizer.vocab_size}"
            )

    def __init__(self, hf: HFTokenizer) -> None:
        self.hf = hf
        self.roles = _roles(hf)
        self._eos = self.roles.get("eos")
        self._special = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
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
            special_tokens=_special_tokens(cfg.special_tokens, [EOS_TOKEN]),
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
        return self.roles.get("eos")

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return b"".join(self._bytes[i] for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    def save(self, path: str | Path) -> None:
        self.hf.save(str(path))


def _special_tokens(name: str | None, default: list[str]) -> list[str | AddedToken]:
    """The special tokens of a named set; the mask token strips the space before it (so
    ``the [MASK].`` masks the word `` question`` whole, as RoBERTa's ``<mask>`` does)."""
    if name is None:
        return list(default)
    return [
        AddedToken(t, special=True, lstrip=role == "mask", normalized=False)
        for role, t in SPECIAL_TOKEN_SETS[name].items()
    ]


# A word with its leading space, a run of punctuation with its leading space, or whitespace.
WORD_PATTERN = r" ?\w+| ?[^\w\s]+|\s+"


@TOKENIZERS.register("wordlevel")
class WordLevelTokenizer(Tokenizer):
    """One token per word (with its leading space), punctuation run or whitespace run: the
    ``vocab_size`` most frequent of the train split, the rest [UNK]. A word vocabulary lets a
    masked LM fill a whole word (a character one cannot)."""

    kind = "wordlevel"
    options = ("special_tokens",)
    check = staticmethod(check_special_tokens)

    def __init__(self, hf: HFTokenizer) -> None:
        self.hf = hf
        self.roles = _roles(hf)
        vocab = hf.get_vocab()
        self._tokens = [""] * hf.get_vocab_size()
        for tok, i in vocab.items():
            self._tokens[i] = tok

    @classmethod
    def train(cls, text: str, cfg: TokenizerConfig) -> WordLevelTokenizer:
        name = cfg.special_tokens or "bert"
        hf = HFTokenizer(models.WordLevel(unk_token=SPECIAL_TOKEN_SETS[name]["unk"]))
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(WORD_PATTERN), behavior="isolated")
        hf.decoder = decoders.Fuse()
        specials = _special_tokens(name, [])
        trainer = trainers.WordLevelTrainer(
            vocab_size=cfg.vocab_size, special_tokens=specials, show_progress=False
        )
        hf.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
        return cls(hf)

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def eos_id(self) -> int | None:
        return self.roles.get("eos")

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return "".join(self._tokens[i] for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        return self._tokens[token_id].encode("utf-8")

    def save(self, path: str | Path) -> None:
        self.hf.save(str(path))


@TOKENIZERS.register("hf")
class PretrainedTokenizer(Tokenizer):
    """Any Hugging Face ``tokenizer.json`` (WordPiece, Unigram, Metaspace BPE, ...) run by the
    ``tokenizers`` library, as it ships with a model (e.g. BERT's uncased WordPiece lowercases,
    so it round-trips only lowercase text). Padding and truncation in the file are turned off.

    It is never fitted to a corpus: a run gets one from ``lmlab import`` or ``--init-from``."""

    kind = "hf"

    @classmethod
    def train(cls, text: str, cfg: TokenizerConfig) -> PretrainedTokenizer:
        raise DataError(
            "data.tokenizer.kind=hf is a pretrained model's own tokenizer.json and cannot be "
            "fitted to a corpus; start from the model with lmlab train --init-from MODEL, or "
            "choose char, bpe or wordlevel"
        )

    def __init__(self, hf: HFTokenizer) -> None:
        self.hf = hf
        hf.no_padding()
        hf.no_truncation()
        self.roles = _roles(hf)
        self._prefix = getattr(hf.model, "continuing_subword_prefix", None) or ""

    @property
    def vocab_size(self) -> int:
        return int(self.hf.get_vocab_size())

    @property
    def eos_id(self) -> int | None:
        return self.roles.get("eos")

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False).ids)

    def encode_for_model(self, text: str) -> list[int]:
        """The ids with the specials the file's post-processor adds (BERT: [CLS] ... [SEP])."""
        return list(self.hf.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=False))

    def token_bytes(self, token_id: int) -> bytes:
        """The token's text (a WordPiece continuation without its ``##``), as UTF-8."""
        tok = self.hf.id_to_token(token_id) or ""
        if self._prefix and tok.startswith(self._prefix):
            tok = tok[len(self._prefix) :]
        return tok.encode("utf-8")

    def starts_word(self, token_id: int) -> bool:
        if self._prefix:  # WordPiece: every token but a ## continuation begins a word
            return not (self.hf.id_to_token(token_id) or "").startswith(self._prefix)
        return super().starts_word(token_id)

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
    """Read a ``tokenizer.json``: lmlab's own kinds (char, bpe, wordlevel) by their layout, any
    other through the ``tokenizers`` library (:class:`PretrainedTokenizer`), with the chat
    template and specials of a ``tokenizer_config.json`` beside it
    (:func:`lmlab.data.tokenizer_config.apply_tokenizer_config`). Raises DataError if it is
    missing, not a regular file, over :data:`TOKENIZER_MAX_BYTES`, not strict JSON or
    unreadable."""
    from lmlab.data.tokenizer_config import apply_tokenizer_config

    return apply_tokenizer_config(_read_tokenizer_json(path), Path(path).parent)


def _read_tokenizer_json(path: str | Path) -> Tokenizer:
    from lmlab.safeio import parse_json, read_bytes

    p = Path(path)
    raw = read_bytes(p, "tokenizer file", TOKENIZER_MAX_BYTES, DataError)  # read once, bounded
    try:
        text = raw.decode("utf-8")
        spec = parse_json(text, "its text", DataError)  # strict: NaN, duplicate keys refused
        model_type = spec["model"]["type"]
        if model_type == "WordLevel":
            vocab = spec["model"]["vocab"]
            if not spec.get("added_tokens") and all(len(t) == 1 for t in vocab):
                return CharTokenizer(sorted(vocab, key=vocab.__getitem__))
            return WordLevelTokenizer(HFTokenizer.from_str(text))
        decoder = spec.get("decoder") or {}
        if model_type == "BPE" and decoder.get("type") == "ByteLevel":
            return BPETokenizer(HFTokenizer.from_str(text))
        return PretrainedTokenizer(HFTokenizer.from_str(text))
    except Exception as e:  # the tokenizers library raises plain Exception
        raise DataError(f"tokenizer file {p} is corrupt or not a tokenizer.json: {e}") from None
