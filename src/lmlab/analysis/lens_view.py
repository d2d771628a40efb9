"""Pictures of the logit lens and of direct logit attribution: PNG heatmaps (matplotlib, Agg)
and the panels of the self-contained HTML page (:mod:`lmlab.analysis.html_view`, renderers
``html_assets/lens.js`` and ``dla.js``).

Legend: R rows = L + 1 layer boundaries (embed, layer 0 .. L-1), T positions, k top tokens,
L layers, H heads. Labels go through :func:`lmlab.analysis.attention_plot.printable_labels`
(a CJK font when one is installed, code points otherwise); long inputs get position ticks at a
round stride and a figure at most MAX_FIGURE_INCHES wide, as the attention maps do.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lmlab.analysis.attention_plot import MAX_FIGURE_INCHES, _ticks, printable_labels
from lmlab.analysis.html_view import Panel, pack

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from lmlab.analysis.lens_attribution import LogitAttribution

CELL_TEXT_MAX = 48  # positions (and rows) up to which every cell is labelled with its token


def plot_lens(
    top1_probs: torch.Tensor,
    top1_labels: list[list[str]],
    tokens: list[str],
    rows: list[str],
    title: str = "",
    xlabel: str = "input token (the column predicts the token after it)",
) -> Figure:
    """Heatmap (R, T) of the top-1 probability per layer boundary and position (colour, 0..1)
    with the top-1 token written in each cell (up to CELL_TEXT_MAX positions and rows).
    ``top1_labels`` R lists of T labels; ``tokens`` the T input labels (x axis, the position a
    column predicts the next token of); ``rows`` the R row names (y axis, embed at the bottom).
    Raises ValueError when the shapes and labels disagree."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    r, t = top1_probs.shape
    if len(tokens) != t or len(rows) != r or any(len(row) != t for row in top1_labels):
        raise ValueError(f"labels do not match the (rows, positions) = {(r, t)} probabilities")
    flat = [s for row in top1_labels for s in row]
    drawn, families = printable_labels(tokens + flat)
    xlab, cells = drawn[:t], drawn[t:]
    width = min(max(4.0, 0.55 * t + 2.0), MAX_FIGURE_INCHES)
    height = min(max(2.5, 0.32 * r + 1.8), MAX_FIGURE_INCHES)
    fig = Figure(figsize=(width, height), layout="constrained")
    ax = fig.add_subplot(1, 1, 1, label="lens")
    p = top1_probs.detach().float().cpu().numpy()
    image = ax.imshow(p, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", origin="lower",
                      interpolation="nearest")  # fmt: skip
    if t <= CELL_TEXT_MAX and r <= CELL_TEXT_MAX:
        size = 8 if t <= 24 else 6
        for i in range(r):
            for j in range(t):
                ax.text(j, i, cells[i * t + j][:6], ha="center", va="center", fontsize=size,
                        color="black" if p[i, j] > 0.6 else "white", family=families)  # fmt: skip
    room = max(8, int(width * 72 / 10))
    xt, xl = _ticks(xlab, 0, room)
    ax.set_xticks(xt)
    ax.set_xticklabels(xl, rotation=90, fontsize=8 if t <= 32 else 6, family=families)
    yt, yl = _ticks(rows, 0, max(8, int(height * 72 / 10)))
    ax.set_yticks(yt)
    ax.set_yticklabels(yl if r <= 32 else [rows[i] for i in yt], fontsize=8)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel("residual stream after", fontsize=8)
    fig.colorbar(image, ax=ax, shrink=0.8, label="top-1 probability")
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def plot_dla(dla: LogitAttribution, what: str, title: str = "") -> Figure:
    """Heatmap (L, H + 1 [+ 1]) of the attribution: one column per head, then the FFN (and the
    o_proj bias when the model has one), red positive / blue negative, symmetric around 0,
    values written in the cells when there are few; the embedding, positions and constant terms
    and the sum against the actual logit in the caption. ``what``: the logit named in words.
    An encoder-decoder's grid has the self-attention heads, then the cross-attention heads,
    the FFN, then the self and cross o_proj biases (when present), each column named."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    columns, names = dla_columns(dla)
    grid = columns.float().numpy()  # (L, columns)
    n_layers, n_cols = grid.shape
    width = min(max(4.0, 0.6 * n_cols + 2.5), MAX_FIGURE_INCHES)
    height = min(max(2.5, 0.4 * n_layers + 2.0), MAX_FIGURE_INCHES)
    fig = Figure(figsize=(width, height), layout="constrained")
    ax = fig.add_subplot(1, 1, 1, label="dla")
    m = float(abs(grid).max()) or 1.0
    image = ax.imshow(grid, cmap="RdBu_r", vmin=-m, vmax=m, aspect="auto", origin="lower",
                      interpolation="nearest")  # fmt: skip
    if n_cols * n_layers <= 400:
        for i in range(n_layers):
            for j in range(n_cols):
                white = abs(grid[i, j]) > 0.6 * m
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=6,
                        color="white" if white else "black")  # fmt: skip
    ax.set_xticks(range(n_cols))
    ax.set_xticklabels(names, fontsize=7, rotation=90 if n_cols > 16 or len(names[0]) > 3 else 0)
    yt, _ = _ticks([str(i) for i in range(n_layers)], 0, max(8, int(height * 72 / 10)))
    ax.set_yticks(yt)
    ax.set_yticklabels([f"layer {i}" for i in yt], fontsize=8)
    others = [(n, v) for n, v in zip(dla.names, dla.values.tolist(), strict=True)
              if not n.startswith("L")]  # fmt: skip
    parts = ", ".join(f"{n} {v:+.3f}" for n, v in others)
    ax.set_xlabel(f"{parts}; sum {dla.total:.4f} vs actual {dla.actual:.4f}", fontsize=8)
    fig.colorbar(image, ax=ax, shrink=0.8, label=f"contribution to {what} (logits)")
    fig.suptitle(title or f"direct logit attribution: {what}", fontsize=10)
    return fig


def dla_columns(dla: LogitAttribution) -> tuple[torch.Tensor, list[str]]:
    """The attribution as a layers x columns grid (L, C) float64 and the C column names: heads
    ``H{h}``, ``FFN``, ``bias`` (when o_proj has one); an encoder-decoder's ``self H{h}``,
    ``cross H{h}``, ``FFN``, ``self bias``, ``cross bias``."""
    n_h = dla.heads.shape[1]
    if dla.cross_heads is None or dla.cross_bias is None:
        cols, names = [dla.heads, dla.ffn.unsqueeze(1)], [f"H{h}" for h in range(n_h)] + ["FFN"]
        if any(n.endswith(".attn_bias") for n in dla.names):
            cols.append(dla.attn_bias.unsqueeze(1))
            names.append("bias")
        return torch.cat(cols, dim=1), names
    cols = [dla.heads, dla.cross_heads, dla.ffn.unsqueeze(1)]
    names = [f"self H{h}" for h in range(n_h)]
    names += [f"cross H{h}" for h in range(dla.cross_heads.shape[1])] + ["FFN"]
    for what, values in (("self", dla.attn_bias), ("cross", dla.cross_bias)):
        if any(n.endswith(f".{what}.bias") for n in dla.names):
            cols.append(values.unsqueeze(1))
            names.append(f"{what} bias")
    return torch.cat(cols, dim=1), names


def save(fig: Figure, path: Path) -> Path:
    """Write ``fig`` as a PNG (100 dpi); returns the path."""
    from lmlab.analysis.attention_plot import save_figure

    return save_figure(fig, path)


# ----------------------------------------------------------------------------- HTML panels


def lens_panel(
    tokens: list[str],
    rows: list[str],
    top_labels: list[list[list[str]]],
    top_probs: torch.Tensor,
    target: tuple[str, torch.Tensor, torch.Tensor] | None = None,
    panel_id: str = "lens",
    source: list[str] | None = None,
) -> Panel:
    """The lens grid: ``tokens`` T input labels, ``rows`` R row names, ``top_labels`` (R, T, k)
    nested lists of token labels with ``top_probs`` (R, T, k) float, most likely first.
    ``target``: (its label, probabilities (R, T), ranks (R, T) int, 1 = top). The page colours
    each cell by its top-1 probability; hovering or clicking a cell lists its top k. Token text
    is sent as JSON strings and drawn with textContent. ``source``: an encoder-decoder's encoder
    input labels (the page lists them above the grid). Raises ValueError for mismatched
    shapes."""
    r, t, k = top_probs.shape
    if len(rows) != r or len(tokens) != t or len(top_labels) != r:
        raise ValueError(f"lens_panel: labels do not match the probabilities {(r, t, k)}")
    vocab: dict[str, int] = {}
    idx = [[[vocab.setdefault(s, len(vocab)) for s in cell] for cell in row] for row in top_labels]
    if any(len(row) != t or any(len(c) != k for c in row) for row in idx):
        raise ValueError(f"lens_panel: top_labels must be (R, T, k) = {(r, t, k)}")
    data: dict[str, Any] = {
        "tokens": list(tokens),
        "rows": list(rows),
        "vocab": list(vocab),
        "top": idx,
        "probs": pack(top_probs.float()),
        "target": None,
        "source": None if source is None else list(source),
    }
    if target is not None:
        label, probs, ranks = target
        data["target"] = {"label": label, "probs": pack(probs.float()), "ranks": ranks.tolist()}
    return Panel(panel_id, "logit lens", "lens", data)


def dla_panel(dla: LogitAttribution, what: str, token: str, panel_id: str = "dla") -> Panel:
    """The attribution panel: a layers x (heads, FFN, bias) table coloured by sign and size,
    the top components by |contribution|, and the sum against the actual logit. ``what`` names
    the logit, ``token`` the input token at the attributed position. An encoder-decoder's
    ``heads`` rows hold its self heads, cross heads and biases, named by ``head_labels``."""
    head_labels = None
    heads, attn_bias = dla.heads, None
    if any(n.endswith(".attn_bias") for n in dla.names):
        attn_bias = dla.attn_bias.tolist()
    if dla.cross_heads is not None:
        grid, names = dla_columns(dla)
        keep = [j for j, n in enumerate(names) if n != "FFN"]  # the page adds the FFN column
        heads, head_labels = grid[:, keep], [names[j] for j in keep]
    data = {
        "what": what,
        "token": token,
        "position": dla.position,
        "heads": heads.tolist(),
        "head_labels": head_labels,
        "ffn": dla.ffn.tolist(),
        "attn_bias": attn_bias,
        "top": [[n, v] for n, v in dla.top(10)],
        "others": [
            [n, v]
            for n, v in zip(dla.names, dla.values.tolist(), strict=True)
            if not n.startswith("L")
        ],  # fmt: skip
        "total": dla.total,
        "actual": dla.actual,
    }
    return Panel(panel_id, "direct logit attribution", "dla", data)
