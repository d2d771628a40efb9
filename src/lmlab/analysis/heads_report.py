"""``lmlab heads``: load a model, score its heads (:mod:`lmlab.analysis.head_detectors`), and
draw the scores: ``OUT/heads.png`` (one layer x head heatmap per detector, values written in
the cells) and an interactive page (renderer ``heads``: a layer x head grid, a detector
selector, hovering a cell shows its four scores).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmlab.analysis.head_detectors import DETECTORS, THRESHOLDS, HeadScore, detect_heads
from lmlab.errors import LmlabError

PNG = "heads.png"
TITLES = {
    "previous_token": "previous token (i -> i-1)",
    "induction": "induction (L+j -> j+1)",
    "duplicate_token": "duplicate token (L+j -> j)",
    "sink": "sink (i -> 0)",
}


def score_grid(scores: list[HeadScore], detector: str) -> torch.Tensor:
    """(layers, heads) float64 of one detector's scores (layer-major HeadScores, as
    :func:`detect_heads` returns them)."""
    n_layers = max(s.layer for s in scores) + 1
    n_heads = max(s.head for s in scores) + 1
    grid = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    for s in scores:
        grid[s.layer, s.head] = getattr(s, detector)
    return grid


def plot_scores(scores: list[HeadScore], title: str = "") -> Any:
    """A matplotlib Figure: four heatmaps (rows = layers, columns = heads, colour 0 .. 1), each
    cell annotated with its score (two decimals), one per detector."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    n_layers = max(s.layer for s in scores) + 1
    n_heads = max(s.head for s in scores) + 1
    w = min(2.0 + 0.45 * n_heads, 9.0)
    h = min(1.2 + 0.28 * n_layers, 14.0)
    fig = Figure(figsize=(2 * w, 2 * h), layout="constrained")
    small = 7 if n_heads <= 12 and n_layers <= 32 else 5
    image = None
    for i, det in enumerate(DETECTORS):
        ax = fig.add_subplot(2, 2, i + 1, label=det)
        grid = score_grid(scores, det).numpy()
        image = ax.imshow(grid, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto",
                          interpolation="nearest")  # fmt: skip
        for li in range(n_layers):
            for hi in range(n_heads):
                v = grid[li, hi]
                ax.text(hi, li, f"{v:.2f}", ha="center", va="center", fontsize=small,
                        color="black" if v > 0.6 else "white")  # fmt: skip
        ax.set_title(TITLES[det], fontsize=10)
        ax.set_xlabel("head", fontsize=8)
        ax.set_ylabel("layer", fontsize=8)
        ax.set_xticks(range(n_heads))
        ax.set_yticks(range(n_layers))
        ax.tick_params(labelsize=7)
    if image is not None:
        fig.colorbar(image, ax=fig.axes, shrink=0.6, label="mean attention on the key")
    if title:
        fig.suptitle(title)
    return fig


def heads_panel(scores: list[HeadScore], thresholds: dict[str, float] | None = None) -> Any:
    """The page panel (kind ``heads``): per detector a (layers x heads) list of lists of
    scores, the thresholds, and each head's kinds."""
    from lmlab.analysis.html_view import Panel

    grids = {d: score_grid(scores, d).tolist() for d in DETECTORS}
    n_layers, n_heads = len(grids[DETECTORS[0]]), len(grids[DETECTORS[0]][0])
    kinds = [["" for _ in range(n_heads)] for _ in range(n_layers)]
    for s in scores:
        kinds[s.layer][s.head] = ",".join(s.kinds)
    data = {
        "detectors": list(DETECTORS),
        "titles": [TITLES[d] for d in DETECTORS],
        "layers": list(range(n_layers)),
        "heads": list(range(n_heads)),
        "scores": grids,
        "kinds": kinds,
        "thresholds": dict(thresholds or THRESHOLDS),
    }
    return Panel("heads", "head scores", "heads", data)


@dataclass
class HeadsReport:
    """What ``lmlab heads`` found: per-head scores, the thresholds and the files written."""

    scores: list[HeadScore]
    thresholds: dict[str, float]
    files: list[Path]


def special_ids(tokenizer: Any) -> set[int]:
    """Every special id of ``tokenizer``: its roles (bos, eos, pad ...) and, for one backed by
    a Hugging Face ``tokenizers`` file, each added token marked special (SmolLM2's
    ``<|im_start|>``, ``<repo_name>`` ...)."""
    ids = set(tokenizer.special_ids())
    ids |= {i for i in (tokenizer.bos_id, tokenizer.eos_id) if isinstance(i, int)}
    hf = getattr(tokenizer, "hf", None)
    if hf is not None and hasattr(hf, "get_added_tokens_decoder"):
        ids |= {int(i) for i, t in hf.get_added_tokens_decoder().items() if t.special}
    return ids


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def heads_report(
    path: str | Path,
    seq_len: int | None = None,
    batch: int = 4,
    seed: int = 0,
    text: str | None = None,
    out: str | Path | None = "heads",
    html: str | Path | None = None,
    device: str = "auto",
) -> HeadsReport:
    """Load the model at ``path`` (anything lmlab.interop.load.load accepts), score every head
    (:func:`detect_heads`; special token ids of its tokenizer are never drawn), and write
    ``out/heads.png`` unless ``out`` is None and the page ``html`` if given. ``text``: also
    score previous-token and sink on it (an encoder's framed as in training, [CLS] ... [SEP]).
    An existing ``html`` is refused before the model is
    loaded. Progress goes to stderr. Raises LmlabError for bad arguments (see detect_heads)."""
    from lmlab.analysis.html_view import (
        check_html_beside_pngs,
        check_html_out,
        check_png_folder,
        write_page,
    )
    from lmlab.interop.load import load
    from lmlab.training.hardware import resolve_device

    if out is not None:
        check_png_folder(out)
    if html is not None:
        check_html_out(html)
        if out is not None:
            check_html_beside_pngs(html, out, (PNG,), PNG)
    if text is not None and not text:
        raise LmlabError("--text is empty: give the text to score, or leave --text out")
    if seq_len is not None and seq_len < 2:
        raise LmlabError(f"--seq-len must be >= 2 (tokens per repeated block), got {seq_len}")
    _progress(f"loading {path}")
    model, tokenizer = load(path, str(resolve_device(device)))
    avoid: set[int] = set()
    text_ids = None
    if tokenizer is not None:
        avoid = special_ids(tokenizer)
    if text is not None:
        if tokenizer is None:
            raise LmlabError("this model has no tokenizer (no tokenizer.json), so --text "
                             "cannot be encoded")  # fmt: skip
        encoder = getattr(getattr(model, "cfg", None), "kind", None) == "encoder"
        text_ids = tokenizer.encode_for_model(text) if encoder else tokenizer.encode(text)
    _progress("scoring heads on repeated random tokens")
    scores = detect_heads(model, seq_len, batch, seed, avoid=avoid, text_ids=text_ids)
    files: list[Path] = []
    name = Path(path).name
    if out is not None:
        from lmlab.analysis.attention_plot import save_figure

        folder = Path(out)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise LmlabError(f"cannot create the output folder {folder}: {e.strerror}") from None
        files.append(save_figure(plot_scores(scores, f"{name}: head scores"), folder / PNG))
    if html is not None:
        files.append(write_page(html, f"{name}: head scores", [heads_panel(scores)]))
    return HeadsReport(scores, dict(THRESHOLDS), files)
