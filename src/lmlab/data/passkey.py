"""The synthetic passkey corpus (``data.corpus: passkey``): long-range retrieval as plain text.

Each training document hides a random ``KEY_LEN``-digit key in filler text and asks for it
``distance`` characters later (character level: one token per character)::

    <filler> the key is 7. <filler> what is the key? 7.\\n

``distance`` = index of the answer's first digit - index of the key's first digit, in characters
(tokens). The answer digit i is predicted from the token just before it, which lies
``distance - 1`` tokens after key digit i, so a model whose receptive field is under ``distance``
tokens (e.g. ``n_layers * (window - 1) + 1`` for a sliding window) cannot retrieve it. The filler
is :data:`FILLER_TEXT` repeated from a random offset. The model trains on this
as ordinary LM text, the loss on every token (filler included; only the digits after the question
are predictable from far back). Training windows are cut at random offsets, so a question whose key
falls before a window's start is unanswerable in that window (noise, more of it at long
distances: about distance / seq_len of the questions).

Distances of training documents are uniform in [:data:`MIN_DISTANCE`, :data:`TRAIN_MAX_DISTANCE`],
or in the range ``data.passkey_min_distance`` .. ``data.passkey_max_distance`` where set (both
splits: the val answer loss measures the task trained on; :func:`check_distance_range`).
Everything is deterministic from the seed (Python's ``random.Random``, whose sequences are stable
across platforms and versions for ``randrange``/``choice`` on integers). Evaluation prompts
(:func:`passkey_sample`) hold exactly one key, at an exact distance from the answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from lmlab.errors import ConfigError

CORPUS_NAME = "passkey"
KEY_LEN = 1  # digits per key (chance level of an exact match: 10**-KEY_LEN)
KEY_PREFIX = "the key is "
KEY_END = ". "
QUESTION = "what is the key? "
MIN_DISTANCE = KEY_LEN + len(KEY_END) + len(QUESTION)  # no filler between key and question: 20
TRAIN_MAX_DISTANCE = 224  # characters; training windows are 256 tokens in the experiment
TRAIN_CHARS = 2_000_000  # characters of the train split (about 14k documents)
VAL_CHARS = 100_000
TRAIN_SEED, VAL_SEED = 0, 1
# The filler repeats one fixed text (as the passkey task of Mohtashami & Jaggi 2023, "Landmark
# Attention", repeats "The grass is green. The sky is blue. ..."), entered at a random offset: a
# model learns it within a few dozen steps, after which the answers carry the loss. It holds no
# digit and none of the words of the key sentence or the question.
FILLER_TEXT = "grass green. sky blue. sun yellow. here we go. over and back again. "


@dataclass(frozen=True)
class PasskeySample:
    """One evaluation prompt: ``prompt`` ends with the question; the model must continue it with
    ``answer`` (``KEY_LEN`` digits), whose first digit would sit at index ``len(prompt)``, which is
    ``distance`` characters after the key's first digit."""

    prompt: str
    answer: str
    distance: int


def filler(rng: random.Random, n: int) -> str:
    """Exactly ``n`` characters of :data:`FILLER_TEXT` repeated, from a random offset, ending in a
    space (n >= 1). ``n == 0`` gives ``""``."""
    if n <= 0:
        return ""
    start = rng.randrange(len(FILLER_TEXT))
    reps = (start + n) // len(FILLER_TEXT) + 1
    return (FILLER_TEXT * reps)[start : start + n - 1] + " "


def _key(rng: random.Random) -> str:
    return "".join(str(rng.randrange(10)) for _ in range(KEY_LEN))


def _check_distance(distance: int) -> None:
    if distance < MIN_DISTANCE:
        raise ConfigError(
            f"a passkey distance must be >= {MIN_DISTANCE} characters (key, '{KEY_END}' and the "
            f"question), got {distance}"
        )


def _body(rng: random.Random, key: str, distance: int) -> str:
    """``the key is K. <gap> what is the key? `` with the answer due ``distance`` after K."""
    gap = filler(rng, distance - MIN_DISTANCE)
    return KEY_PREFIX + key + KEY_END + gap + QUESTION


def passkey_sample(rng: random.Random, length: int, distance: int) -> PasskeySample:
    """A prompt of exactly ``length`` characters: filler, the key sentence, filler, the question;
    the key's first digit at index ``length - distance``. Raises ConfigError when ``distance`` is
    below :data:`MIN_DISTANCE` or the key sentence does not fit (``distance > length -
    len(KEY_PREFIX)``)."""
    _check_distance(distance)
    pre = length - len(KEY_PREFIX) - distance
    if pre < 0:
        raise ConfigError(
            f"a passkey distance of {distance} does not fit a prompt of {length} characters "
            f"(at most {length - len(KEY_PREFIX)})"
        )
    key = _key(rng)
    prompt = filler(rng, pre) + _body(rng, key, distance)
    return PasskeySample(prompt, key, distance)


