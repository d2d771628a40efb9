"""The attention page in a real headless Chromium (Debian's ``chromium``, driven over the
DevTools pipe by tests.helpers.browser; skipped, saying so, when none is installed): it loads
with no console error, renders a decoder's, an encoder's and an encoder-decoder's maps from tiny
random models, shows the weights it was given, honours the URL hash, and a real mouse click
changes what is shown (the DOM and the screenshot)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmlab.analysis import html_view
from lmlab.analysis.attention_maps import self_attention_maps, seq2seq_attention_maps
from lmlab.analysis.html_view import Panel, attention_panel, write_page
from lmlab.data.tokenizer import CharTokenizer
from lmlab.models import build_model
from tests.helpers import encoder_config, tiny_model_config
from tests.helpers.browser import Browser, browser_test_marks

CHROMIUM, pytestmark = browser_test_marks()
TEXT = "满纸荒唐言 <b>&'\""  # CJK, and characters that would be markup if pasted as HTML
STEP = 1 / 65535  # the page's 16-bit quantisation of weights in [0, 1] (lo 0, hi <= 1)


def browser() -> Browser:
    assert CHROMIUM is not None
    return Browser(CHROMIUM)


def page_errors(b: Browser) -> list[str]:
    """What the protocol saw plus what the page's own collector wrote into the DOM."""
    dom = b.eval("document.getElementById('lmlab-errors').textContent")
    return b.errors + ([dom] if dom else [])


def texts(b: Browser, selector: str) -> list[str]:
    """Each matching token's own text (its first text node: the position <sub> left out)."""
    return b.eval(f"[...document.querySelectorAll({selector!r})].map(e => e.firstChild.data)")


def key_weights(b: Browser) -> list[float]:
    return [float(w) for w in b.eval("[...document.querySelectorAll('#keys .tok')]"
                                     ".map(e => e.dataset.w)")]  # fmt: skip


def test_a_decoder_page_shows_the_given_rows_and_a_click_changes_them(tmp_path: Path):
    tok = CharTokenizer(sorted(set(TEXT)))
    model = build_model(tiny_model_config(vocab_size=tok.vocab_size)).eval()
    maps = self_attention_maps(model, tok, TEXT)
    page = write_page(
        tmp_path / "p.html", "decoder", [attention_panel("self", "self", maps.weights,
                                                         maps.query_labels, maps.key_labels,
                                                         maps.mask)],
    )  # fmt: skip
    t = len(maps.query_labels)
    with browser() as b:
        b.open(page)
        assert page_errors(b) == []
        assert b.eval("document.body.dataset.ready") == "1"
        assert texts(b, "#queries .tok") == maps.query_labels  # CJK and '<b>&' as text
        assert b.eval("document.querySelectorAll('#queries b').length") == 0  # no markup made
        assert b.eval("document.body.dataset.state") == "panel=self"  # default: the last token
        want = maps.weights[0][0, t - 1].tolist()
        assert key_weights(b) == pytest.approx(want, abs=STEP)
        before = b.screenshot()
        b.click("#queries .tok[data-q='2']")
        assert b.eval("document.body.dataset.state") == "panel=self&token=2"
        got = key_weights(b)
        assert got == pytest.approx(maps.weights[0][0, 2].tolist(), abs=STEP)
        assert all(w == 0 for w in got[3:])  # causal: token 2 sees keys 0..2 only
        assert b.eval("document.querySelectorAll('#keys .masked').length") == t - 3
        b.click("#heads", dy=3.5 / 4)  # the heads overview: the 4th row is head 3
        assert b.eval("document.body.dataset.state") == "head=3&panel=self&token=2"
        assert key_weights(b) == pytest.approx(maps.weights[0][3, 2].tolist(), abs=STEP)
        after = b.screenshot()
        assert before[:8] == after[:8] == b"\x89PNG\r\n\x1a\n" and before != after
        assert page_errors(b) == []


