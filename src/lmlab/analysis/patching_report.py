"""``lmlab patch``: activation patching of a model on a clean / corrupted prompt pair, as
numbers, PNG heatmaps and an interactive page.

The measurement is :func:`lmlab.analysis.patching.patch_activations`; this module loads the
model, encodes the texts (``--target`` / ``--versus`` must each be one token), draws OUT/patch-
WHAT.png (layers x positions, the clean tokens on the x axis; layers x heads for ``heads``) and
builds the page's panel (renderer html_assets/patch.js).

An encoder-decoder is patched on a source pair (``clean_source`` / ``corrupted_source``, encoded
as the model reads it, :meth:`encode_for_model`) and a decoder text pair, each decoder input
being ``model.seq2seq.decoder_start_token_id`` followed by the text (as the model was trained:
targets shifted right behind the start token). Its maps: OUT/patch-encoder_WHAT.png (encoder
layers x source positions, or x heads) and the decoder's (layers x decoder positions, x self-
or cross-attention heads).

Legend: L layers, T tokens (decoder tokens of an encoder-decoder), S source tokens, H heads.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lmlab.analysis.attention_maps import token_label
from lmlab.analysis.patching import (
    DEFAULT_WHAT,
    ENCODER_DECODER_DEFAULT_WHAT,
    ENCODER_DECODER_POINTS,
    POINTS,
    PatchResult,
    patch_activations,
    tokens_phrase,
)
from lmlab.errors import LmlabError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from lmlab.analysis.html_view import Panel

PNG_NAME = re.compile(r"patch-[a-z_]+\.png")


@dataclass
class PatchReport:
    """What ``lmlab patch`` found: the clean and corrupted tokens' labels, the target and
    versus tokens' labels, the :class:`PatchResult` and the files written; for an
    encoder-decoder ``tokens`` are the decoder inputs' labels (the start token first) and
    ``source_tokens`` / ``corrupted_source_tokens`` the sources'."""

    tokens: list[str]
    corrupted_tokens: list[str]
    target: str
    versus: str | None
    result: PatchResult
    files: list[Path] = field(default_factory=list)
    source_tokens: list[str] | None = None  # an encoder-decoder's sources (tokens: decoder's)
    corrupted_source_tokens: list[str] | None = None

    def as_dict(self, top: int = 5) -> dict[str, Any]:
        sources = {}
        if self.source_tokens is not None:
            sources = {"source_tokens": self.source_tokens,
                       "corrupted_source_tokens": self.corrupted_source_tokens}  # fmt: skip
        return {
            **sources,
            "tokens": self.tokens,
            "corrupted_tokens": self.corrupted_tokens,
            "target_token": self.target,
            "versus_token": self.versus,
            **self.result.as_dict(),
            "top": {w: self.result.top(top, w) for w in self.result.scores},
            "files": [str(f) for f in self.files],
        }


def parse_what(text: str | Sequence[str] | None, seq2seq: bool = False) -> list[str]:
    """``--what resid_pre,attn_out`` (or a list) -> the names, each a key of POINTS (of
    ENCODER_DECODER_POINTS with ``seq2seq``), in the order given, no repeats. None: the
    default maps. Raises LmlabError naming a bad one."""
    points = ENCODER_DECODER_POINTS if seq2seq else POINTS
    if text is None:
        return list(ENCODER_DECODER_DEFAULT_WHAT if seq2seq else DEFAULT_WHAT)
    parts = [p.strip() for p in text.split(",")] if isinstance(text, str) else list(text)
    parts = [p for p in parts if p]
    bad = [p for p in parts if p not in points]
    if bad or not parts:
        kind = " (an encoder-decoder's)" if seq2seq else ""
        raise LmlabError(
            f"--what {','.join(bad) if bad else repr(text)}: choose from{kind} "
            f"{', '.join(points)} (comma-separated)"
        )
    return list(dict.fromkeys(parts))


