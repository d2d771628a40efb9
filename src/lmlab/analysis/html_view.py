"""Self-contained HTML pages for lmlab's pictures: one file, no network, no server.

A page is a list of :class:`Panel` (tabs when there are several). Each panel names a ``kind``,
the JavaScript renderer in :data:`RENDERERS` that draws its ``data`` (any JSON value); the page
embeds the data as one JSON blob, the CSS and only the renderers its panels use. A new picture
(logit-lens grid, patching map, head scores) is one more renderer plus a function that builds
its Panel; the page shell (tabs, state in the URL hash, error collector) is shared.

Safety: token text is untrusted. The JSON is embedded in a ``<script type="application/json">``
with ``<``, ``>`` and ``&`` written as ``\\u003c`` ... (no ``</script>`` can end it early), read
with ``JSON.parse``, and the renderers put text into the page only through ``textContent``
(never ``innerHTML``). A Content-Security-Policy forbids every network load.

State: ``#panel=ID&layer=L&head=H&token=T`` in the URL selects what is shown (a link reproduces
a view); the page writes its current state to ``document.body.dataset.state`` and any script
error to ``<pre id="lmlab-errors">`` (empty when none), which the browser tests read.

Numbers travel packed (:func:`pack`): an array quantised to 16 bits between its minimum and
maximum, little-endian, base64 (2.7 bytes a value; error <= (max - min) / 131070).
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from lmlab.errors import LmlabError
from lmlab.fsutil import check_out_path, writing

MAX_VALUES = 1 << 24  # packed numbers in one page (about 45 MB of HTML); more is refused


@dataclass
class Panel:
    """One view of a page: ``id`` (letters, digits, ``-`` and ``_``; unique in the page, used
    in the URL hash), the tab ``title``, the renderer ``kind`` (a key of :data:`RENDERERS`) and
    its JSON-able ``data``."""

    id: str
    title: str
    kind: str
    data: dict[str, Any]


def pack(values: torch.Tensor) -> dict[str, Any]:
    """A float tensor of any shape as ``{"shape", "lo", "hi", "u16"}``: values quantised to
    round((v - lo) / (hi - lo) * 65535), little-endian uint16, base64. The page's ``unpack``
    returns a flat Float32Array in row-major order. Raises ValueError for NaN or inf."""
    import numpy as np

    v = values.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(v).all()):
        raise ValueError("pack: the values contain NaN or inf")
    lo = float(v.min()) if v.numel() else 0.0
    hi = float(v.max()) if v.numel() else 0.0
    span = hi - lo if hi > lo else 1.0
    q = ((v - lo) / span * 65535).round().numpy().astype("<u2")
    return {
        "shape": list(v.shape),
        "lo": lo,
        "hi": hi,
        "u16": base64.b64encode(np.ascontiguousarray(q).tobytes()).decode("ascii"),
    }


def attention_panel(
    panel_id: str,
    title: str,
    weights: list[torch.Tensor],
    query_labels: list[str],
    key_labels: list[str],
    mask: torch.Tensor | None = None,
    layers: list[int] | None = None,
    heads: list[int] | None = None,
    offsets: tuple[int, int] = (0, 0),
) -> Panel:
    """A panel of attention maps: ``weights`` one (H, Tq, Tk) float tensor per layer (rows
    summing to 1), ``mask`` (Tq, Tk) bool, True = may attend (None: all keys), ``layers`` and
    ``heads`` the model's indices of what is given (default 0 ..). Hover or click a query token
    to see its row for the chosen layer and head, and every head's row at once. ``offsets``:
    the token positions of the first query and key (a window of a longer text).
    Raises ValueError when shapes and labels disagree."""
    if not weights:
        raise ValueError("attention_panel: no layers")
    h, tq, tk = weights[0].shape
    if any(tuple(w.shape) != (h, tq, tk) for w in weights):
        raise ValueError("attention_panel: the layers' weights differ in shape")
    if len(query_labels) != tq or len(key_labels) != tk:
        raise ValueError(
            f"{len(query_labels)} query and {len(key_labels)} key labels for weights {(h, tq, tk)}"
        )
    if mask is not None and tuple(mask.shape) != (tq, tk):
        raise ValueError(f"mask must be (T_query, T_key) = {(tq, tk)}, got {tuple(mask.shape)}")
    data = {
        "queries": list(query_labels),
        "keys": list(key_labels),
        "layers": list(range(len(weights))) if layers is None else list(layers),
        "heads": list(range(h)) if heads is None else list(heads),
        "weights": pack(torch.stack([w.detach().float().cpu() for w in weights])),
        "offsets": list(offsets),
        "mask": None if mask is None else ["".join("1" if b else "0" for b in r) for r in mask],
    }
    return Panel(panel_id, title, "attention", data)


def _json_for_script(value: object) -> str:
    """JSON that cannot end its <script> element or open a comment: '<', '>' and '&' escaped
    (JSON.parse reads them back), non-ASCII as \\u escapes."""
    text = json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(title: str, panels: list[Panel]) -> str:
    """The page's HTML text. Raises ValueError for no panels, a duplicate or malformed panel
    id, or a kind without a renderer; LmlabError for more than MAX_VALUES packed numbers."""
    if not panels:
        raise ValueError("render_page: no panels")
    ids = [p.id for p in panels]
    if len(set(ids)) != len(ids) or not all(i and i.replace("-", "").replace("_", "").isalnum()
                                            and i.isascii() for i in ids):  # fmt: skip
        raise ValueError(f"panel ids must be unique [A-Za-z0-9_-]+, got {ids}")
    unknown = sorted({p.kind for p in panels} - set(RENDERERS))
    if unknown:
        raise ValueError(f"no renderer for panel kind(s) {unknown}; known: {sorted(RENDERERS)}")
    n = sum(_count_packed(p.data) for p in panels)
    if n > MAX_VALUES:
        raise LmlabError(
            f"the page would hold {n:,} numbers, more than {MAX_VALUES:,}; choose a --layer, a "
            "--head or a shorter --window of tokens"
        )
    blob = {"title": title, "panels": [p.__dict__ for p in panels]}
    scripts = "\n".join(RENDERERS[k] for k in dict.fromkeys(p.kind for p in panels))
    parts = {"TITLE": html.escape(title), "DATA": _json_for_script(blob), "RENDERERS": scripts}
    return re.sub(r"%(TITLE|DATA|RENDERERS)%", lambda m: parts[m.group(1)], PAGE)  # one pass


def _count_packed(value: object) -> int:
    if isinstance(value, dict):
        if "u16" in value and "shape" in value:
            n = 1
            for s in value["shape"]:
                n *= int(s)
            return n
        return sum(_count_packed(v) for v in value.values())
    if isinstance(value, list):
        return sum(_count_packed(v) for v in value)
    return 0


def check_html_out(path: str | Path, flag: str = "--html") -> Path:
    """Refuse an HTML output path before any work: an existing file (never overwritten), a
    folder, a path under a file or a name too long (:func:`lmlab.fsutil.check_out_path`)."""
    if not str(path).strip():
        raise LmlabError(f"{flag} needs a file name (got an empty one)")
    p = check_out_path(path, flag, folder=False, what="the page")
    if os.path.lexists(p):
        raise LmlabError(f"{flag} {p} already exists; choose another file name or remove it")
    return p


def check_html_beside_pngs(
    html: str | Path, out: str | Path, pngs: re.Pattern[str] | tuple[str, ...], shown: str
) -> None:
    """Refuse, before any work, an ``--html`` path that is the ``--out`` folder or the name of
    a PNG the command writes there: ``pngs`` is a pattern matching those names in full or the
    tuple of them, ``shown`` how the message names them (e.g. ``"layer-LL.png"``). One message
    for every command (``lmlab attention``, ``lens``, ``patch``, ``heads``)."""
    h, o = Path(html).resolve(), Path(out).resolve()
    name_clash = h.parent == o and (
        pngs.fullmatch(h.name) is not None if isinstance(pngs, re.Pattern) else h.name in pngs
    )
    if h == o or name_clash:
        what = "the --out folder" if h == o else f"the name of a PNG that --out {out} receives"
        raise LmlabError(
            f"--html {html} is {what} (the PNGs there: {shown}); give the page a file name "
            "of its own, e.g. page.html"
        )


def write_page(path: str | Path, title: str, panels: list[Panel], flag: str = "--html") -> Path:
    """Write the page to ``path`` (parent folders created) all at once: a temporary file beside
    it is linked to ``path``, which fails if ``path`` appeared meanwhile, so an existing file is
    never replaced. Raises LmlabError for an existing ``path``, a full disk or a read-only
    folder (nothing left behind)."""
    p = check_html_out(path, flag)
    text = render_page(title, panels)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    with writing(p, len(text.encode())):
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.write_text(text, encoding="utf-8")
            os.link(tmp, p)
        except FileExistsError:
            raise LmlabError(
                f"{flag} {p} already exists; choose another file name or remove it"
            ) from None
        finally:
            tmp.unlink(missing_ok=True)
    return p


# -------------------------------------------------------------------- the page and renderers
# html_assets/page.html is the shell (tabs, state in the URL hash, error collector, helpers);
# each renderer is one JavaScript file, html_assets/KIND.js, defining
# LM.render[KIND](root, panel, state, setState): it draws panel.data into root (emptied before
# each call), reads its selection from state and changes it only through setState, and puts
# text in only through textContent.


def _asset(name: str) -> str:
    return (resources.files("lmlab.analysis") / "html_assets" / name).read_text(encoding="utf-8")


PAGE = _asset("page.html")
RENDERERS: dict[str, str] = {
    "attention": _asset("attention.js"),
    "heads": _asset("heads.js"),
    "patch": _asset("patch.js"),
    "lens": _asset("lens.js"),  # lmlab.analysis.lens_view.lens_panel
    "dla": _asset("dla.js"),  # lmlab.analysis.lens_view.dla_panel
}


def check_png_folder(out: str | Path) -> None:
    """Refuse, before any work, an ``--out`` PNG folder that cannot be one: an existing file (or
    FIFO, device), or a path under a file. Raises LmlabError naming --out."""
    o = Path(out)
    for p in (o, *o.parents):
        if p.exists() and not p.is_dir():
            where = "is" if p == o else f"is under {p}, which is"
            raise LmlabError(
                f"--out {out} {where} a file, not a folder; give a folder for the PNGs"
            )
