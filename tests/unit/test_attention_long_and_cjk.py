"""Attention pictures of long inputs and of CJK text: a 200-token map is a bounded figure with
position ticks, a window keeps its positions, and a CJK font installed after matplotlib built its
font cache is found without rebuilding the cache."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from lmlab.analysis import attention_plot
from lmlab.analysis.attention_maps import AttentionMaps, parse_window
from lmlab.analysis.attention_plot import (
    MAX_FIGURE_INCHES,
    font_families,
    plot_heads,
)
from lmlab.errors import LmlabError
from lmlab.nn.masks import causal_mask


def ticks(fig, head: int = 0) -> tuple[list[str], list[str]]:
    ax = next(a for a in fig.axes if a.get_label() == f"head {head}")
    return [t.get_text() for t in ax.get_xticklabels()], [
        t.get_text() for t in ax.get_yticklabels()
    ]


def long_maps(t: int = 200, heads: int = 4) -> AttentionMaps:
    w = torch.softmax(torch.randn(heads, t, t).masked_fill(~causal_mask(t, t), -1e9), -1)
    labels = [f"w{i}" for i in range(t)]
    return AttentionMaps([w], labels, labels, causal_mask(t, t))


def test_a_200_token_map_is_bounded_and_its_ticks_carry_positions():
    """Before: 2 panels x 14 inches = 29 inches (4 panels: 57), a 2,900-pixel PNG with every
    5th label and no position. Now at most 24 inches (2,400 pixels at the 100 dpi save_figure
    uses), ticks "POSITION label" every 5."""
    m = long_maps(heads=2)
    fig = plot_heads(m.weights[0], m.query_labels, m.key_labels, mask=m.mask)
    width, height = fig.get_size_inches()
    assert width <= MAX_FIGURE_INCHES and height <= MAX_FIGURE_INCHES
    xs, ys = ticks(fig)
    assert xs == ys and xs[:3] == ["0 w0", "5 w5", "10 w10"] and len(xs) == 40
    assert fig.get_dpi() == 100 and max(fig.canvas.get_width_height()) <= 2400


def test_short_maps_keep_their_plain_labels_and_size():
    m = long_maps(t=8, heads=2)
    fig = plot_heads(m.weights[0], m.query_labels, m.key_labels, mask=m.mask)
    assert ticks(fig)[0] == m.key_labels
    assert tuple(fig.get_size_inches()) == pytest.approx((2 * 3.0 + 1.0, 3.0 + 0.6))


def test_a_window_keeps_the_token_positions():
    m = long_maps()
    part = m.window(*parse_window("150:160", 200))
    assert part.weights[0].shape == (4, 10, 10) and part.query_labels[0] == "w150"
    assert torch.equal(part.weights[0], m.weights[0][:, 150:160, 150:160])
    assert (part.query_offset, part.key_offset) == (150, 150)
    assert torch.equal(part.mask, causal_mask(200, 200)[150:160, 150:160])
    fig = plot_heads(part.weights[0], part.query_labels, part.key_labels, mask=part.mask,
                     query_offset=150, key_offset=150)  # fmt: skip
    assert ticks(fig)[0] == [f"{i} w{i}" for i in range(150, 160)]
    assert m.window(*parse_window("190:", 200)).query_labels == [f"w{i}" for i in range(190, 200)]


@pytest.mark.parametrize("bad", ["5", "a:b", "10:5", "200:", "-1:4", "1:2:3", "0:201"])
def test_a_bad_window_is_one_error_naming_the_flag(bad: str):
    with pytest.raises(LmlabError, match="--window"):
        parse_window(bad, 200)


def test_a_window_past_the_text_is_refused_not_clipped():
    """``0:201`` on 200 tokens would silently draw 0..199: refused, naming the length; ``0:200``
    (the whole text) and an open end are fine."""
    with pytest.raises(LmlabError, match="ends past the text: it has 200 tokens"):
        parse_window("0:201", 200)
    assert parse_window("0:200", 200) == (0, 200) and parse_window("5:", 200) == (5, None)


def cjk_font_files() -> list[str]:
    if shutil.which("fc-list") is None:
        return []
    out = subprocess.run(["fc-list", ":lang=zh", "file"], capture_output=True, text=True)
    return sorted({line.split(":")[0] for line in out.stdout.splitlines() if line.strip()})


@pytest.mark.skipif(not cjk_font_files(), reason="no CJK font installed (fc-list :lang=zh)")
def test_a_cjk_font_missing_from_matplotlibs_cache_is_found_by_a_rescan(monkeypatch):
    """The font list as matplotlib's cache had it before the font was installed: without the
    rescan the characters are uncovered (code-point labels); with it, the installed font is
    used and labels stay characters."""
    from matplotlib import font_manager

    files = set(cjk_font_files())
    fm = font_manager.fontManager
    monkeypatch.setattr(fm, "ttflist", [e for e in fm.ttflist if e.fname not in files])
    monkeypatch.setattr(attention_plot, "_rescanned", True)  # as if the rescan had run
    _, uncovered = font_families("中文")
    assert uncovered == {"中", "文"}
    monkeypatch.setattr(attention_plot, "_rescanned", False)
    families, uncovered = font_families("中文")
    assert not uncovered and len(families) == 2
    assert any(e.fname in files and e.name == families[1] for e in fm.ttflist)
    labels, _ = attention_plot.printable_labels(["中文", "a"])
    assert labels == ["中文", "a"]
    fm._findfont_cached.cache_clear()  # forget lookups made against the patched list
