"""``lmlab lens``: the logit lens of a model on a text and, given a target token, the direct
logit attribution of its logit; tables, JSON, PNGs and an HTML page.

Legend: R = L + 1 rows (embed, layer 0 .. L-1), T positions, k top tokens. The numbers come
from :mod:`lmlab.analysis.lens`; the pictures from :mod:`lmlab.analysis.lens_view`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmlab.analysis.attention_maps import encode_text, token_label
from lmlab.analysis.lens import LogitLens, logit_lens
from lmlab.analysis.lens_attribution import LogitAttribution, direct_logit_attribution
from lmlab.errors import LmlabError

MAX_TOP = 1000  # --top: top tokens kept per layer and position
PNG_NAMES = ("lens.png", "dla.png")
CHUNK = 8  # positions per block of the printed tables
SPACE_HINT = " (a word-start token usually includes its leading space, e.g. ' the')"


@dataclass
class LensReport:
    """What ``lmlab lens`` found: the input ``tokens`` (labels) and ``ids``, the ``rows``
    (embed, layer 0 ..), per row and position the top-k ``top`` as (label, probability) lists,
    the target's probability and rank (1 = top) per row and position, the attribution (or why
    there is none), and the files written."""

    tokens: list[str]
    ids: list[int]
    rows: list[str]
    top: list[list[list[tuple[str, float]]]]  # (R, T, k)
    lens: LogitLens
    target: str | None = None
    target_id: int | None = None
    versus: str | None = None
    versus_id: int | None = None
    dla: LogitAttribution | None = None
    dla_unavailable: str | None = None
    files: list[Path] = field(default_factory=list)
    masked_lm: bool = False  # an encoder: each column predicts its own (masked) token
    source: list[str] | None = None  # an encoder-decoder: the encoder input's token labels
    source_ids: list[int] | None = None

    @property
    def predicts(self) -> str:
        """What a column's distribution is over, in words."""
        return "the token at each position (masked LM)" if self.masked_lm else "the next token"

    @property
    def what(self) -> str:
        """The attributed logit in words: logit('a') or logit('a') - logit('b')."""
        text = f"logit({self.target!r})"
        return text + (f" - logit({self.versus!r})" if self.versus is not None else "")

    def as_dict(self) -> dict[str, Any]:
        lens = self.lens
        out: dict[str, Any] = {
            "tokens": self.tokens,
            "ids": self.ids,
            "source": None
            if self.source is None
            else {"tokens": self.source, "ids": self.source_ids},
            "rows": self.rows,
            "hooks": lens.hooks,
            "top": [[[[s, p] for s, p in cell] for cell in row] for row in self.top],
            "top_ids": lens.top_ids[0].tolist(),
            "target": None,
            "dla": None,
            "dla_unavailable": self.dla_unavailable,
            "files": [str(f) for f in self.files],
        }
        if self.target is not None and lens.target_probs is not None:
            assert lens.target_ranks is not None
            out["target"] = {
                "token": self.target,
                "id": self.target_id,
                "probs": lens.target_probs[0].tolist(),
                "ranks": lens.target_ranks[0].tolist(),
            }
        if self.dla is not None:
            d = self.dla
            out["dla"] = {
                "what": self.what,
                "target_id": d.target,
                "versus": self.versus,
                "versus_id": d.versus,
                "position": d.position,
                "components": dict(zip(d.names, d.values.tolist(), strict=True)),
                "top": [[n, v] for n, v in d.top(10)],
                "total": d.total,
                "actual": d.actual,
                "norm_scale": d.scale,
            }
        return out


