"""(source, target) pairs for sequence-to-sequence training: a TSV or JSONL file, or a bundled
synthetic task.

- ``*.tsv``: one pair per line, ``source<TAB>target`` (exactly one tab; blank lines skipped).
- ``*.jsonl``: one object per line, ``{"source": "...", "target": "..."}`` (both strings).
- ``synthetic:reverse``: random strings of 4..16 symbols from ``abcdefgh``, target = the string
  reversed (only attention to the right source position can solve it). 20,000 training pairs
  and 500 held-out validation pairs, disjoint from them, drawn from a fixed seed: the same pairs
  on every machine.

A file is split deterministically: its last ``val_fraction`` of pairs (at least one) is the
validation split. :func:`pairs_corpus` gives the same pairs as text splits (one ``source<TAB>
target`` line each) so the tokenizer is fitted on exactly what the objective reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from lmlab.errors import DataError
from lmlab.safeio import parse_json

Pair = tuple[str, str]

REVERSE_ALPHABET = "abcdefgh"
REVERSE_LENGTHS = (4, 16)  # inclusive
REVERSE_SIZES = {"train": 20_000, "val": 500}
REVERSE_SEED = 20201231


def reverse_pairs(
    n_train: int = REVERSE_SIZES["train"],
    n_val: int = REVERSE_SIZES["val"],
    seed: int = REVERSE_SEED,
    alphabet: str = REVERSE_ALPHABET,
    lengths: tuple[int, int] = REVERSE_LENGTHS,
) -> dict[str, list[Pair]]:
    """The reverse task: ``n_train`` + ``n_val`` distinct random strings (lengths uniform in
    ``lengths``, inclusive) with their reversals; no validation source occurs in training."""
    rng = np.random.default_rng(seed)
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < n_train + n_val:
        n = int(rng.integers(lengths[0], lengths[1] + 1))
        s = "".join(alphabet[i] for i in rng.integers(0, len(alphabet), size=n))
        if s not in seen:
            seen.add(s)
            out.append(s)
    pairs = [(s, s[::-1]) for s in out]
    return {"val": pairs[:n_val], "train": pairs[n_val:]}


# synthetic:<name> -> a function giving its splits
SYNTHETIC: dict[str, Callable[[], dict[str, list[Pair]]]] = {"reverse": reverse_pairs}


def _synthetic(source: str) -> dict[str, list[Pair]]:
    name = source.split(":", 1)[1]
    if name not in SYNTHETIC:
        raise DataError(
            f"unknown synthetic task {source!r}; available: "
            + ", ".join(f"synthetic:{n}" for n in SYNTHETIC)
        )
    return SYNTHETIC[name]()


def read_pairs(path: str | Path) -> list[Pair]:
    """The pairs of a ``.tsv`` or ``.jsonl`` file, in file order. Raises DataError for a missing
    or non-UTF-8 file, another extension, no pairs, or a bad line (naming ``file:line``)."""
    from lmlab.data.corpus import read_text

    p = Path(path)
    ext = p.suffix.lower()
    if ext not in (".tsv", ".jsonl"):
        raise DataError(
            f"seq2seq data {p} must be a .tsv (source<TAB>target) or .jsonl "
            '({"source": ..., "target": ...}) file'
        )
    pairs: list[Pair] = []
    for n, line in enumerate(read_text(p).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        if ext == ".tsv":
            fields = line.split("\t")
            if len(fields) != 2:
                raise DataError(
                    f"{where}: expected source<TAB>target (one tab), found {len(fields) - 1} tabs"
                )
            src, tgt = fields
        else:
            try:  # strict: NaN and duplicate keys ({"source": .., "source": ..}) refused
                obj = parse_json(line, where, DataError)
            except DataError as e:
                problem = str(e).removeprefix(f"{where} is not valid JSON: ")
                raise DataError(f"{where}: not valid JSON ({problem})") from None
            if not isinstance(obj, dict):
                raise DataError(f'{where}: expected an object {{"source": ..., "target": ...}}')
            missing = [k for k in ("source", "target") if not isinstance(obj.get(k), str)]
            if missing:
                raise DataError(f"{where}: {' and '.join(missing)} missing or not a string")
            src, tgt = obj["source"], obj["target"]
        if not src or not tgt:
            raise DataError(f"{where}: empty {'source' if not src else 'target'}")
        pairs.append((src, tgt))
    if not pairs:
        raise DataError(f"seq2seq data {p} holds no pairs")
    return pairs


def load_pairs(source: str | Path, val_fraction: float = 0.1) -> dict[str, list[Pair]]:
    """``train`` and ``val`` pairs of ``data.corpus``: a synthetic task or a TSV/JSONL file (its
    last ``val_fraction`` of pairs, at least one, is ``val``). Raises DataError as
    :func:`read_pairs`, or when a file has too few pairs to split."""
    src = str(source)
    if src.startswith("synthetic:"):
        return _synthetic(src)
    pairs = read_pairs(Path(src).expanduser())
    n_val = max(1, math.ceil(len(pairs) * val_fraction))
    if n_val >= len(pairs):
        raise DataError(
            f"{src} has {len(pairs)} pair(s): too few to split into train and val "
            f"(val_fraction={val_fraction})"
        )
    return {"train": pairs[:-n_val], "val": pairs[-n_val:]}


def pairs_text(pairs: list[Pair]) -> str:
    """One ``source<TAB>target`` line per pair."""
    return "".join(f"{s}\t{t}\n" for s, t in pairs)


def is_pairs_source(source: str | Path) -> bool:
    """Whether ``data.corpus`` names pairs (a synthetic task, a .tsv or .jsonl file)."""
    s = str(source)
    return s.startswith("synthetic:") or Path(s).suffix.lower() in (".tsv", ".jsonl")
