"""A weight-only quantized model is never written as a run folder or checkpoint: lmlab saves
float weights only (a reload of integer codes as float parameters would fail or, worse, load
something else), so saving one is refused with one clear error and nothing is written."""

from __future__ import annotations

import pytest

from lmlab.errors import LmlabError
from lmlab.interop.importer import write_run
from lmlab.models.build import build_model
from lmlab.nn.quant import quantize_model
from lmlab.training.checkpoint import save_checkpoint
from tests.helpers import tiny_model_config


def test_saving_a_quantized_model_is_refused_and_writes_nothing(tmp_path):
    model = quantize_model(build_model(tiny_model_config(vocab_size=64)).eval(), bits=8)
    with pytest.raises(LmlabError, match="weight-only quantized layers .*quantize when loading"):
        save_checkpoint(tmp_path / "run", 0, model, None, {"step": 0})
    assert not (tmp_path / "run").exists()
    with pytest.raises(LmlabError, match="weight-only quantized"):
        write_run(model, None, tmp_path / "imported")  # type: ignore[arg-type]
    assert not (tmp_path / "imported").exists()
    float_model = build_model(tiny_model_config(vocab_size=64))
    assert save_checkpoint(tmp_path / "run", 0, float_model, None, {"step": 0}).is_dir()