def one_token(tokenizer: Any, text: str, flag: str) -> int:
    """The id of the single token ``text`` encodes to. Raises LmlabError otherwise, listing
    the tokens it makes."""
    ids = tokenizer.encode(text) if text else []
    if len(ids) != 1:
        shown = " ".join(repr(token_label(tokenizer.token_bytes(i))) for i in ids[:8])
        raise LmlabError(
            f"{flag} {text!r} is {len(ids)} tokens ({shown or 'none'}), not one: give text that "
            "is a single token of this tokenizer (a byte-level BPE word usually needs its "
            "leading space, e.g. ' Mary')"
        )
    return int(ids[0])


def _check_outputs(html: str | Path | None, out: str | Path | None) -> None:
    """Refuse, before any work, an existing --html file, or one that is the --out folder or
    the name of a PNG written there."""
    from lmlab.analysis.html_view import check_html_beside_pngs, check_html_out, check_png_folder

    if out is not None:
        check_png_folder(out)
    if html is None:
        return

    check_html_out(html)
    if out is None:
        return
    check_html_beside_pngs(html, out, PNG_NAME, "patch-WHAT.png")


def patch_report(
    path: str | Path,
    clean: str | None,
    corrupted: str | None,
    target: str,
    versus: str | None = None,
    what: str | Sequence[str] | None = None,
    out: str | Path | None = "patch",
    html: str | Path | None = None,
    device: str = "cpu",
    progress: Callable[[int, int], None] | None = None,
    clean_source: str | None = None,
    corrupted_source: str | None = None,
) -> PatchReport:
    """Load the decoder model at ``path`` (lmlab.interop.load.load: run folder, HF folder,
    GGUF), patch every activation of ``clean`` into ``corrupted`` (the same token length) and
    score it with the logit difference ``target`` - ``versus`` at the last token (each one
    token; no ``versus``: the target's log-probability, nats). Writes OUT/patch-WHAT.png per
    ``what`` unless ``out`` is None, and the page at ``html`` (refused before anything is
    loaded if it exists). Raises LmlabError for bad texts, tokens or paths.

    With ``clean_source`` the model must be an encoder-decoder: the sources are its encoder
    inputs (``corrupted_source`` defaults to ``clean_source``), ``clean`` / ``corrupted`` the
    decoder texts after the start token (``clean`` defaults to "", the start token alone, so
    the metric is on the first output token; ``corrupted`` defaults to ``clean``)."""
    from lmlab.interop.load import load
    from lmlab.training.hardware import resolve_device

    seq2seq = clean_source is not None or corrupted_source is not None
    chosen = parse_what(what, seq2seq)
    _check_outputs(html, out)
    if seq2seq:
        texts = _seq2seq_texts(clean, corrupted, clean_source, corrupted_source)
    else:
        for flag, text in (("--clean", clean), ("--corrupted", corrupted)):
            if text is None:
                raise LmlabError(
                    f"{flag} is required: give the prompt text (an encoder-decoder takes its "
                    "source with --clean-source instead)"
                )
            if not text:
                raise LmlabError(f"{flag} is empty: give the prompt text")
    model, tokenizer = load(path, str(resolve_device(device)))
    cfg = getattr(model, "cfg", None)
    kind = getattr(cfg, "kind", None)
    if cfg is None or kind != ("encoder_decoder" if seq2seq else "decoder"):
        if seq2seq:
            raise LmlabError(
                f"--clean-source / --corrupted-source are an encoder-decoder's source texts; "
                f"{path} is model.kind={kind} (give --clean and --corrupted only)"
            )
        hint = " (give its source text with --clean-source)" if kind == "encoder_decoder" else ""
        raise LmlabError(
            f"lmlab patch covers decoder (causal LM) models; {path} is model.kind={kind}{hint}"
        )
    if tokenizer is None:
        raise LmlabError(f"{path} has no tokenizer (no tokenizer.json), so the texts cannot be "
                         "encoded")  # fmt: skip
    if seq2seq:
        ids = _seq2seq_ids(cfg, tokenizer, texts)
    else:
        ids = {}
        for flag, text in (("--clean", clean), ("--corrupted", corrupted)):
            assert text is not None
            ids[flag] = tokenizer.encode(text)
            if not ids[flag]:
                raise LmlabError(f"{flag} {text!r} encodes to no tokens")
            _check_context(flag, len(ids[flag]), cfg.max_seq_len)
    t_id = one_token(tokenizer, target, "--target")
    v_id = None if versus is None else one_token(tokenizer, versus, "--versus")
    if v_id == t_id:
        raise LmlabError(f"--versus {versus!r} is the --target token; give a different one")
    dev = next(model.parameters()).device
    tensors = {k: torch.tensor([v], device=dev) for k, v in ids.items()}
    result = patch_activations(
        model,
        tensors["--clean"],
        tensors["--corrupted"],
        t_id,
        v_id,
        what=chosen,
        progress=progress,
        clean_source=tensors.get("--clean-source"),
        corrupted_source=tensors.get("--corrupted-source"),
    )
    labels = {k: [token_label(tokenizer.token_bytes(i)) for i in v] for k, v in ids.items()}
    report = PatchReport(
        labels["--clean"],
        labels["--corrupted"],
        token_label(tokenizer.token_bytes(t_id)),
        None if v_id is None else token_label(tokenizer.token_bytes(v_id)),
        result,
        source_tokens=labels.get("--clean-source"),
        corrupted_source_tokens=labels.get("--corrupted-source"),
    )
    title = Path(path).name
    if out is not None:
        report.files += save_maps(out, report, title)
    if html is not None:
        from lmlab.analysis.html_view import write_page

        report.files.append(write_page(html, f"{title}: activation patching",
                                       [patch_panel(report)]))  # fmt: skip
    return report


