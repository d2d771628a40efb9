"""Attention heatmaps with matplotlib (Agg backend, no display needed).

Legend: H heads, Tq query tokens (rows), Tk key tokens (columns). One figure per layer, a grid
with one panel per head; token labels on both axes. Labels in scripts the default font lacks
(Chinese, Japanese, Korean ...) are drawn with an installed font that has them, found through
matplotlib's font manager. A font installed after matplotlib built its font cache (``apt
install fonts-noto-cjk`` on a machine that has drawn before) is found too: when no listed font
has a character, the system's font folders are scanned once per process and the new files added
(:func:`rescan_fonts`), no cache rebuild needed. When no installed font has it, one warning is
printed and the missing characters are written as their code points (U+4E2D) instead of empty
boxes.

Long inputs stay readable: past LONG_INPUT tokens the tick labels carry their positions
(``40 tok``) at a round stride, and a figure is at most MAX_FIGURE_INCHES wide and high (panels
shrink to fit); ``lmlab attention --window START:END`` draws a slice of the map.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from matplotlib.figure import Figure

BASE_FONT = "DejaVu Sans"  # matplotlib's bundled default
# Fonts known to cover CJK, tried first; then every installed font is checked.
CJK_FONTS = (
    "Noto Sans CJK SC",
    "Noto Sans CJK JP",
    "Noto Sans SC",
    "Source Han Sans SC",
    "Source Han Sans",
    "WenQuanYi Zen Hei",
    "WenQuanYi Micro Hei",
    "Droid Sans Fallback",
    "AR PL UMing CN",
    "SimHei",
    "Microsoft YaHei",
    "PingFang SC",
    "Hiragino Sans GB",
    "Arial Unicode MS",
)
# Fonts whose glyphs are placeholders (one box per Unicode block), not characters.
PLACEHOLDER_FONTS = ("Last Resort",)
_warned: set[str] = set()
_rescanned = False  # rescan_fonts ran in this process
LONG_INPUT = 32  # tokens: longer axes get position numbers in their tick labels
MAX_FIGURE_INCHES = 24.0  # width and height cap of one figure (2,400 pixels at 100 dpi)


@cache
def _charmap(path: str) -> frozenset[int]:
    from matplotlib.ft2font import FT2Font

    try:
        return frozenset(FT2Font(path).get_charmap())
    except (OSError, RuntimeError, ValueError):
        return frozenset()


def _font_path(family: str) -> str | None:
    from matplotlib import font_manager

    for entry in font_manager.fontManager.ttflist:
        if entry.name == family:
            return str(entry.fname)
    return None


def rescan_fonts() -> int:
    """Add the installed font files matplotlib's font list lacks (installed after its cache was
    built) to ``matplotlib.font_manager.fontManager``, once per process (later calls return 0
    at once). Returns how many files were added. Unreadable files are passed over."""
    global _rescanned
    if _rescanned:
        return 0
    _rescanned = True
    from matplotlib import font_manager

    fm = font_manager.fontManager
    known = {os.path.realpath(e.fname) for e in fm.ttflist}
    added = 0
    for path in sorted(font_manager.findSystemFonts(fontext="ttf")):
        if os.path.realpath(path) in known:
            continue
        try:
            fm.addfont(path)
        except (OSError, RuntimeError, ValueError):
            continue
        added += 1
    return added


def font_families(chars: Iterable[str], base: str = BASE_FONT) -> tuple[list[str], set[str]]:
    """(font family list for matplotlib's per-glyph fallback, characters no font covers).

    ``base`` first; if it lacks some of ``chars``, the first installed font (CJK_FONTS first,
    then every font matplotlib knows) that covers them all is added after it. When none covers
    them all, the system's fonts are rescanned once (:func:`rescan_fonts`) and the search
    repeated.
    """
    base_path = _font_path(base)
    have = _charmap(base_path) if base_path else frozenset()
    missing = {c for c in set(chars) if not c.isspace() and ord(c) not in have}
    if not missing:
        return [base], set()
    families, uncovered = _fallback(base, missing)
    if uncovered and rescan_fonts():
        families, uncovered = _fallback(base, missing)
    return families, uncovered


def _fallback(base: str, missing: set[str]) -> tuple[list[str], set[str]]:
    """The best font matplotlib knows for the ``missing`` characters (see font_families)."""
    from matplotlib import font_manager

    entries = font_manager.fontManager.ttflist
    ranked = [e for name in CJK_FONTS for e in entries if e.name == name]
    ranked += [e for e in entries if e.name not in CJK_FONTS and e.name != base]
    ranked = [e for e in ranked if not str(e.name).startswith(PLACEHOLDER_FONTS)]
    codes = {ord(c) for c in missing}
    for entry in ranked:
        if codes <= _charmap(str(entry.fname)):
            return [base, str(entry.name)], set()
    best = max(ranked, key=lambda e: len(codes & _charmap(str(e.fname))), default=None)
    if best is not None and codes & _charmap(str(best.fname)):
        uncovered = {c for c in missing if ord(c) not in _charmap(str(best.fname))}
        return [base, str(best.name)], uncovered
    return [base], missing


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        print(f"warning: {message}", file=sys.stderr)


def printable_labels(labels: list[str], base: str = BASE_FONT) -> tuple[list[str], list[str]]:
    """(labels to draw, font families): characters no installed font covers become 'U+XXXX',
    with one warning per process naming what to install."""
    families, uncovered = font_families("".join(labels), base)
    if not uncovered:
        return labels, families
    _warn_once(
        "font",
        f"no installed font has {''.join(sorted(uncovered)[:8])!r} (e.g. CJK): those characters "
        "are labelled by code point; install a CJK font (e.g. fonts-noto-cjk or fonts-wqy-zenhei) "
        "for real glyphs",
    )
    out = ["".join(f"U+{ord(c):04X}" if c in uncovered else c for c in s) for s in labels]
    return out, families


def plot_heads(
    weights: torch.Tensor,
    query_labels: list[str],
    key_labels: list[str],
    heads: list[int] | None = None,
    mask: torch.Tensor | None = None,
    title: str = "",
    max_cols: int = 4,
    query_offset: int = 0,
    key_offset: int = 0,
) -> Figure:
    """One figure, one heatmap panel per head: weights (H, Tq, Tk) float in [0, 1], rows =
    queries (``query_labels``, Tq), columns = keys (``key_labels``, Tk). ``mask`` (Tq, Tk) bool,
    True = may attend: forbidden cells are drawn grey. ``heads`` names the panels (default
    0 .. H-1). Panel axes are labelled ``head N`` (``fig.axes`` also holds the colour bar).
    ``query_offset``, ``key_offset``: the token positions of the first row and column (a
    window of a longer map). An axis longer than LONG_INPUT tokens gets ``POSITION label``
    ticks at a round stride; the figure is at most MAX_FIGURE_INCHES in each direction.
    Raises ValueError when the label counts do not match the weights."""
    import matplotlib

    matplotlib.use("Agg")
    import numpy as np
    from matplotlib.figure import Figure

    h, tq, tk = weights.shape
    if len(query_labels) != tq or len(key_labels) != tk:
        raise ValueError(
            f"{len(query_labels)} query and {len(key_labels)} key labels for weights "
            f"{tuple(weights.shape)}"
        )
    heads = list(range(h)) if heads is None else heads
    qlab, families = printable_labels(query_labels)
    klab, families2 = printable_labels(key_labels)
    families = list(dict.fromkeys(families + families2))
    ncols = min(h, max_cols)
    nrows = math.ceil(h / ncols)
    side = min(max(3.0, 0.22 * max(tq, tk) + 1.0), 14.0)  # inches per panel
    side = min(side, (MAX_FIGURE_INCHES - 1.0) / ncols, (MAX_FIGURE_INCHES - 0.6) / nrows)
    fig = Figure(figsize=(side * ncols + 1.0, side * nrows + 0.6), layout="constrained")
    w = weights.detach().float().cpu().numpy()
    m = None if mask is None else ~mask.cpu().numpy()
    vmax = float(w.max()) if w.size else 1.0
    fontsize = 8 if max(tq, tk) <= LONG_INPUT else 6
    room = max(8, int(side * 72 / (1.6 * fontsize)))  # tick labels that fit along a panel side
    xt, xl = _ticks(klab, key_offset, room)
    yt, yl = _ticks(qlab, query_offset, room)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#d0d0d0")  # grey: masked
    image = None
    for i in range(h):
        ax = fig.add_subplot(nrows, ncols, i + 1, label=f"head {heads[i]}")
        data = w[i] if m is None else np.ma.masked_array(w[i], mask=m)
        image = ax.imshow(data, cmap=cmap, vmin=0.0, vmax=vmax, interpolation="nearest")
        ax.set_title(f"head {heads[i]}", fontsize=10)
        ax.set_xticks(xt)
        ax.set_xticklabels(xl, rotation=90, fontsize=fontsize, family=families)
        ax.set_yticks(yt)
        ax.set_yticklabels(yl, fontsize=fontsize, family=families)
        ax.set_xlabel("key", fontsize=8)
        ax.set_ylabel("query", fontsize=8)
    if image is not None:
        fig.colorbar(image, ax=fig.axes, shrink=0.6, label="attention weight")
    if title:
        fig.suptitle(title)
    return fig


def _ticks(labels: list[str], offset: int, room: int) -> tuple[list[int], list[str]]:
    """(tick indices, tick labels) of one axis: every label up to LONG_INPUT tokens from position
    0; beyond, or in a window (``offset`` > 0: positions count from it), ``POSITION label`` at
    the positions divisible by the smallest 1-2-5 stride that leaves at most ``room`` ticks."""
    n = len(labels)
    if n <= LONG_INPUT and offset == 0:
        return list(range(n)), labels
    step = next(
        s for e in range(12) for s in (10**e, 2 * 10**e, 5 * 10**e) if math.ceil(n / s) <= room
    )
    idx = [i for i in range(n) if (i + offset) % step == 0]
    return idx, [f"{i + offset} {labels[i]}" for i in idx]


def panel_count(fig: Figure) -> int:
    """Heatmap panels in a figure from :func:`plot_heads` (the colour bar is not one)."""
    return sum(1 for ax in fig.axes if str(ax.get_label()).startswith("head "))


def save_figure(fig: Figure, path: str | Path, dpi: int = 100) -> Path:
    """Write ``fig`` as a PNG at ``path`` (parent folders created); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=dpi)
    return p
