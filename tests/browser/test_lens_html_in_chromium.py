"""The logit-lens page in a real headless Chromium (tests.helpers.browser; skipped, saying so,
when none is installed): it loads with no console error, shows token text as text (CJK and
would-be markup), a click on a grid cell shows that cell's top-k tokens and probabilities, and
the attribution tab lists the components and their sum."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lmlab.analysis.attention_maps import token_label
from lmlab.analysis.html_view import write_page
from lmlab.analysis.lens import direct_logit_attribution, logit_lens
from lmlab.analysis.lens_view import dla_panel, lens_panel
from lmlab.data.tokenizer import CharTokenizer
from lmlab.models import build_model
from tests.helpers import tiny_model_config
from tests.helpers.browser import NO_CHROMIUM, Browser, find_chromium

CHROMIUM = find_chromium()
if CHROMIUM is None and os.environ.get("LMLAB_REQUIRE_BROWSER"):  # .ci/run: never skip there
    raise RuntimeError(f"LMLAB_REQUIRE_BROWSER is set but there is {NO_CHROMIUM}")
pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM),
    pytest.mark.usefixtures("one_thread"),
]
TEXT = "满纸荒唐言 <b>&'\""


@pytest.fixture(scope="module")
def browser():
    """One Chromium for the module's pages (a start costs seconds); errors reset per test."""
    assert CHROMIUM is not None
    with Browser(CHROMIUM) as b:
        yield b


@pytest.fixture
def b(browser: Browser) -> Browser:
    browser.errors = []
    return browser


def page_errors(b: Browser) -> list[str]:
    """What the protocol saw plus what the page's own collector wrote into the DOM."""
    dom = b.eval("document.getElementById('lmlab-errors').textContent")
    return b.errors + ([dom] if dom else [])


def test_a_click_on_a_lens_cell_shows_its_top_tokens(b: Browser, tmp_path: Path):
    tok = CharTokenizer(sorted(set(TEXT)))
    model = build_model(tiny_model_config(vocab_size=tok.vocab_size)).eval()
    ids = torch.tensor([tok.encode(TEXT)])
    lens = logit_lens(model, ids, top_k=4, targets=3, keep_log_probs=False)
    label = [token_label(tok.token_bytes(i)) for i in range(tok.vocab_size)]
    tokens = [label[i] for i in ids[0].tolist()]
    tops = [[[label[i] for i in cell] for cell in row] for row in lens.top_ids[0].tolist()]
    assert lens.target_probs is not None and lens.target_ranks is not None
    target = (label[3], lens.target_probs[0], lens.target_ranks[0])
    dla = direct_logit_attribution(model, ids, 3)
    panels = [lens_panel(tokens, lens.row_labels, tops, lens.top_probs[0], target),
              dla_panel(dla, "logit('x')", tokens[-1])]  # fmt: skip
    page = write_page(tmp_path / "lens.html", "lens", panels)
    probs = lens.top_probs[0]  # (R, T, k)
    step = float(probs.max() - probs.min()) / 65535 + 1e-7  # the page's 16-bit quantisation

    def shown() -> tuple[list[str], list[float]]:
        rows = "[...document.querySelectorAll('#topk tr')]"
        names = b.eval(f"{rows}.map(r => r.firstChild.textContent)")
        return names, [float(p) for p in b.eval(f"{rows}.map(r => r.dataset.p)")]

    b.open(page)
    assert page_errors(b) == []
    assert b.eval("[...document.querySelectorAll('#grid td.tok')].map(e => e.firstChild.data)"
                  ) == tokens  # fmt: skip
    assert b.eval("document.querySelectorAll('#grid b').length") == 0  # no markup made
    r, t = 2, len(tokens) - 1  # the default: the output row, the last token
    names, ps = shown()
    assert names == tops[r][t] and ps == pytest.approx(probs[r, t].tolist(), abs=step)
    b.click("#grid td.cell[data-r='0'][data-t='2']")
    assert b.eval("document.body.dataset.state") == "panel=lens&row=0&token=2"
    names, ps = shown()
    assert names == tops[0][2] and ps == pytest.approx(probs[0, 2].tolist(), abs=step)
    assert (names, ps) != (tops[r][t], probs[r, t].tolist())  # the click changed it
    want = f"probability {float(lens.target_probs[0, 0, 2]):.4f}, rank "
    assert want in b.eval("document.getElementById('target').textContent")
    b.click("#lmlab-tabs button[data-panel='dla']")
    assert b.eval("document.querySelectorAll('#dla-grid tr').length") == 3  # header + 2
    assert f"{dla.total:.4f}" in b.eval("document.getElementById('dla-sum').textContent")
    assert page_errors(b) == []


def test_a_long_grid_keeps_its_scroll_so_a_click_far_right_picks_that_cell(b: Browser, tmp_path):
    """120 positions overflow the 1000-pixel window: the click scrolls the grid, and the redraw
    on hover must keep that scroll, or the press would land on another cell."""
    t, k = 120, 2
    probs = torch.softmax(torch.randn(3, t, 8), -1).topk(k, -1).values
    labels = [[[f"r{r}t{j}k{i}" for i in range(k)] for j in range(t)] for r in range(3)]
    panel = lens_panel([f"w{j}" for j in range(t)], ["embed", "layer 0", "layer 1"], labels,
                       probs)  # fmt: skip
    page = write_page(tmp_path / "long.html", "long", [panel])
    b.open(page)
    b.click("#grid td.cell[data-r='1'][data-t='110']")
    assert b.eval("document.body.dataset.state") == "panel=lens&row=1&token=110"
    assert b.eval("document.querySelector('#topk td').textContent") == "r1t110k0"
    assert page_errors(b) == []


def test_an_encoder_decoders_page_lists_its_source_and_names_self_and_cross_heads(
    b: Browser, tmp_path: Path
):
    tok = CharTokenizer(sorted(set(TEXT)))
    model = build_model(tiny_model_config(vocab_size=tok.vocab_size, kind="encoder_decoder"))
    src, ids = torch.tensor([tok.encode(TEXT)]), torch.tensor([tok.encode(TEXT[:4])])
    lens = logit_lens(model.eval(), ids, top_k=2, source_ids=src, keep_log_probs=False)
    label = [token_label(tok.token_bytes(i)) for i in range(tok.vocab_size)]
    tokens = [label[i] for i in ids[0].tolist()]
    tops = [[[label[i] for i in cell] for cell in row] for row in lens.top_ids[0].tolist()]
    source = [label[i] for i in src[0].tolist()]
    dla = direct_logit_attribution(model, ids, 3, source_ids=src)
    panels = [lens_panel(tokens, lens.row_labels, tops, lens.top_probs[0], source=source),
              dla_panel(dla, "logit('x')", tokens[-1])]  # fmt: skip
    b.open(write_page(tmp_path / "s2s.html", "lens", panels))
    assert " ".join(source) in b.eval("document.body.textContent")  # as text, not markup
    assert b.eval("document.querySelectorAll('#grid b').length") == 0
    b.click("#lmlab-tabs button[data-panel='dla']")
    heads = b.eval("[...document.querySelectorAll('#dla-grid tr:first-child th')]"
                   ".map(e => e.textContent)")  # fmt: skip
    assert heads == ["", *[f"self H{h}" for h in range(4)], *[f"cross H{h}" for h in range(4)],
                     "FFN"]  # fmt: skip
    assert f"{dla.total:.4f}" in b.eval("document.getElementById('dla-sum').textContent")
    assert page_errors(b) == []