def passkey_document(rng: random.Random, distance: int, max_prefix: int = 16) -> str:
    """One training document: up to ``max_prefix`` filler characters, the key sentence, filler,
    the question, the answer, ``.`` and a newline."""
    _check_distance(distance)
    key = _key(rng)
    return filler(rng, rng.randrange(max_prefix + 1)) + _body(rng, key, distance) + key + ".\n"


def passkey_text(
    seed: int,
    n_chars: int,
    max_distance: int = TRAIN_MAX_DISTANCE,
    min_distance: int = MIN_DISTANCE,
) -> str:
    """Whole documents, distances uniform in [min_distance, max_distance], until at least
    ``n_chars`` characters."""
    _check_distance(min_distance)
    rng = random.Random(seed)
    docs: list[str] = []
    size = 0
    while size < n_chars:
        doc = passkey_document(rng, rng.randint(min_distance, max_distance))
        docs.append(doc)
        size += len(doc)
    return "".join(docs)


def answer_mask(text: str) -> np.ndarray:
    """(len(text),) bool: True at the answer characters of ``text`` (the ``KEY_LEN`` digits
    after each :data:`QUESTION`), the targets ``data.loss_on: answers`` trains on; digits past
    the text's end are not marked."""
    mask = np.zeros(len(text), dtype=bool)
    start = text.find(QUESTION)
    while start >= 0:
        first = start + len(QUESTION)
        mask[first : first + KEY_LEN] = True
        start = text.find(QUESTION, first)
    return mask


def distance_range(min_distance: int | None, max_distance: int | None) -> tuple[int, int]:
    """(min, max) training distance in characters: ``data.passkey_min_distance`` and
    ``data.passkey_max_distance``, :data:`MIN_DISTANCE` and :data:`TRAIN_MAX_DISTANCE` where
    unset (None)."""
    return (
        MIN_DISTANCE if min_distance is None else min_distance,
        TRAIN_MAX_DISTANCE if max_distance is None else max_distance,
    )


def farthest_key(seq_len: int) -> int:
    """The longest distance (characters) whose whole question fits a ``seq_len``-token window:
    the key sentence, the gap, the question and the answer digits (as an evaluation prompt of
    :func:`passkey_sample` plus its answer)."""
    return seq_len - len(KEY_PREFIX) - KEY_LEN + 1


def check_distance_range(
    min_distance: int | None, max_distance: int | None, corpus: str, seq_len: int
) -> None:
    """Validate ``data.passkey_min_distance`` / ``data.passkey_max_distance`` (ints or None):
    only with ``data.corpus: passkey``; min >= :data:`MIN_DISTANCE`; max >= min; max <=
    :func:`farthest_key` of the training window (``seq_len`` tokens). One ConfigError naming the
    field at fault."""
    if min_distance is None and max_distance is None:
        return
    if corpus != CORPUS_NAME:
        name = "min" if min_distance is not None else "max"
        raise ConfigError(
            f"data.passkey_{name}_distance applies to data.corpus: {CORPUS_NAME} only, got "
            f"data.corpus {corpus!r}"
        )
    lo, hi = distance_range(min_distance, max_distance)
    # an unset bound is named as the default it stands for (the user never wrote that number)
    hi_name = "data.passkey_max_distance" + (
        f" (unset: the default {hi})" if max_distance is None else f" ({hi})"
    )
    lo_name = "data.passkey_min_distance" + (
        f" (unset: the default {lo})" if min_distance is None else f" ({lo})"
    )
    if lo < MIN_DISTANCE:
        raise ConfigError(
            f"data.passkey_min_distance must be >= {MIN_DISTANCE} characters (the key, "
            f"{KEY_END!r} and the question), got {lo}"
        )
    if hi < lo:
        raise ConfigError(f"{hi_name} must be >= {lo_name}")
    if hi > farthest_key(seq_len):
        raise ConfigError(
            f"{hi_name} is past the farthest key a {seq_len}-token training window holds with "
            f"its question and answer ({farthest_key(seq_len)}); set data.passkey_max_distance "
            f"<= {farthest_key(seq_len)}"
        )


def passkey_splits(
    min_distance: int | None = None, max_distance: int | None = None
) -> dict[str, str]:
    """The ``passkey`` corpus: train (:data:`TRAIN_CHARS`, seed 0) and val (:data:`VAL_CHARS`,
    seed 1) splits, distances uniform in :func:`distance_range` (both splits), generated afresh
    (well under a second). Unset (None) bounds give the default corpus bit for bit."""
    lo, hi = distance_range(min_distance, max_distance)
    return {
        "train": passkey_text(TRAIN_SEED, TRAIN_CHARS, hi, lo),
        "val": passkey_text(VAL_SEED, VAL_CHARS, hi, lo),
    }
