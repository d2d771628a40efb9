"""``lmlab heads``: the table and summary, ``--json`` (exactly a list of per-head records on
stdout, progress on stderr), ``OUT/heads.png``, ``--html`` (refused before any work when the
file exists) and one error line for a bad ``--seq-len``, ``--batch``, ``--seed`` or ``--text``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import lmlab.interop.load as lmlab_load
from tests.helpers import assert_one_error, run_cli

KEYS = {"layer", "head", "previous_token", "induction", "duplicate_token", "sink", "kinds"}


def test_heads_json_is_exactly_a_list_of_per_head_records(tiny_run: Path, capsys):
    code, out, err = run_cli(
        capsys, "heads", tiny_run, "--seq-len", "8", "--batch", "2", "--json", "--no-plot",
        "--device", "cpu",
    )  # fmt: skip
    assert code == 0, err
    records = json.loads(out)  # the whole of stdout
    assert isinstance(records, list) and len(records) == 2 * 4  # TINY: 2 layers x 4 heads
    assert [(r["layer"], r["head"]) for r in records] == [(i, h) for i in (0, 1) for h in range(4)]
    for r in records:
        assert set(r) == KEYS
        assert all(0.0 <= r[k] <= 1.0 for k in KEYS - {"layer", "head", "kinds"})
    assert "loading" in err and "scoring" in err  # progress on stderr


def test_heads_prints_the_table_and_summary_and_draws_the_png_and_page(
    tiny_run: Path, tmp_path: Path, capsys
):
    out_dir, page = tmp_path / "maps", tmp_path / "h.html"
    code, out, err = run_cli(
        capsys, "heads", tiny_run, "--seq-len", "6", "--batch", "1", "--text", "ROMEO: But",
        "--out", out_dir, "--html", page, "--device", "cpu",
    )  # fmt: skip
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["layer", "head", "prev", "induct", "dup", "sink", "t.prev",
                                "t.sink", "kinds"]  # fmt: skip
    assert len([ln for ln in lines if re.match(r"\s+\d+\s+\d+\s+[0-9.]+", ln)]) == 8
    for kind in ("previous-token", "induction", "duplicate-token", "sink"):
        assert any(ln.startswith(f"{kind} heads (>= 0.4): ") for ln in lines), out
    png = out_dir / "heads.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in out and f"wrote {page}" in out
    text = page.read_text(encoding="utf-8")
    blob = json.loads(re.search(r'id="lmlab-data">(.*?)</script>', text, re.S).group(1))
    (panel,) = blob["panels"]
    assert panel["kind"] == "heads" and len(panel["data"]["scores"]["induction"]) == 2


def test_heads_html_that_exists_is_refused_before_the_model_is_loaded(
    tiny_run: Path, tmp_path: Path, capsys, monkeypatch
):
    page = tmp_path / "h.html"
    page.write_text("mine")

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(lmlab_load, "load", no_load)
    code, out, err = run_cli(capsys, "heads", tiny_run, "--html", page, "--no-plot")
    assert_one_error(code, err, "--html", "already exists")
    assert page.read_text() == "mine" and out == ""
    code, _, err = run_cli(capsys, "heads", tiny_run, "--html", tmp_path / "o" / "heads.png",
                           "--out", tmp_path / "o")  # fmt: skip
    assert_one_error(code, err, "--html", "the name of a PNG", "file name of its own")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--seq-len", "0"], "--seq-len must be >= 1"),
        (["--seq-len", "1"], "--seq-len must be >= 2"),
        (["--seq-len", "17"], "more than the model's context of 32"),
        (["--seq-len", "x"], "--seq-len"),
        (["--batch", "0"], "--batch must be >= 1"),
        (["--seed", "-1"], "--seed must be in [0, 2^63)"),
        (["--text", ""], "--text is empty"),
        (["--text", "R"], "--text is 1 tokens"),
        # 1,048,576 x 32 tokens: 4.3e9 scores (4 heads x 32 x 32): refused, nothing drawn
        (["--batch", "1048576", "--seq-len", "16"], "give a smaller --batch or --seq-len"),
    ],
)
def test_a_bad_argument_is_one_error_line(tiny_run: Path, capsys, argv: list[str], needle: str):
    code, out, err = run_cli(capsys, "heads", tiny_run, *argv, "--no-plot", "--device", "cpu")
    assert_one_error(code, err, needle)
    assert out == ""
