"""The HTML page writer without a browser: untrusted token text cannot end the data's <script>
element, packed numbers come back within the stated 16-bit error, and an existing page is never
replaced."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from lmlab.analysis.html_view import (
    MAX_VALUES,
    Panel,
    attention_panel,
    check_html_out,
    pack,
    render_page,
    write_page,
)
from lmlab.errors import LmlabError

HOSTILE = ["</script><script>alert(1)</script>", "<!--", "</SCRIPT >", "&amp;", "\u2028", "中"]


def unpack(p: dict) -> np.ndarray:
    """The page's unpack, in numpy."""
    q = np.frombuffer(base64.b64decode(p["u16"]), dtype="<u2").astype(np.float64)
    return (p["lo"] + (p["hi"] - p["lo"]) / 65535 * q).reshape(p["shape"])


def blob(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="lmlab-data">(.*?)</script>', page, re.S)
    assert m is not None
    return json.loads(m.group(1))


def test_token_text_cannot_end_the_data_script_and_round_trips():
    w = [torch.softmax(torch.randn(2, 6, 6), -1)]
    page = render_page("t </script>", [attention_panel("a", "a", w, HOSTILE, HOSTILE)])
    assert page.lower().count("</script") == 2  # the data element's and the code's own
    data_text = page.split('id="lmlab-data">', 1)[1].split("</script>", 1)[0]
    assert "<" not in data_text and ">" not in data_text and "&" not in data_text
    assert data_text.isascii()
    (panel,) = blob(page)["panels"]
    assert panel["data"]["queries"] == HOSTILE and blob(page)["title"] == "t </script>"
    assert "<title>t &lt;/script&gt;</title>" in page
    assert "innerHTML" not in page and "http" not in page.split("<body>")[1]


@pytest.mark.parametrize("shape", [(3,), (2, 3, 4), (1, 1)])
def test_packed_values_come_back_within_half_a_quantisation_step(shape):
    v = torch.randn(shape, dtype=torch.float64) * 3
    p = pack(v)
    lo, hi = float(v.min()), float(v.max())
    assert p["shape"] == list(shape) and (p["lo"], p["hi"]) == (lo, hi)
    err = np.abs(unpack(p) - v.numpy()).max()
    assert err <= (hi - lo) / 65535 / 2 + 1e-12
    with pytest.raises(ValueError, match="NaN"):
        pack(torch.tensor([0.0, float("nan")]))


def test_a_mask_travels_as_rows_of_zeros_and_ones():
    mask = torch.ones(3, 3, dtype=torch.bool).tril()
    p = attention_panel("a", "a", [torch.eye(3)[None]], list("abc"), list("abc"), mask)
    assert p.data["mask"] == ["100", "110", "111"]
    with pytest.raises(ValueError, match="labels"):
        attention_panel("a", "a", [torch.eye(3)[None]], list("ab"), list("abc"))


def test_panels_need_unique_safe_ids_and_a_renderer():
    a = Panel("a", "a", "attention", {})
    with pytest.raises(ValueError, match="unique"):
        render_page("t", [a, a])
    with pytest.raises(ValueError, match="unique"):
        render_page("t", [Panel("a b", "a", "attention", {})])
    with pytest.raises(ValueError, match="no renderer"):
        render_page("t", [Panel("a", "a", "no_such_kind", {})])


def test_a_page_over_the_size_cap_is_refused_naming_the_options(monkeypatch):
    monkeypatch.setattr("lmlab.analysis.html_view.MAX_VALUES", 10)
    assert MAX_VALUES == 1 << 24
    with pytest.raises(LmlabError, match="--window"):
        render_page("t", [attention_panel("a", "a", [torch.ones(1, 3, 4) / 4], list("abc"),
                                          list("wxyz"))])  # fmt: skip


def test_an_existing_page_is_never_replaced(tmp_path: Path):
    w = [torch.eye(2)[None]]
    panels = [attention_panel("a", "a", w, list("ab"), list("ab"))]
    path = write_page(tmp_path / "sub" / "p.html", "t", panels)
    assert path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    path.write_text("mine")
    with pytest.raises(LmlabError, match="already exists"):
        write_page(path, "t", panels)
    assert path.read_text() == "mine"
    assert sorted(p.name for p in path.parent.iterdir()) == ["p.html"]  # no temporary left
    with pytest.raises(LmlabError, match="is a folder"):
        check_html_out(tmp_path)


def test_check_html_beside_pngs_one_rule_for_every_command(tmp_path):
    """The --html / --out clash check shared by attention, lens, patch and heads: the folder
    itself and a PNG's name are refused (pattern or tuple of names), another name passes."""
    import re

    from lmlab.analysis.html_view import check_html_beside_pngs
    from lmlab.errors import LmlabError

    out = tmp_path / "o"
    pattern = re.compile(r"layer-\d+\.png")
    for html, pngs in (
        (out, pattern),
        (out / "layer-03.png", pattern),
        (out / "a.png", ("a.png",)),
    ):
        with pytest.raises(LmlabError, match="file name of its own") as e:
            check_html_beside_pngs(html, out, pngs, "the PNGs")
        folder = html == out
        assert ("the --out folder" in str(e.value)) == folder
        assert ("the name of a PNG" in str(e.value)) == (not folder)
    check_html_beside_pngs(out / "page.html", out, pattern, "layer-LL.png")
    check_html_beside_pngs(out / "layer-3x.png", out, pattern, "layer-LL.png")  # not a PNG name
    check_html_beside_pngs(tmp_path / "layer-03.png", out, pattern, "layer-LL.png")  # elsewhere
