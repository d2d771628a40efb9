"""What the encoder-decoder maps (T5, BART) share: key renaming by pattern tables, both ways.

A table lists (Hugging Face key, lmlab key) pairs whose ``{i}`` stands for a layer index; a key
matching neither side of any pair raises LmlabError naming it.
"""

from __future__ import annotations

import re

import torch

from lmlab.errors import LmlabError

KeyTable = list[tuple[str, str]]


def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


def rename(
    sd: dict[str, torch.Tensor], table: KeyTable, reverse: bool, family: str
) -> dict[str, torch.Tensor]:
    """Rename every key of ``sd`` through ``table`` (HF -> lmlab, or lmlab -> HF when
    ``reverse``). Raises LmlabError for a key no pattern matches."""
    pairs = [(b, a) for a, b in table] if reverse else table
    compiled = [(_compile(src), dst) for src, dst in pairs]
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        for pattern, dst in compiled:
            m = pattern.match(key)
            if m:
                out[dst.replace("{i}", m.group("i")) if "{i}" in dst else dst] = value
                break
        else:
            side = "lmlab" if reverse else family
            raise LmlabError(
                f"{side} weight {key!r} has no place in an lmlab model (no {family} counterpart)"
            )
    return out


def single_id(value: object, name: str) -> int | None:
    """A config's special-token id: None, an int, or a one-element list (HF allows lists)."""
    if isinstance(value, list):
        if len(value) != 1:
            raise LmlabError(f"{name} lists {len(value)} ids; lmlab supports one")
        value = value[0]
    return None if value is None else int(value)  # type: ignore[call-overload]
