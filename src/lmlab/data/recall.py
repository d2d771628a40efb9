"""The multi-query associative-recall corpus (``data.corpus: recall``): dense long-range retrieval.

The passkey corpus (:mod:`lmlab.data.passkey`) holds about one answer per training window, too
sparse a signal for a small model in a few hundred steps. Here every document is a stream of
many key-value facts and queries (multi-query associative recall, Arora et al. 2023, "Zoology";
the retrieval is an induction-head lookup, Olsson et al. 2022)::

    =a7 =m3 ... ?a7 ... ?m3 ...

in slots of :data:`SLOT` = 4 characters (one token per character): a fact ``=kv ``, a query
``?kv `` (its answer ``v`` the value of the same key's fact earlier in the document) or the
filler ``... ``. The key sits just before its value in both, as in the MQAR task of Zoology, so
the lookup is the classic induction pattern (at the queried key, attend to the token after the
key's earlier occurrence and copy it); the first attempt, ``k=v`` / ``k?v`` (the value two
tokens after the key, the answer after a ``?``), stayed at chance after 400 steps.
Keys are lower-case letters, values single digits, drawn afresh per document; each key is
stated once and asked once per document, so a query's answer is predictable only by retrieving
its fact. ``distance`` = index of the answer - index of the fact's value =
``SLOT * gap`` for a query ``gap`` slots after its fact; the answer is predicted from the
key just before it, ``distance - 1`` tokens after the value, so a model whose receptive field
is under ``distance`` tokens (``n_layers * (window - 1) + 1`` for a sliding window) cannot
retrieve it. About one token in nine is an answer (14 per 129-character document).

Gaps of training documents are drawn uniform in [1, :data:`MAX_GAP`] slots (placements that
collide are redrawn; long gaps are rarer than short ones, as fewer free slot pairs fit them).
Everything is deterministic from the seed (``random.Random``). Evaluation prompts
(:func:`recall_sample`) end with the query of one key whose fact lies at an exact distance,
other keys' facts and queries around it as distractors, the queried key nowhere else.
"""

from __future__ import annotations

import random
import string

import numpy as np

from lmlab.data.passkey import PasskeySample
from lmlab.errors import ConfigError

CORPUS_NAME = "recall"
SLOT = 4  # characters per fact, query or filler slot
KEYS = string.ascii_lowercase
FILLER = "... "
ASK = "?"  # opens a query slot
TELL = "="  # opens a fact slot
DOC_SLOTS = 32  # slots per training document (128 characters, then a newline)
MAX_GAP = DOC_SLOTS - 1  # the farthest training query: 124 characters after its fact
MIN_DISTANCE = SLOT  # a query in the slot right after its fact
TRAIN_CHARS = 2_000_000
VAL_CHARS = 100_000
TRAIN_SEED, VAL_SEED = 0, 1
_TRIES = 8  # placement attempts per key


def _place(
    rng: random.Random, slots: list[str | None], keys: list[str], max_gap: int, limit: int
) -> None:
    """Fill free slots (None) of ``slots[:limit]`` with fact/query pairs of ``keys`` (in order,
    each at most once), gaps uniform in [1, max_gap]; a key whose draws collide ``_TRIES`` times
    is dropped. Leftover free slots stay None."""
    for key in keys:
        value = str(rng.randrange(10))
        for _ in range(_TRIES):
            gap = rng.randint(1, max_gap)
            if gap >= limit:
                continue
            f = rng.randrange(limit - gap)
            if slots[f] is None and slots[f + gap] is None:
                slots[f], slots[f + gap] = f"{TELL}{key}{value} ", f"{ASK}{key}{value} "
                break


def recall_document(rng: random.Random, n_slots: int = DOC_SLOTS, max_gap: int = MAX_GAP) -> str:
    """One training document: ``n_slots`` slots of facts, queries and filler, then a newline."""
    slots: list[str | None] = [None] * n_slots
    keys = list(KEYS)
    rng.shuffle(keys)
    _place(rng, slots, keys, max_gap, n_slots)
    return "".join(s or FILLER for s in slots) + "\n"


def recall_text(seed: int, n_chars: int, max_gap: int = MAX_GAP) -> str:
    """Whole documents until at least ``n_chars`` characters."""
    rng = random.Random(seed)
    docs: list[str] = []
    size = 0
    while size < n_chars:
        doc = recall_document(rng, DOC_SLOTS, max_gap)
        docs.append(doc)
        size += len(doc)
    return "".join(docs)


def check_distance(distance: int, length: int) -> None:
    """ConfigError unless ``distance`` is a positive multiple of :data:`SLOT` whose fact fits a
    prompt of ``length`` characters."""
    if distance < MIN_DISTANCE or distance % SLOT:
        raise ConfigError(
            f"a recall distance must be a multiple of {SLOT} characters (one fact or query "
            f"slot) and >= {MIN_DISTANCE}, got {distance}"
        )
    if distance > farthest(length):
        raise ConfigError(
            f"a recall distance of {distance} does not fit a prompt of {length} characters "
            f"(at most {farthest(length)})"
        )


def farthest(length: int) -> int:
    """The largest distance a prompt of ``length`` characters holds."""
    return SLOT * ((length - 2) // SLOT)


def recall_sample(rng: random.Random, length: int, distance: int) -> PasskeySample:
    """A prompt of exactly ``length`` characters ending with the query ``?k`` of one key ``k``,
    whose fact ``=kv`` has its value ``distance`` characters before the answer (at index
    ``length``); the other slots hold facts and queries of the other 25 keys (distractors, drawn
    as in training, gaps up to :data:`MAX_GAP`) and filler. Raises ConfigError for a distance that
    is not a multiple of :data:`SLOT` or does not fit."""
    check_distance(distance, length)
    n_full = (length - 2) // SLOT  # whole slots before the final 2-character query
    pad = (length - 2) % SLOT  # leading filler characters
    keys = list(KEYS)
    rng.shuffle(keys)
    key, value = keys.pop(), str(rng.randrange(10))
    slots: list[str | None] = [None] * n_full
    slots[n_full - distance // SLOT] = f"{TELL}{key}{value} "
    _place(rng, slots, keys, MAX_GAP, n_full)
    prompt = FILLER[-pad:][:pad] + "".join(s or FILLER for s in slots) + ASK + key
    return PasskeySample(prompt, value, distance)


def answer_mask(text: str) -> np.ndarray:
    """(len(text),) bool: True at the answer characters of ``text`` (the value ``v`` of each
    query ``?kv``, two characters after its :data:`ASK`), the targets ``data.loss_on: answers``
    trains on. A query cut off after its key (the text's end) has no answer to mark."""
    mask = np.zeros(len(text), dtype=bool)
    at = np.flatnonzero(np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32) == ord(ASK)) + 2
    mask[at[at < len(text)]] = True
    return mask


def recall_splits() -> dict[str, str]:
    """The ``recall`` corpus: train (:data:`TRAIN_CHARS`, seed 0) and val (:data:`VAL_CHARS`,
    seed 1) splits, generated afresh (about a second)."""
    return {
        "train": recall_text(TRAIN_SEED, TRAIN_CHARS),
        "val": recall_text(VAL_SEED, VAL_CHARS),
    }
