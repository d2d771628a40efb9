"""Special and huge files where lmlab expects a file: a FIFO (open would block forever), /dev/zero
(never ends), a symlink loop, a 100 GB sparse file (no disk used; reading it whole would never
finish). Each is refused by type or size with one error line, and no case may hang: every test
runs under a SIGALRM guard, so a regression fails instead of stalling the suite.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from tests.helpers import TINY, assert_one_error, run_cli, within

GUARD_S = 30  # far above what a refusal takes; only a hang reaches it
HUGE = 100 << 30  # bytes: a sparse file of this size uses no disk


@pytest.fixture(autouse=True)
def _no_hang() -> Iterator[None]:
    with within(GUARD_S):  # a hang fails the test instead of stalling the suite
        yield


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _dev_zero(p: Path) -> None:
    p.symlink_to("/dev/zero")


def _loop(p: Path) -> None:
    p.symlink_to(p.name)  # a link to itself: stat gives ELOOP


def _sparse(p: Path) -> None:
    p.write_bytes(b"")
    os.truncate(p, HUGE)


# kind -> (how to make it at a path, what the error line must say)
KINDS: dict[str, tuple[Callable[[Path], None], str]] = {
    "fifo": (_fifo, "FIFO"),
    "dev-zero": (_dev_zero, "character device"),
    "symlink-loop": (_loop, "symlink loop"),
    "sparse-100G": (_sparse, "107,374,182,400 bytes"),
}


def _experiment(tmp: Path, base: object) -> Path:
    path = tmp / "exp.yaml"
    exp = {"name": "special", "base": base, "variants": {"a": {}}, "seeds": [1]}
    path.write_text(yaml.safe_dump({**exp, "budget": {"steps": 2}}))
    return path


def _train(tmp: Path) -> list[object]:
    """``lmlab train`` of the tiny config into a new run folder (then ``--data`` follows)."""
    path = tmp / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return ["train", "--config", path, "--out", tmp / "r"]


# reader -> (file name the special file gets, argv given (tmp folder, that path))
READERS: dict[str, tuple[str, Callable[[Path, Path], list[str]]]] = {
    "config": ("bad.yaml", lambda tmp, p: ["train", "--config", p, "--out", tmp / "r"]),
    "config-inspect": ("bad.yaml", lambda tmp, p: ["inspect", p]),
    "experiment": ("bad.yaml", lambda tmp, p: ["compare", p, "--out", tmp / "o"]),
    "experiment-base": (
        "base.yaml",
        lambda tmp, p: ["compare", _experiment(tmp, p.name), "--out", tmp / "o"],
    ),
    "comparison-record": (
        "o/comparison.json",
        lambda tmp, p: ["compare", _experiment(tmp, TINY), "--out", tmp / "o"],
    ),
    "corpus": (
        "corpus.txt",
        lambda tmp, p: [*_train(tmp), "--data", p],
    ),
    "corpus-folder-split": (
        "corpus/train.txt",
        lambda tmp, p: [*_train(tmp), "--data", p.parent],
    ),
    "pairs": (
        "pairs.tsv",
        lambda tmp, p: [*_train(tmp), "--data", p],
    ),
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("reader", list(READERS))
def test_special_file_is_refused_in_one_line(capsys, tmp_path, reader, kind):
    name, argv = READERS[reader]
    make, needle = KINDS[kind]
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    make(path)
    code, _, err = run_cli(capsys, *argv(tmp_path, path))
    assert_one_error(code, err, needle, path.name)


@pytest.fixture
def run_copy(tiny_run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(tiny_run, copy)
    return copy


@pytest.mark.parametrize("kind", list(KINDS))
def test_special_tokenizer_file_is_refused_in_one_line(capsys, run_copy, kind):
    make, needle = KINDS[kind]
    (run_copy / "tokenizer.json").unlink()
    make(run_copy / "tokenizer.json")
    code, _, err = run_cli(capsys, "generate", run_copy, "--max-new-tokens", "2")
    if (run_copy / "tokenizer.json").is_symlink() and kind == "dev-zero":
        # a link to /dev/zero leads out of the run folder, which is refused before its type
        needle = "leads outside the run folder"
    assert_one_error(code, err, needle, "tokenizer.json")


@pytest.mark.parametrize("kind", list(KINDS))
def test_special_eval_data_file_is_refused_in_one_line(capsys, tiny_run, tmp_path, kind):
    make, needle = KINDS[kind]
    make(tmp_path / "text.txt")
    code, _, err = run_cli(capsys, "eval", tiny_run, "--data", tmp_path / "text.txt")
    assert_one_error(code, err, needle, "text.txt")
