"""The head-scores page (renderer ``heads``) in a real headless Chromium: it loads with no
console error, the grid shows the given scores, switching the detector changes the grid, and
hovering a cell shows all four of its scores."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lmlab.analysis.head_detectors import DETECTORS, HeadScore
from lmlab.analysis.heads_report import heads_panel
from lmlab.analysis.html_view import write_page
from tests.helpers.browser import NO_CHROMIUM, Browser, find_chromium

CHROMIUM = find_chromium()
if CHROMIUM is None and os.environ.get("LMLAB_REQUIRE_BROWSER"):  # .ci/run: never skip there
    raise RuntimeError(f"LMLAB_REQUIRE_BROWSER is set but there is {NO_CHROMIUM}")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)


def scores() -> list[HeadScore]:
    """3 layers x 2 heads with distinct, recognisable values per detector."""
    out = []
    for li in range(3):
        for h in range(2):
            v = {d: round(0.1 * k + 0.2 * li + 0.05 * h, 4) for k, d in enumerate(DETECTORS)}
            out.append(HeadScore(li, h, **v, kinds=[d for d in DETECTORS if v[d] >= 0.4]))
    return out


def cells(b: Browser) -> list[float]:
    return [float(v) for v in b.eval("[...document.querySelectorAll('#grid td')]"
                                     ".map(e => e.dataset.v)")]  # fmt: skip


def test_the_heads_page_switches_detector_and_shows_a_cells_scores_on_hover(tmp_path: Path):
    s = scores()
    page = write_page(tmp_path / "h.html", "heads", [heads_panel(s)])
    assert CHROMIUM is not None
    with Browser(CHROMIUM) as b:
        b.open(page)
        dom = b.eval("document.getElementById('lmlab-errors').textContent")
        assert b.errors == [] and dom == ""
        assert b.eval("document.body.dataset.ready") == "1"
        assert cells(b) == pytest.approx([x.previous_token for x in s], abs=1e-6)
        before = b.screenshot()
        b.eval("(() => { const e = document.querySelector('select[name=detector]');"
               "e.value = '1'; e.dispatchEvent(new Event('change')); })()")  # fmt: skip
        assert b.eval("document.body.dataset.state") == "detector=1&panel=heads"
        assert cells(b) == pytest.approx([x.induction for x in s], abs=1e-6)
        assert before != b.screenshot()
        copy = tmp_path / "copy.html"  # (the same file with a new hash is no new load)
        copy.write_bytes(page.read_bytes())
        b.open(copy, "detector=3")  # the URL hash selects the sink grid
        assert cells(b) == pytest.approx([x.sink for x in s], abs=1e-6)
        b.eval("document.querySelector('#grid td[data-layer=\"2\"][data-head=\"1\"]')"
               ".dispatchEvent(new MouseEvent('mouseenter'))")  # fmt: skip
        hover = b.eval("document.getElementById('hover').textContent")
        last = s[-1]
        assert hover.startswith("layer 2, head 1: previous_token 0.450, induction 0.550")
        assert f"sink {last.sink:.3f}" in hover and "(previous_token,induction" in hover
        assert b.errors == []
