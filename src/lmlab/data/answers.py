"""Answer positions of the synthetic corpora, for ``data.loss_on: answers``.

The passkey and recall corpora (:mod:`lmlab.data.passkey`, :mod:`lmlab.data.recall`) are mostly
unpredictable text (random filler, keys and values drawn afresh); only their answer tokens (the
key after the question, the value of a queried key) are predictable, and only by retrieving an
earlier token. Trained on every token, a small model's gradient is mostly noise from the rest
and stays at chance for hundreds of steps; ``data.loss_on: answers`` sets every other target to
-100 (ignored), so the LM loss is the mean cross-entropy over the answer tokens alone (the
"loss on the answer only" of the synthetic retrieval tasks, e.g. Arora et al. 2023, "Zoology").

The masks are per character; a character tokenizer (``data.tokenizer.kind: char``, one token per
character) makes them per token (:func:`token_answers` checks that the two agree).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from lmlab.data import passkey, recall
from lmlab.data.tokenizer import Tokenizer
from lmlab.errors import DataError

LOSS_ON = ("all", "answers")  # data.loss_on
# corpus name -> (text) -> (len(text),) bool, True at answer characters
ANSWER_MASKS: dict[str, Callable[[str], np.ndarray]] = {
    passkey.CORPUS_NAME: passkey.answer_mask,
    recall.CORPUS_NAME: recall.answer_mask,
}


def token_answers(corpus: str, tokenizer: Tokenizer, ids: np.ndarray) -> np.ndarray:
    """(N,) bool over the token stream ``ids`` (N,) of ``corpus`` (a key of
    :data:`ANSWER_MASKS`): True at the answer tokens. Raises DataError when the ids do not map one
    to one onto characters (a tokenizer that is not character-level)."""
    text = tokenizer.decode(np.asarray(ids).tolist())
    if len(text) != len(ids):
        raise DataError(
            f"data.loss_on=answers needs one token per character ({len(ids)} tokens decode to "
            f"{len(text)} characters); use data.tokenizer.kind=char"
        )
    return ANSWER_MASKS[corpus](text)
