"""The tokenizer stored in a GGUF file's metadata, as an lmlab ``Tokenizer``.

``tokenizer.ggml.model: gpt2`` is byte-level BPE (Radford et al. 2019): ``tokenizer.ggml.tokens``
(the vocabulary, in GPT-2's printable-character form of the bytes), ``tokenizer.ggml.merges``
("a b" pairs, in priority order), ``tokenizer.ggml.token_type`` (1 normal, 3 control, 4
user-defined ...), ``tokenizer.ggml.bos/eos/padding_token_id``, ``tokenizer.ggml.pre`` (which
pre-tokenizer splits the text before BPE) and ``tokenizer.chat_template`` (Jinja); a special id
outside the vocabulary is ignored with a warning (as llama.cpp does). It is rebuilt
as a Hugging Face ``tokenizers`` BPE tokenizer; control and user-defined tokens are special tokens
matched whole in the text (so a chat template's ``<|im_start|>`` is one token).

A merge that can never apply (a part that is neither one byte character nor made by another
merge, like the placeholder ``lmlab gguf_export`` writes for a character-level vocabulary, since
llama.cpp needs at least one merge) is dropped: llama.cpp keeps it as an unused rank.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from lmlab.data.tokenizer import BPETokenizer, CharTokenizer, _unicode_to_byte
from lmlab.errors import LmlabError
from lmlab.interop.hf_fields import MAX_VOCAB

TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4

# tokenizer.ggml.pre -> the pre-tokenizer llama.cpp applies for it
PRE_TOKENIZERS = {
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    # llama.cpp's own name for GPT-2's split (what lmlab's bpe tokenizer uses)
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    # SmolLM: every digit alone, then GPT-2's split
    "smollm": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    ),
    # Llama 3: its own split regex, then bytes -> printable characters
    "llama-bpe": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(
                    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
                ),
                behavior="isolated",
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    ),
}


class GGUFTokenizer(BPETokenizer):
    """Byte-level BPE rebuilt from GGUF metadata. Besides the Tokenizer interface it carries the
    model's special tokens and chat template:

    ``bos_id``/``pad_id`` (int or None), ``eos_id`` (the end-of-sequence id, for a chat model
    the end of a turn: ``<|im_end|>`` in ChatML), ``stop_ids`` (every id that ends generation:
    eos and ``tokenizer.ggml.eot_token_id``), ``special_ids`` (control and user-defined tokens),
    ``chat_template`` (Jinja source or None), ``bos_token``/``eos_token`` (their text).
    """

    def __init__(
        self,
        hf: HFTokenizer,
        special_ids: set[int],
        eos_id: int | None,
        bos_id: int | None = None,
        pad_id: int | None = None,
        stop_ids: set[int] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.hf = hf
        self._eos = eos_id
        self._special = set(special_ids)
        roles = {"bos": bos_id, "pad": pad_id, "eos": eos_id}  # Tokenizer.special_id roles
        self.roles = {role: i for role, i in roles.items() if i is not None}
        self.stop_ids = set(stop_ids or ()) | ({eos_id} if eos_id is not None else set())
        self.chat_template = chat_template
        table = _unicode_to_byte()
        vocab = hf.get_vocab()
        self._bytes: list[bytes] = [b""] * (max(vocab.values()) + 1)
        for tok, i in vocab.items():
            if i in self._special or any(c not in table for c in tok):
                self._bytes[i] = tok.encode("utf-8")
            else:
                self._bytes[i] = bytes(table[c] for c in tok)

    @property
    def bos_token(self) -> str:
        return "" if self.bos_id is None else str(self.hf.id_to_token(self.bos_id))

    @property
    def eos_token(self) -> str:
        return "" if self._eos is None else str(self.hf.id_to_token(self._eos))


def _list_of(meta: dict[str, Any], key: str, kind: type, path: Path, most: int) -> list[Any]:
    """Metadata ``key`` as a list of at most ``most`` values of ``kind`` (absent: [])."""
    value = meta.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > most:
        raise LmlabError(f"{path}: {key} must be a list of at most {most:,} {kind.__name__}s")
    bad = next((v for v in value if isinstance(v, bool) or not isinstance(v, kind)), None)
    if bad is not None:
        raise LmlabError(f"{path}: {key} holds {bad!r}, not a {kind.__name__}")
    return value


def char_tokenizer(meta: dict[str, Any], path: Path) -> CharTokenizer:
    """The character tokenizer an lmlab export wrote (``lmlab.tokenizer.kind: char``): each
    token is one character's UTF-8 bytes in GPT-2's byte characters. Raises LmlabError for a
    token that is not exactly one character, or a character twice."""
    table = _unicode_to_byte()
    chars = []
    for tok in _list_of(meta, "tokenizer.ggml.tokens", str, path, MAX_VOCAB):
        try:
            c = bytes(table[s] for s in tok).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            c = ""
        if len(c) != 1:
            raise LmlabError(
                f"{path}: token {tok!r} of a character vocabulary (lmlab.tokenizer.kind) is not "
                "one character in byte-level form"
            )
        chars.append(c)
    if not chars or len(set(chars)) != len(chars):
        raise LmlabError(f"{path}: the character vocabulary is empty or holds a character twice")
    return CharTokenizer(chars)


def gguf_tokenizer(meta: dict[str, Any], path: Path) -> GGUFTokenizer | CharTokenizer:
    """Build the tokenizer a GGUF file's metadata describes: lmlab's own character tokenizer for
    a file an lmlab export marked ``lmlab.tokenizer.kind: char``, else byte-level BPE. Raises
    LmlabError for a tokenizer model other than ``gpt2`` (byte-level BPE) or a pre-tokenizer
    lmlab does not know, naming it."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2" and meta.get("lmlab.tokenizer.kind") == "char":
        return char_tokenizer(meta, path)
    if kind != "gpt2":
        raise LmlabError(
            f"{path}: tokenizer.ggml.model {kind!r} is not supported; supported: gpt2 "
            "(byte-level BPE)"
        )
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if not isinstance(pre, str) or pre not in PRE_TOKENIZERS:
        raise LmlabError(
            f"{path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; supported: "
            f"{', '.join(PRE_TOKENIZERS)}"
        )
    tokens = _list_of(meta, "tokenizer.ggml.tokens", str, path, MAX_VOCAB)
    merges_raw = _list_of(meta, "tokenizer.ggml.merges", str, path, 4 * MAX_VOCAB)
    if not tokens:
        raise LmlabError(f"{path} has no tokenizer.ggml.tokens")
    types = _list_of(meta, "tokenizer.ggml.token_type", int, path, MAX_VOCAB) or [1] * len(tokens)
    if len(types) != len(tokens):
        raise LmlabError(
            f"{path}: tokenizer.ggml.token_type has {len(types):,} entries for "
            f"{len(tokens):,} tokens"
        )
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = []
    for m in merges_raw:
        a, sep, b = m.partition(" ")
        if not sep:
            raise LmlabError(f"{path}: tokenizer merge {m!r} is not two tokens")
        pairs.append((a, b))
    reachable = set(_unicode_to_byte()) | {a + b for a, b in pairs}
    merges = [(a, b) for a, b in pairs if a in reachable and b in reachable]
    try:
        hf = HFTokenizer(
            models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
        )
    except Exception as e:  # the tokenizers library raises plain Exception (a merge of unknowns)
        raise LmlabError(f"{path}: the tokenizer in its metadata is inconsistent: {e}") from None
    hf.pre_tokenizer = PRE_TOKENIZERS[pre]()
    hf.decoder = decoders.ByteLevel()
    special = {i for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED)}
    hf.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special)]
    )

    def ident(key: str) -> int | None:
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise LmlabError(f"{path}: tokenizer.ggml.{key} is {v!r}, not a token id")
        if v is not None and not 0 <= v < len(tokens):  # ignored, as llama.cpp does, but said
            print(
                f"warning: {path}: tokenizer.ggml.{key} is {v:,}, not an id of its "
                f"{len(tokens):,} tokens; ignored",
                file=sys.stderr,
            )
            return None
        return v

    eos = ident("eos_token_id")
    stop = {i for i in (eos, ident("eot_token_id")) if i is not None}
    return GGUFTokenizer(
        hf,
        special,
        eos_id=eos,
        bos_id=ident("bos_token_id"),
        pad_id=ident("padding_token_id"),
        stop_ids=stop,
        chat_template=meta.get("tokenizer.chat_template"),
    )