def one_token(tokenizer: Any, text: str, flag: str) -> int:
    """The id of the single token ``text`` encodes to. Raises LmlabError (one line naming
    ``flag``) when it is empty, cannot be encoded, or is more than one token."""
    if not text:
        raise LmlabError(f"{flag} is empty: give one token of the model's vocabulary")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise LmlabError(f"{flag} is not UTF-8 text; give UTF-8 text") from None
    try:
        ids = tokenizer.encode(text)
    except LmlabError as e:
        raise LmlabError(f"{flag} {text!r} is not in the vocabulary: {e}") from None
    unk = tokenizer.special_id("unk")
    if len(ids) == 1 and ids[0] == unk and text != token_label(tokenizer.token_bytes(unk)):
        raise LmlabError(f"{flag} {text!r} is not in the vocabulary (it encodes to the unknown "
                         f"token){SPACE_HINT}")  # fmt: skip
    if len(ids) != 1:
        shown = " ".join(repr(token_label(tokenizer.token_bytes(i))) for i in ids[:6])
        raise LmlabError(
            f"{flag} {text!r} is {len(ids)} tokens ({shown}), not one; give a single token"
            f"{SPACE_HINT}"
        )
    return int(ids[0])


def lens_report(
    path: str | Path,
    text: str,
    top: int = 5,
    target: str | None = None,
    versus: str | None = None,
    position: int = -1,
    out: str | Path | None = "lens",
    html: str | Path | None = None,
    device: str = "cpu",
    source: str | None = None,
) -> LensReport:
    """Load the model at ``path`` (lmlab.interop.load.load), run the logit lens on ``text``
    (:func:`lmlab.analysis.lens.logit_lens`, top ``top`` tokens) and, given ``target`` (one
    token's text), follow it through the layers and attribute its logit at ``position``
    (minus ``versus``'s) to the components (:func:`direct_logit_attribution`; where the model's
    blocks do not allow it, ``dla_unavailable`` says why). Writes ``out/lens.png`` and, with a
    target, ``out/dla.png`` unless ``out`` is None; ``html``: one self-contained page (an
    existing file is refused before the model is loaded). An encoder-decoder needs ``source``
    (the encoder's text, encoded as in training); ``text`` is then the decoder's, read behind
    the decoder start token (:func:`encode_pair`). Raises LmlabError for a bad text, source,
    target, position or top, and for ``source`` given to another kind or missing for an
    encoder-decoder."""
    from lmlab.analysis.html_view import check_html_beside_pngs, check_html_out, check_png_folder
    from lmlab.interop.load import load
    from lmlab.training.hardware import resolve_device

    if out is not None:
        check_png_folder(out)
    if html is not None:
        check_html_out(html)
        if out is not None:
            check_html_beside_pngs(html, out, PNG_NAMES, ", ".join(PNG_NAMES))
    if versus is not None and target is None:
        raise LmlabError("--versus goes with --target (the logit difference target - versus)")
    if not 1 <= top <= MAX_TOP:  # (R, T, k) labels are kept and printed: bound k
        raise LmlabError(f"--top must be between 1 and {MAX_TOP}, got {top}")
    if versus is not None and versus == target:
        raise LmlabError(f"--versus {versus!r} is the --target token; give a different one")
    model, tokenizer = load(path, str(resolve_device(device)))
    ids, src = encode_pair(model, tokenizer, text, source, path)
    t = len(ids)
    if not -t <= position < t:
        raise LmlabError(
            f"--position {position} is out of range: the text has {t} tokens (0..{t - 1}, or "
            f"-{t}..-1 from the end)"
        )
    tid = one_token(tokenizer, target, "--target") if target is not None else None
    vid = one_token(tokenizer, versus, "--versus") if versus is not None else None
    device_ = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=device_)
    sx = None if src is None else torch.tensor([src], dtype=torch.long, device=device_)
    vocab = int(getattr(model, "cfg").vocab_size)  # noqa: B009  (checked in encode_text)
    lens = logit_lens(
        model, x, top_k=min(top, vocab), targets=tid, keep_log_probs=False, source_ids=sx
    )
    label = _labeller(tokenizer)
    report = LensReport(
        [label(i) for i in ids], ids, lens.row_labels,
        [[[(label(int(i)), float(p)) for i, p in zip(ci.tolist(), cp.tolist(), strict=True)]
          for ci, cp in zip(ri, rp, strict=True)]
         for ri, rp in zip(lens.top_ids[0], lens.top_probs[0], strict=True)],
        lens, target, tid, versus, vid, masked_lm=model.cfg.kind == "encoder",  # type: ignore[union-attr]
        source=None if src is None else [label(i) for i in src], source_ids=src,
    )  # fmt: skip
    if tid is not None:
        try:
            report.dla = direct_logit_attribution(model, x, tid, vid, position, source_ids=sx)
        except LmlabError as e:
            report.dla_unavailable = str(e)
    if out is not None:
        report.files += _save_pngs(Path(out), report, Path(path).name)
    if html is not None:
        report.files.append(_save_page(html, report, Path(path).name))
    return report