def test_an_encoder_page_honours_the_url_hash(tmp_path: Path):
    tok = CharTokenizer(sorted(set(TEXT)))
    model = build_model(encoder_config(vocab_size=tok.vocab_size)).eval()
    maps = self_attention_maps(model, tok, TEXT)
    assert len(maps.weights) >= 2 and maps.weights[0].shape[0] >= 3
    page = write_page(
        tmp_path / "p.html", "encoder", [attention_panel("self", "self", maps.weights,
                                                         maps.query_labels, maps.key_labels,
                                                         maps.mask)],
    )  # fmt: skip
    with browser() as b:
        b.open(page, "layer=1&head=2&token=3")
        assert page_errors(b) == []
        assert b.eval("[...document.querySelectorAll('select')].map(s => s.value)") == ["1", "2"]
        got = key_weights(b)
        assert got == pytest.approx(maps.weights[1][2, 3].tolist(), abs=STEP)
        assert all(w > 0 for w in got)  # bidirectional: every key is seen
        assert b.eval("document.querySelectorAll('#keys .masked').length") == 0


def test_an_encoder_decoder_page_switches_between_cross_and_self_attention(tmp_path: Path):
    tok = CharTokenizer(sorted(set("abcdef中文")))
    cfg = tiny_model_config(vocab_size=tok.vocab_size, kind="encoder_decoder")
    cfg.seq2seq.pad_token_id, cfg.seq2seq.decoder_start_token_id, cfg.seq2seq.eos_token_id = 0, 1, 2
    maps = seq2seq_attention_maps(build_model(cfg).eval(), tok, "abc中文", "fed")
    names = {"cross": "cross-attention", "encoder": "encoder self", "decoder": "decoder self"}
    panels = [
        attention_panel(k, names[k], m.weights, m.query_labels, m.key_labels, m.mask)
        for k, m in maps.items()
    ]
    page = write_page(tmp_path / "p.html", "seq2seq", panels)
    cross, enc = maps["cross"], maps["encoder"]
    with browser() as b:
        b.open(page)
        assert page_errors(b) == []
        assert texts(b, "#lmlab-tabs button") == list(names.values())
        assert texts(b, "#queries .tok") == cross.query_labels  # target tokens, then </s>
        assert texts(b, "#keys .tok") == list("abc中文")  # source tokens
        t = len(cross.query_labels)
        assert key_weights(b) == pytest.approx(cross.weights[0][0, t - 1].tolist(), abs=STEP)
        before = b.screenshot()
        b.click("#lmlab-tabs button[data-panel='encoder']")
        assert b.eval("document.body.dataset.state") == "panel=encoder"
        assert texts(b, "#queries .tok") == enc.query_labels
        assert key_weights(b) == pytest.approx(enc.weights[0][0, 4].tolist(), abs=STEP)
        assert before != b.screenshot()
        assert page_errors(b) == []


def test_a_script_error_on_the_page_is_reported(tmp_path: Path, monkeypatch):
    """The no-error checks above can fail: a renderer that throws is seen both by the page's
    collector (in the DOM) and over the protocol (console.error)."""
    monkeypatch.setitem(
        html_view.RENDERERS, "boom", "LM.render.boom = () => { console.error('bad'); null.x; };"
    )
    page = write_page(tmp_path / "p.html", "boom", [Panel("b", "b", "boom", {})])
    with browser() as b:
        b.open(page)
        dom = b.eval("document.getElementById('lmlab-errors').textContent")
        assert "TypeError" in dom
        assert any("bad" in e for e in b.errors)


def test_a_200_token_page_loads_and_a_click_on_its_map_picks_that_row(tmp_path: Path):
    t, h = 200, 4
    w = torch.softmax(torch.randn(h, t, t), -1)
    labels = [f"w{i}" for i in range(t)]
    page = write_page(tmp_path / "p.html", "long", [attention_panel("a", "a", [w, w], labels,
                                                                    labels)])  # fmt: skip
    with browser() as b:
        b.open(page)
        assert page_errors(b) == []
        assert b.eval("document.getElementById('map').height") == t * 4  # 4-pixel rows
        b.click("#map", dy=(150 + 0.5) / t)
        assert b.eval("document.body.dataset.state") == "panel=a&token=150"
        assert key_weights(b) == pytest.approx(w[0, 150].tolist(), abs=STEP)
        sub = b.eval("document.querySelector('#queries .tok[data-q=\"150\"] sub').textContent")
        assert sub == "150"  # every 10th token carries its position