def _check_context(flag: str, n: int, context: int) -> None:
    if n > context:
        raise LmlabError(
            f"{flag} is {n} tokens, more than the model's context of {context} "
            "(model.max_seq_len); shorten it"
        )


def _seq2seq_texts(
    clean: str | None,
    corrupted: str | None,
    clean_source: str | None,
    corrupted_source: str | None,
) -> dict[str, str]:
    """An encoder-decoder's four texts, the defaults filled in: flag -> text. Raises
    LmlabError for a missing or empty --clean-source or a corrupted run equal to the clean."""
    if clean_source is None:
        raise LmlabError("--corrupted-source needs --clean-source (the source the model gets "
                         "right)")  # fmt: skip
    if not clean_source or corrupted_source == "":
        flag = "--clean-source" if not clean_source else "--corrupted-source"
        raise LmlabError(f"{flag} is empty: give the source text")
    clean = clean or ""
    texts = {
        "--clean-source": clean_source,
        "--corrupted-source": clean_source if corrupted_source is None else corrupted_source,
        "--clean": clean,
        "--corrupted": clean if corrupted is None else corrupted,
    }
    if (texts["--clean-source"], texts["--clean"]) == (texts["--corrupted-source"],
                                                       texts["--corrupted"]):  # fmt: skip
        raise LmlabError(
            "the corrupted run is the clean one: give --corrupted-source (a source with a few "
            "tokens changed) and/or --corrupted (a changed decoder text)"
        )
    return texts


def _seq2seq_ids(cfg: Any, tokenizer: Any, texts: dict[str, str]) -> dict[str, list[int]]:
    """flag -> ids: each source as the model reads it (``encode_for_model``), each decoder
    input the start token then the text's tokens (the model's training input: targets
    shifted right behind ``model.seq2seq.decoder_start_token_id``)."""
    start = cfg.seq2seq.decoder_start_token_id
    if start is None:
        raise LmlabError("model.seq2seq.decoder_start_token_id is not set")
    ids: dict[str, list[int]] = {}
    for flag, text in texts.items():
        if flag.endswith("-source"):
            ids[flag] = tokenizer.encode_for_model(text)
            if not ids[flag]:
                raise LmlabError(f"{flag} {text!r} encodes to no tokens")
        else:
            ids[flag] = [int(start), *tokenizer.encode(text)]
        _check_context(flag if flag.endswith("-source") else f"{flag} (+ the start token)",
                       len(ids[flag]), cfg.max_seq_len)  # fmt: skip
    return ids