def encode_pair(
    model: Any, tokenizer: Any, text: str, source: str | None, path: str | Path
) -> tuple[list[int], list[int] | None]:
    """The ids ``lmlab lens`` runs: (``text``'s, None) for a decoder or encoder
    (:func:`encode_text`); for an encoder-decoder (decoder ids, source ids) as in training
    (lmlab.training.objectives.encode_pairs, lmlab.models.encoder_decoder.shift_right): the
    source framed by ``encode_for_model``, the decoder input ``decoder_start_token_id`` then
    ``text``'s plain ids (column j predicts target token j; an empty ``text``: the start token
    alone, whose column predicts the first target token). Raises LmlabError for a source
    missing (encoder-decoder) or given (other kinds), empty or longer than the context, or an
    unset start token."""
    cfg: Any = getattr(model, "cfg", None)
    kind = getattr(cfg, "kind", None)
    if kind != "encoder_decoder":
        if source is not None:
            raise LmlabError(
                f"--source goes with an encoder-decoder (model.kind=encoder_decoder); {path} is "
                f"model.kind={kind}: give the whole text with --text"
            )
        return encode_text(model, tokenizer, text), None
    if source is None:
        raise LmlabError(
            f"lmlab lens covers decoder, encoder and encoder-decoder models; {path} is "
            "model.kind=encoder_decoder: give the encoder's input with --source TEXT (and the "
            "decoder's target prefix with --text)"
        )
    ids = encode_text(model, tokenizer, text) if text else []  # "": the start token alone
    if not source:
        raise LmlabError("--source is empty: give the encoder's input text")
    src = [int(i) for i in tokenizer.encode_for_model(source)]
    if not src:
        raise LmlabError(f"--source {source!r} encodes to no tokens")
    if len(src) > cfg.max_seq_len:
        raise LmlabError(f"--source is {len(src)} tokens, more than the encoder context of "
                         f"{cfg.max_seq_len} (model.max_seq_len); shorten it")  # fmt: skip
    start = cfg.seq2seq.decoder_start_token_id
    if start is None:
        raise LmlabError(f"{path}: model.seq2seq.decoder_start_token_id is not set, so the "
                         "decoder input cannot be built")  # fmt: skip
    if len(ids) + 1 > cfg.max_seq_len:
        raise LmlabError(
            f"--text is {len(ids)} tokens; with the decoder start token that is more than the "
            f"model's context of {cfg.max_seq_len} (model.max_seq_len); shorten it"
        )
    return [int(start), *ids], src


def _labeller(tokenizer: Any) -> Any:
    cache: dict[int, str] = {}

    def label(i: int) -> str:
        if i not in cache:
            cache[i] = token_label(tokenizer.token_bytes(i))
        return cache[i]

    return label


