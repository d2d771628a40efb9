"""Shared fixtures: tiny trained runs reused by the end-to-end tests (helpers: tests/helpers/)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
# one per process (each xdist worker its own), removed when the process ends
os.environ["LMLAB_CACHE_DIR"] = _CACHE = tempfile.mkdtemp(prefix="lmlab-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

from tests.helpers import (  # noqa: E402
    encoder_run_config,
    seq2seq_run_config,
    tiny_config,
    write_reverse_tsv,
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``-n N --dist loadscope`` (``make unit``): whole modules to one worker (their module and
    session fixtures are built once per worker), except tests/contract, whose ~2,000 generated
    cases share no fixture and go out one by one; otherwise one worker would run them all while
    the other idles."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith("tests/contract/"):
                return nodeid
            return nodeid.split("::", 1)[0]

    return ModuleScopes(config, log)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Run the test on one torch thread (float sums in a fixed order), then restore the count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run trained for 30 steps on tinyshakespeare (shared; do not modify it)."""
    from lmlab.training.trainer import train

    out = tmp_path_factory.mktemp("runs") / "tiny"
    train(tiny_config(train={"max_steps": 30}), out=out, progress=False)
    return out


@pytest.fixture(scope="session")
def seq2seq_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny encoder-decoder trained for 40 seq2seq steps on a small reverse-task TSV
    (tests.helpers.configs; shared, do not modify it)."""
    from lmlab.training.trainer import train

    folder = tmp_path_factory.mktemp("runs")
    cfg = seq2seq_run_config(write_reverse_tsv(folder), max_steps=40, eval_every=20)
    train(cfg, out=folder / "s2s", progress=False)
    return folder / "s2s"


@pytest.fixture(scope="session")
def encoder_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT trained for 20 mlm steps on tinyshakespeare (shared; do not modify it)."""
    from lmlab.training.trainer import train

    out = tmp_path_factory.mktemp("runs") / "bert"
    train(encoder_run_config(max_steps=20), out=out, progress=False)
    return out
