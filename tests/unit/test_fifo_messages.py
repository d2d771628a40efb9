"""A FIFO where lmlab expects a model folder's config, or a folder for --out, is named as what it
is (never "a file", never the generic "neither a run folder nor ..."), and never opened."""

from __future__ import annotations

import os

import pytest

from lmlab.errors import LmlabError
from lmlab.fsutil import check_out_path
from lmlab.interop.load import load

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")


@pytest.mark.parametrize("name", ["config.json", "config.yaml"])
def test_a_fifo_config_is_named_not_opened(tmp_path, name):
    (tmp_path / "model.safetensors").write_bytes(b"")
    os.mkfifo(tmp_path / name)  # opening it for reading would block forever
    with pytest.raises(LmlabError, match=f"{name} is not a regular file"):
        load(tmp_path, "cpu")


def test_a_fifo_out_is_not_called_a_file(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(LmlabError, match="is not a folder \\(a FIFO"):
        check_out_path(tmp_path / "pipe", "--out", folder=True, what="the export")
    (tmp_path / "plain").write_text("x")
    with pytest.raises(LmlabError, match="is a file; give a folder"):
        check_out_path(tmp_path / "plain", "--out", folder=True, what="the export")
