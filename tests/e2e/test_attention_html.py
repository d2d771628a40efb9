"""``lmlab attention --html``: one page next to (or instead of) the PNGs, with a tab per map of
an encoder-decoder; an existing file is refused before the model runs and left as it was."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.helpers import assert_one_error, run_cli


def blob(path: Path) -> dict:
    page = path.read_text(encoding="utf-8")
    m = re.search(r'id="lmlab-data">(.*?)</script>', page, re.S)
    assert m is not None
    return json.loads(m.group(1))


def test_attention_html_writes_one_page_and_refuses_an_existing_one(
    tiny_run: Path, tmp_path: Path, capsys
):
    page = tmp_path / "a.html"
    code, out, _ = run_cli(
        capsys, "attention", str(tiny_run), "--text", "ROMEO:", "--layer", "1", "--no-plot",
        "--html", str(page), "--json", "--device", "cpu",
    )  # fmt: skip
    assert code == 0 and json.loads(out)["files"] == [str(page)]
    (panel,) = blob(page)["panels"]
    assert panel["data"]["queries"] == list("ROMEO:") and panel["data"]["layers"] == [1]
    assert panel["data"]["weights"]["shape"] == [1, 4, 6, 6]
    page.write_text("mine")
    code, _, err = run_cli(
        capsys, "attention", str(tiny_run), "--text", "ROMEO:", "--no-plot", "--html", str(page)
    )
    assert_one_error(code, err, "--html", "already exists")
    assert page.read_text() == "mine"


def test_attention_source_html_has_cross_encoder_and_decoder_tabs(
    seq2seq_run: Path, tmp_path: Path, capsys
):
    page = tmp_path / "s.html"
    code, _, _ = run_cli(
        capsys, "attention", str(seq2seq_run), "--source", "abc", "--target", "cba", "--no-plot",
        "--html", str(page), "--device", "cpu",
    )  # fmt: skip
    assert code == 0
    panels = {p["id"]: p["data"] for p in blob(page)["panels"]}
    assert list(panels) == ["cross", "encoder", "decoder"]
    assert panels["cross"]["queries"] == [*"cba", "</s>"] and panels["cross"]["keys"] == list("abc")
    assert panels["decoder"]["mask"][0] == "1000" and panels["encoder"]["mask"] is None


def test_attention_window_draws_a_slice_with_its_positions(tiny_run: Path, tmp_path: Path, capsys):
    page, maps = tmp_path / "w.html", tmp_path / "maps"
    code, out, _ = run_cli(
        capsys, "attention", str(tiny_run), "--text", "ROMEO: But soft", "--layer", "0",
        "--window", "2:6", "--out", str(maps), "--html", str(page), "--json", "--device", "cpu",
    )  # fmt: skip
    assert code == 0 and len(json.loads(out)["tokens"]) == 15  # the numbers cover every token
    (panel,) = blob(page)["panels"]
    assert panel["data"]["queries"] == list("MEO:") and panel["data"]["offsets"] == [2, 2]
    assert panel["data"]["mask"][0] == "1000"  # position 2 sees positions 0..2; 2 is shown
    assert sorted(p.name for p in maps.iterdir()) == ["layer-00.png"]
    code, _, err = run_cli(
        capsys, "attention", str(tiny_run), "--text", "ROMEO:", "--window", "9:12", "--no-plot"
    )
    assert_one_error(code, err, "--window", "6 tokens")


def test_an_html_path_the_pngs_would_take_is_refused_before_anything_is_written(
    tiny_run: Path, tmp_path: Path, capsys
):
    for html, out in (
        (tmp_path / "maps" / "layer-00.png", tmp_path / "maps"),  # a PNG's own name
        (tmp_path / "same", tmp_path / "same"),  # the PNG folder itself
    ):
        code, _, err = run_cli(
            capsys, "attention", str(tiny_run), "--text", "ROMEO:", "--out", str(out),
            "--html", str(html), "--device", "cpu",
        )  # fmt: skip
        what = "the name of a PNG" if html != out else "the --out folder"
        assert_one_error(code, err, "--html", what, "file name of its own")
        assert not out.exists()  # nothing written, not even the folder
    code, _, err = run_cli(
        capsys, "attention", str(tiny_run), "--text", "ROMEO:", "--no-plot", "--html", ""
    )
    assert_one_error(code, err, "--html needs a file name")
    page = tmp_path / "maps2" / "maps.html"  # a page of its own inside --out is fine
    code, _, _ = run_cli(
        capsys, "attention", str(tiny_run), "--text", "ROMEO:", "--out", str(page.parent),
        "--html", str(page), "--device", "cpu",
    )  # fmt: skip
    assert code == 0 and page.is_file() and (page.parent / "layer-00.png").is_file()