def metric_text(r: PatchReport) -> str:
    """One line: the metric, its tokens and its clean / corrupted values."""
    res = r.result
    if r.versus is None:
        what = f"log p({r.target!r}) (nats)"
    else:
        what = f"logit diff {r.target!r} - {r.versus!r}"
    where = "the last token" if r.source_tokens is None else "the last decoder token"
    return f"{what} at {where}: clean {res.metric_clean:.4f}, corrupted {res.metric_corrupt:.4f}"


def format_report(r: PatchReport, top: int = 5) -> str:
    """The tokens, the metric line, and the ``top`` patches by |score| of each map (scores of
    exactly 0, patches that change nothing, left out)."""
    lines = []
    if r.source_tokens is not None and r.corrupted_source_tokens is not None:
        lines += [
            f"clean source, {tokens_phrase(len(r.source_tokens))}: {' '.join(r.source_tokens)}",
            f"corrupted source: {' '.join(r.corrupted_source_tokens)}",
        ]
    decoder = "" if r.source_tokens is None else " decoder input"
    n = max(10, *(len(w) for w in r.result.scores))  # "what" column width
    lines += [
        f"clean{decoder}, {tokens_phrase(len(r.tokens))}: {' '.join(r.tokens)}",
        f"corrupted{decoder}: {' '.join(r.corrupted_tokens)}",
        metric_text(r),
        "score = (patched - corrupted) / (clean - corrupted): 1 restores the clean value",
        f"{'what':<{n}} {'layer':>5} {'where':<24} {'score':>8} {'patched':>9}",
    ]
    cells = [c for w in r.result.scores for c in r.result.top(top, w) if c["score"] != 0.0]
    for c in cells:
        if "head" in c:
            where = f"head {c['head']}"
        else:
            where = f"pos {c['position']} {_tokens(r, c['what'])[c['position']]}"[:24]
        lines.append(
            f"{c['what']:<{n}} {c['layer']:>5} {where:<24} {c['score']:8.3f} {c['patched']:9.4f}"
        )
    return "\n".join(lines)


def _tokens(r: PatchReport, what: str) -> list[str]:
    """The clean labels a map's positions run over: the source's for ``encoder.*`` maps."""
    if what.startswith("encoder.") and r.source_tokens is not None:
        return r.source_tokens
    return r.tokens


# --------------------------------------------------------------------------- pictures


