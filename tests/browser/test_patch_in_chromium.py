"""The activation-patching page in a real headless Chromium (tests.helpers.browser; skipped,
saying so, when none is installed): it loads with no console error, shows the map of the first
``what`` with the tokens as text, a click on a cell reports that cell's score, layer and token,
and switching the selector shows another map; an encoder-decoder's page (in the same browser)
draws each map with its own layers (2 encoder, 3 decoder), the encoder map over the source
tokens, and a click on a cross-attention head cell reports that head and its score."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmlab.analysis.html_view import write_page
from lmlab.analysis.patching import patch_activations
from lmlab.analysis.patching_report import PatchReport, patch_panel
from lmlab.models import build_model
from tests.helpers import tiny_model_config
from tests.helpers.browser import Browser, browser_test_marks

CHROMIUM, pytestmark = browser_test_marks()
TOKENS = ["满", "<b>", "&amp;", "'", '"', "x"]  # CJK, and text that would be markup in HTML
SOURCE, DECODER = ["满", "<b>", "c", "d"], ["<s>", "x", "y"]


def encoder_decoder_page(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    """An encoder-decoder's page (encoder.resid_pre, cross_heads) and its cross_heads map."""
    torch.manual_seed(0)
    cfg = tiny_model_config(vocab_size=20, kind="encoder_decoder",
                            seq2seq={"n_decoder_layers": 3})  # fmt: skip
    model = build_model(cfg).eval()
    src = torch.randint(3, 20, (1, 4))
    bad = src.clone()
    bad[0, 1] = 3 + (src[0, 1] - 3 + 5) % 17
    dec = torch.randint(3, 20, (1, 3))
    res = patch_activations(model, dec, dec, 3, 4, what=("encoder.resid_pre", "cross_heads"),
                            clean_source=src, corrupted_source=bad)  # fmt: skip
    report = PatchReport(DECODER, DECODER, "t", "v", res, source_tokens=SOURCE,
                         corrupted_source_tokens=["满", "z", "c", "d"])  # fmt: skip
    page = write_page(tmp_path / "s2s.html", "patch", [patch_panel(report)])
    return page, res.scores["cross_heads"]


def test_the_patch_page_shows_a_cell_and_switches_maps(tmp_path: Path):
    torch.manual_seed(0)
    model = build_model(tiny_model_config(vocab_size=20)).eval()
    clean = torch.randint(0, 20, (1, len(TOKENS)))
    corrupted = clean.clone()
    corrupted[0, 1] = (clean[0, 1] + 5) % 20
    res = patch_activations(model, clean, corrupted, 3, 4, what=("resid_pre", "heads"))
    report = PatchReport(TOKENS, TOKENS, "t", "v", res)
    page = write_page(tmp_path / "p.html", "patch", [patch_panel(report)])
    s2s, cross = encoder_decoder_page(tmp_path)
    s = res.scores["resid_pre"]
    step = float(s.max() - s.min()) / 65535  # the page's 16-bit quantisation
    assert CHROMIUM is not None
    with Browser(CHROMIUM) as b:
        b.open(page)
        errors = b.errors + [b.eval("document.getElementById('lmlab-errors').textContent")]
        assert errors == [""]
        assert b.eval("document.getElementById('patch-map').dataset.what") == "resid_pre"
        cols = b.eval("[...document.querySelectorAll('#patch-columns .tok')]"
                      ".map(e => e.firstChild.data)")  # fmt: skip
        assert (
            cols == TOKENS and b.eval("document.querySelectorAll('#patch-columns b').length") == 0
        )
        assert b.eval("document.getElementById('patch-map').width") == len(TOKENS) * 28
        b.click("#patch-map", dx=(1 + 0.5) / len(TOKENS), dy=0.25)  # layer 0, position 1
        info = b.eval("document.getElementById('patch-cell').textContent")
        assert info.startswith("resid_pre, layer 0, position 1 \u201c<b>\u201d: score ")
        got = float(b.eval("document.getElementById('patch-cell').dataset.score"))
        assert got == pytest.approx(float(s[0, 1]), abs=step + 1e-6)
        assert float(s[0, 1]) == 1.0  # the changed token's embedding: fully restored
        b.eval("(() => { const s = document.querySelector('select[name=map]'); s.value = '1';"
               " s.dispatchEvent(new Event('change')); })()")  # fmt: skip
        assert b.eval("document.body.dataset.state") == "map=1&panel=patch"
        assert b.eval("document.getElementById('patch-map').dataset.what") == "heads"
        assert b.eval("document.getElementById('patch-map').width") == 4 * 28  # 4 heads
        heads = b.eval("[...document.querySelectorAll('#patch-columns .tok')]"
                       ".map(e => e.textContent)")  # fmt: skip
        assert heads == ["0", "1", "2", "3"]
        b.click("#patch-map", dx=(2 + 0.5) / 4, dy=0.75)  # layer 1, head 2
        info = b.eval("document.getElementById('patch-cell').textContent")
        assert info.startswith("heads, layer 1, head 2 (all positions): score ")
        h = res.scores["heads"]
        got = float(b.eval("document.getElementById('patch-cell').dataset.score"))
        assert got == pytest.approx(float(h[1, 2]), abs=float(h.max() - h.min()) / 65535 + 1e-6)
        assert (
            b.errors == [] and b.eval("document.getElementById('lmlab-errors').textContent") == ""
        )
        b.open(s2s)
        assert b.errors + [b.eval("document.getElementById('lmlab-errors').textContent")] == [""]
        assert b.eval("document.getElementById('patch-map').dataset.what") == "encoder.resid_pre"
        assert b.eval("document.getElementById('patch-map').height") == 2 * 28  # 2 encoder layers
        cols = b.eval("[...document.querySelectorAll('#patch-columns .tok')]"
                      ".map(e => e.firstChild.data)")  # fmt: skip
        assert cols == SOURCE
        b.eval("(() => { const s = document.querySelector('select[name=map]'); s.value = '1';"
               " s.dispatchEvent(new Event('change')); })()")  # fmt: skip
        assert b.eval("document.getElementById('patch-map').dataset.what") == "cross_heads"
        assert b.eval("document.getElementById('patch-map').height") == 3 * 28  # 3 decoder
        b.click("#patch-map", dx=(2 + 0.5) / 4, dy=(2 + 0.5) / 3)  # layer 2, head 2
        info = b.eval("document.getElementById('patch-cell').textContent")
        assert info.startswith("cross_heads, layer 2, head 2 (all positions): score ")
        got = float(b.eval("document.getElementById('patch-cell').dataset.score"))
        step = float(cross.max() - cross.min()) / 65535
        assert got == pytest.approx(float(cross[2, 2]), abs=step + 1e-6)
        assert b.errors == []