def _save_pngs(folder: Path, report: LensReport, name: str) -> list[Path]:
    from lmlab.analysis.lens_view import plot_dla, plot_lens, save

    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LmlabError(f"cannot create the output folder {folder}: {e.strerror}") from None
    probs = report.lens.top_probs[0, :, :, 0]  # (R, T)
    labels = [[cell[0][0] for cell in row] for row in report.top]
    after = "the token there (masked LM)" if report.masked_lm else "the token after it"
    xlabel = f"input token (the column predicts {after})"
    title = f"{name}: logit lens"
    if report.source is not None:
        xlabel = f"decoder input token (the column predicts {after})"
        inches = max(4.0, 0.55 * len(report.tokens) + 2.0)  # plot_lens's width (uncapped)
        title += f" of the decoder\nsource: {_shown(report.source, int(10 * inches))}"
    fig = plot_lens(probs, labels, report.tokens, report.rows, title, xlabel)
    files = [save(fig, folder / "lens.png")]
    if report.dla is not None:
        title = f"{name}: {report.what} at position {report.dla.position}"
        files.append(save(plot_dla(report.dla, report.what, title), folder / "dla.png"))
    return files


def _save_page(html: str | Path, report: LensReport, name: str) -> Path:
    from lmlab.analysis.html_view import write_page
    from lmlab.analysis.lens_view import dla_panel, lens_panel

    lens = report.lens
    target = None
    if report.target is not None and lens.target_probs is not None:
        assert lens.target_ranks is not None
        target = (report.target, lens.target_probs[0], lens.target_ranks[0])
    labels = [[[s for s, _ in cell] for cell in row] for row in report.top]
    panels = [lens_panel(report.tokens, report.rows, labels, lens.top_probs[0], target,
                         source=report.source)]  # fmt: skip
    if report.dla is not None:
        panels.append(dla_panel(report.dla, report.what, report.tokens[report.dla.position]))
    return write_page(html, f"{name}: logit lens", panels)


# ----------------------------------------------------------------------------- tables


def format_lens(report: LensReport) -> str:
    """The layer x position table of top-1 token and probability (blocks of CHUNK positions;
    rows from the last layer down to the embedding) and, with a target, its probability and
    rank per layer x position."""
    blocks = []
    t = len(report.tokens)
    lens = report.lens
    for start in range(0, t, CHUNK):
        cols = range(start, min(start + CHUNK, t))
        head = f"{'':>9} " + " ".join(f"{f'{j} {report.tokens[j]}'[:14]:>14}" for j in cols)
        lines = [head]
        for r in reversed(range(len(report.rows))):
            cells = " ".join(f"{_cell(report.top[r][j][0]):>14}" for j in cols)
            lines.append(f"{report.rows[r]:>9} {cells}")
        if report.target is not None and lens.target_probs is not None:
            assert lens.target_ranks is not None
            lines.append(f"target {report.target!r}: probability (rank)")
            probs, ranks = lens.target_probs[0].tolist(), lens.target_ranks[0].tolist()
            for r in reversed(range(len(report.rows))):
                cells = " ".join(f"{f'{probs[r][j]:.3f} ({ranks[r][j]})':>14}" for j in cols)
                lines.append(f"{report.rows[r]:>9} {cells}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _shown(tokens: list[str], chars: int) -> str:
    """The token labels joined by spaces, cut to about ``chars`` characters with an ellipsis."""
    text = " ".join(tokens)
    return text if len(text) <= chars else text[: max(chars - 4, 1)] + " ..."


def _cell(entry: tuple[str, float]) -> str:
    label, p = entry
    return f"{label[:8]} {p:.2f}"


def format_dla(report: LensReport) -> str:
    """The top 10 components by |contribution| and their sum against the actual logit."""
    d = report.dla
    if d is None:
        return f"direct logit attribution: not available: {report.dla_unavailable}"
    w = max(16, *(len(n) for n in d.names))  # final_logits_bias (BART) is 17
    lines = [
        f"direct logit attribution of {report.what} at position {d.position} "
        f"({report.tokens[d.position]!r}), final norm frozen at scale {d.scale:.4g}:",
        f"{'component':>{w}} {'logits':>10}",
    ]
    lines += [f"{n:>{w}} {v:+10.4f}" for n, v in d.top(10)]
    lines.append(f"{'sum of all ' + str(len(d.names)):>{w}} {d.total:+10.4f}")
    lines.append(f"{'actual':>{w}} {d.actual:+10.4f}")
    return "\n".join(lines)