def plot_map(scores: torch.Tensor, columns: list[str], column_name: str, title: str = "") -> Figure:
    """One heatmap of a score map (L, X) float: layers on y (0 at the top), the X columns
    (tokens or heads, labelled ``columns``) on x; a diverging colour scale centred on 0,
    spanning [-a, a] with a = max(1, max |score|). Tick labels follow
    :mod:`lmlab.analysis.attention_plot` (CJK fonts found, long axes labelled at a stride)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from lmlab.analysis.attention_plot import (
        LONG_INPUT,
        MAX_FIGURE_INCHES,
        _ticks,
        printable_labels,
    )

    n_layers, x = scores.shape
    if len(columns) != x:
        raise ValueError(f"{len(columns)} column labels for a map of {x} columns")
    labels, families = printable_labels(columns)
    width = min(MAX_FIGURE_INCHES, max(6.0, 0.28 * x + 2.5))
    height = min(MAX_FIGURE_INCHES, max(3.0, 0.35 * n_layers + 2.0))
    fig = Figure(figsize=(width, height), layout="constrained")
    ax = fig.add_subplot(1, 1, 1, label="map")
    s = scores.detach().double().cpu().numpy()
    a = max(1.0, float(abs(s).max()) if s.size else 1.0)
    image = ax.imshow(s, cmap="RdBu_r", vmin=-a, vmax=a, aspect="auto", interpolation="nearest")
    fontsize = 8 if x <= LONG_INPUT else 6
    room = max(8, int((width - 1.5) * 72 / (1.6 * fontsize)))
    xt, xl = _ticks(labels, 0, room)
    ax.set_xticks(xt)
    ax.set_xticklabels(xl, rotation=0 if column_name.startswith("head") else 90,
                       fontsize=fontsize, family=families)  # fmt: skip
    yt, yl = _ticks([str(i) for i in range(n_layers)], 0, max(8, int(height * 72 / 13)))
    ax.set_yticks(yt)
    ax.set_yticklabels([lab.split(" ")[0] for lab in yl], fontsize=8)
    ax.set_xlabel(column_name, fontsize=9)
    ax.set_ylabel("layer", fontsize=9)
    fig.colorbar(image, ax=ax, shrink=0.8, label="score (1 = clean restored)")
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def _columns(r: PatchReport, what: str) -> tuple[list[str], str]:
    """A map's column labels and axis name."""
    if r.source_tokens is None:  # decoder-only
        if what == "heads":
            return [str(h) for h in range(r.result.scores[what].shape[1])], "head (all positions)"
        return r.tokens, "position (clean token)"
    stack = "encoder" if what.startswith("encoder.") else "decoder"
    if what.endswith("heads"):
        kind = "cross-attention " if what == "cross_heads" else ""
        heads = [str(h) for h in range(r.result.scores[what].shape[1])]
        return heads, f"{stack} {kind}head (all positions)"
    label = "source position (clean source token)" if stack == "encoder" else (
        "decoder position (clean decoder token)")  # fmt: skip
    return _tokens(r, what), label


def png_name(what: str) -> str:
    """The PNG of a map: patch-WHAT.png, a dot in WHAT (``encoder.heads``) written ``_``."""
    return f"patch-{what.replace('.', '_')}.png"


def save_maps(out: str | Path, r: PatchReport, title: str) -> list[Path]:
    """OUT/patch-WHAT.png for each map of ``r``. Raises LmlabError if ``out`` cannot be made."""
    from lmlab.analysis.attention_plot import save_figure

    folder = Path(out)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LmlabError(f"cannot create the output folder {folder}: {e.strerror}") from None
    files = []
    for what, s in r.result.scores.items():
        cols, name = _columns(r, what)
        fig = plot_map(s, cols, name, f"{title}: patching {what}\n{metric_text(r)}")
        files.append(save_figure(fig, folder / png_name(what)))
    return files


def patch_panel(r: PatchReport, panel_id: str = "patch") -> Panel:
    """The page's panel (renderer ``patch``): one packed map per ``what`` with its column
    labels, the clean and corrupted tokens and the metric; an encoder-decoder's maps also carry
    their own ``layers`` (encoder or decoder), ``corrupted`` labels and whether the columns
    are ``heads``."""
    from lmlab.analysis.html_view import Panel, pack

    res = r.result
    maps = []
    for what, s in res.scores.items():
        cols, name = _columns(r, what)
        m: dict[str, Any] = {"what": what, "columns": cols, "axis": name,
                             "values": pack(s.float())}  # fmt: skip
        if r.source_tokens is not None:  # an encoder-decoder: its own layers and corrupted row
            encoder = what.startswith("encoder.")
            corrupted = r.corrupted_source_tokens if encoder else r.corrupted_tokens
            m.update(layers=list(range(s.shape[0])), corrupted=corrupted,
                     heads=what.endswith("heads"))  # fmt: skip
        maps.append(m)
    data = {
        "maps": maps,
        "layers": list(range(next(iter(res.scores.values())).shape[0])),
        "tokens": r.tokens,
        "corrupted": r.corrupted_tokens,
        "metric": metric_text(r),
        "metric_clean": res.metric_clean,
        "metric_corrupt": res.metric_corrupt,
    }
    return Panel(panel_id, "activation patching", "patch", data)
