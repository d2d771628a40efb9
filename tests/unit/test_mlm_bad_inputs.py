"""Bad inputs to the masked-LM objective: one clear DataError, never a numpy traceback."""

from __future__ import annotations

import numpy as np
import pytest

from lmlab.data.dataset import batch_rng
from lmlab.errors import DataError
from tests.unit.test_objectives import _mlm


def test_a_window_of_only_whitespace_and_specials_has_nothing_to_mask():
    obj = _mlm()
    tok = obj.tokenizer
    newline = tok.encode("\n")[0]
    row = np.array([[tok.cls_id, newline, newline, tok.sep_id]], dtype=np.int64)
    with pytest.raises(DataError, match="only special and whitespace tokens: nothing to mask"):
        obj.mask(row, batch_rng(0, 0, 0))
