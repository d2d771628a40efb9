"""Attention maps: each head's weights on a text, with the numbers that diagnose it.

Legend: H heads, Tq query tokens, Tk key tokens. Every function takes one layer's weights as a
float tensor (H, Tq, Tk), rows summing to 1, with separate query and key labels, so decoder
self-attention (Tq = Tk, causal) and encoder-decoder cross-attention (decoder queries x encoder
keys) go through the same code.

Per head, averaged over the query rows that see at least two keys (a row that sees one key has no
choice: entropy 0 and all its weight on that key, which says nothing about the head; in a causal
map that is the first row):

- ``entropy``: -sum_j p_ij ln p_ij, in nats; ``entropy_max``: ln(n_i) for the n_i keys row i
  sees, the entropy of a uniform row (the "uniform causal maximum" ln(i + 1) for a causal mask;
  ln T for every row of a bidirectional encoder, which sees all T keys);
- ``mean_distance``: sum_j p_ij |pos(query i) - pos(key j)|, in tokens (None for cross-attention,
  whose query and key positions are not on one axis);
- ``sink``: p_i0, the share of attention on the first key (the "attention sink" of Xiao et al.
  2023, "Efficient Streaming Language Models with Attention Sinks");
- ``max_weight``: max_j p_ij.

A head is flagged **blurred** when entropy >= BLURRED_ENTROPY_RATIO (0.9) x entropy_max: it
spreads its weight almost uniformly and so barely distinguishes tokens (too small a 1/sqrt(d_k)
scale gone wrong, or an untrained head). It is flagged **collapsed** when max_weight >=
COLLAPSED_MAX_WEIGHT (0.9): nearly one-hot rows, every query reading one token (unscaled scores
saturating the softmax, or a head that only attends to the sink / to itself).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmlab.config import ModelConfig
from lmlab.errors import LmlabError

BLURRED_ENTROPY_RATIO = 0.9
COLLAPSED_MAX_WEIGHT = 0.9


@dataclass
class HeadStats:
    """The numbers of one head (see the module docstring for definitions and units)."""

    layer: int
    head: int
    entropy: float  # nats, mean over rows seeing >= 2 keys
    entropy_max: float  # nats, mean ln(keys seen) over the same rows
    mean_distance: float | None  # tokens
    sink: float  # share of attention on the first key, in [0, 1]
    max_weight: float  # mean largest weight of a row, in [0, 1]
    blurred: bool
    collapsed: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def head_stats(
    weights: torch.Tensor,
    mask: torch.Tensor | None = None,
    query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    distance: bool = True,
    layer: int = 0,
    heads: list[int] | None = None,
) -> list[HeadStats]:
    """Per-head statistics of one layer's attention weights.

    weights (H, Tq, Tk) float, rows summing to 1 (masked keys 0); mask (Tq, Tk) bool, True = the
    query may attend to the key (None: every key). query_positions (Tq,), key_positions (Tk,):
    token positions for the distance (default: keys 0 .. Tk-1, queries the last Tq of them, as in
    self-attention); ``distance=False`` (cross-attention) gives mean_distance None. ``heads``
    names the heads in ``weights`` (default 0 .. H-1). Computed in float64.
    Raises ValueError for weights that are not 3-D or a mask of another shape.
    """
    if weights.dim() != 3:
        raise ValueError(f"weights must be (heads, T_query, T_key), got {tuple(weights.shape)}")
    h, tq, tk = weights.shape
    p = weights.detach().to("cpu", torch.float64)
    if mask is None:
        mask = torch.ones(tq, tk, dtype=torch.bool)
    if tuple(mask.shape) != (tq, tk):
        raise ValueError(f"mask must be (T_query, T_key) = {(tq, tk)}, got {tuple(mask.shape)}")
    mask = mask.to("cpu", torch.bool)
    n_seen = mask.sum(-1)  # (Tq,)
    rows = n_seen >= 2
    informative = bool(rows.any())
    if not informative:  # every row sees at most one key: average over all rows instead
        rows = n_seen >= 1
    if query_positions is None:
        query_positions = torch.arange(tk - tq, tk)
    if key_positions is None:
        key_positions = torch.arange(tk)
    dist = (query_positions.double()[:, None] - key_positions.double()[None, :]).abs()  # (Tq, Tk)

    plogp = torch.where(p > 0, p * torch.log(p.clamp_min(1e-300)), torch.zeros_like(p))
    entropy = (-plogp.sum(-1))[:, rows].mean(-1)  # (H,)
    entropy_max = torch.log(n_seen.clamp_min(1).double())[rows].mean()
    mean_dist = (p * dist).sum(-1)[:, rows].mean(-1)
    sink = p[:, :, 0][:, rows].mean(-1)
    max_w = p.max(-1).values[:, rows].mean(-1)
    names = list(range(h)) if heads is None else heads
    out = []
    for i in range(h):
        e, em = float(entropy[i]), float(entropy_max)
        out.append(
            HeadStats(
                layer=layer,
                head=names[i],
                entropy=e,
                entropy_max=em,
                mean_distance=float(mean_dist[i]) if distance else None,
                sink=float(sink[i]),
                max_weight=float(max_w[i]),
                blurred=informative and em > 0 and e >= BLURRED_ENTROPY_RATIO * em,
                collapsed=informative and float(max_w[i]) >= COLLAPSED_MAX_WEIGHT,
            )
        )
    return out


def token_label(raw: bytes) -> str:
    """A readable axis label for a token's bytes: UTF-8 text with whitespace made visible
    (space -> '␣', newline -> '\\n', tab -> '\\t'), or the bytes in hex ('<e4 b8>') for part of
    a multi-byte character (a byte-level BPE token)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "<" + " ".join(f"{b:02x}" for b in raw) + ">"
    return text.replace(" ", "␣").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


@dataclass
class AttentionMaps:
    """One forward pass's attention: per layer (H, Tq, Tk) float32 weights on the CPU, the
    query and key labels, and the (Tq, Tk) bool mask (True = may attend; None = all keys)."""

    weights: list[torch.Tensor]
    query_labels: list[str]
    key_labels: list[str]
    mask: torch.Tensor | None
    token_ids: list[int] = field(default_factory=list)
    query_offset: int = 0  # token position of the first row (a window of a longer map)
    key_offset: int = 0  # token position of the first column

    def window(self, start: int, end: int | None) -> AttentionMaps:
        """Rows and columns at positions start .. end-1 (each axis clipped to its length; end
        None: to the end), as a new AttentionMaps whose offsets record ``start``. The rows no
        longer sum to 1 where attention fell outside the window."""
        q = slice(min(start, len(self.query_labels)), end)
        k = slice(min(start, len(self.key_labels)), end)
        for axis, labels in (("query", self.query_labels), ("key", self.key_labels)):
            if not labels[q if axis == "query" else k]:
                raise LmlabError(
                    f"--window {start}:{'' if end is None else end} leaves no {axis} tokens: "
                    f"that axis has {len(labels)} (positions 0..{len(labels) - 1})"
                )
        return AttentionMaps(
            [w[:, q, k] for w in self.weights],
            self.query_labels[q],
            self.key_labels[k],
            None if self.mask is None else self.mask[q, k],
            self.token_ids,
            self.query_offset + (q.start or 0),
            self.key_offset + (k.start or 0),
        )


def parse_window(text: str, length: int) -> tuple[int, int | None]:
    """``--window START:END`` (token positions, END exclusive, either may be empty) checked
    against an axis of ``length`` tokens. Raises LmlabError for anything else, an empty window
    or an END past the last token (never clipped silently)."""
    # ASCII digits, at most 18 (int() refuses over 4,300 digits with a ValueError)
    m = re.fullmatch(r"\s*(-?[0-9]{0,18})\s*:\s*(-?[0-9]{0,18})\s*", text, flags=re.ASCII)
    if m is None or m.group(1) == "-" or m.group(2) == "-":
        raise LmlabError(f"--window {text!r}: give START:END token positions, e.g. 0:64")
    start = int(m.group(1)) if m.group(1) else 0
    end = int(m.group(2)) if m.group(2) else None
    if start < 0 or (end is not None and end < 0):
        raise LmlabError(
            f"--window {text!r}: positions count from 0 (the first token), not from the end; "
            f"the text has {length} tokens (positions 0..{length - 1})"
        )
    if (end is not None and end <= start) or start >= length:
        raise LmlabError(
            f"--window {text!r} is empty: the text has {length} tokens (positions 0..{length - 1})"
            " and START must be below END"
        )
    if end is not None and end > length:
        raise LmlabError(
            f"--window {text!r} ends past the text: it has {length} tokens (positions "
            f"0..{length - 1}); give END <= {length} or leave it empty ({start}:)"
        )
    return start, end


def model_config(model: torch.nn.Module) -> ModelConfig:
    """``model.cfg``; LmlabError when the model has no lmlab ModelConfig."""
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ModelConfig):
        raise LmlabError("the model has no lmlab ModelConfig (model.cfg)")
    return cfg


def encode_text(model: torch.nn.Module, tokenizer: Any, text: str) -> list[int]:
    """The ids of ``text`` as the model reads it: an encoder's framed as in training
    (:meth:`Tokenizer.encode_for_model`, [CLS] ... [SEP] for BERT), a decoder's plain. Raises
    LmlabError for no tokenizer, an empty text, one that encodes to nothing or one past
    model.cfg.max_seq_len tokens. Shared by ``lmlab attention``, ``lens``."""
    if tokenizer is None:
        raise LmlabError(
            "this model has no tokenizer (no tokenizer.json), so --text cannot be encoded"
        )
    if not text:
        raise LmlabError("--text is empty: give the text to run the model on")
    cfg = model_config(model)
    ids = tokenizer.encode_for_model(text) if cfg.kind == "encoder" else tokenizer.encode(text)
    if not ids:
        raise LmlabError(f"--text {text!r} encodes to no tokens")
    if len(ids) > cfg.max_seq_len:
        raise LmlabError(
            f"--text is {len(ids)} tokens, more than the model's context of {cfg.max_seq_len} "
            "(model.max_seq_len); shorten it"
        )
    return [int(i) for i in ids]


def self_attention_maps(model: torch.nn.Module, tokenizer: Any, text: str) -> AttentionMaps:
    """Run ``model`` on ``text`` with ``need_weights=True`` (the math backend, see
    lmlab.nn.attention) and return every layer's self-attention weights for that one sequence.

    The mask is the model's ``attention.mask``: causal for a decoder, bidirectional for an
    encoder (every row sees all T keys, so its uniform maximum is ln T). An encoder's text is
    framed as the model saw it in training (:meth:`Tokenizer.encode_for_model`: [CLS] ... [SEP]
    for BERT), so the labels include those tokens.

    Raises LmlabError for an empty text, a missing tokenizer, a text longer than
    model.cfg.max_seq_len tokens, an encoder-decoder model, or a model that returns no weights.
    """
    cfg = model_config(model)
    if cfg.kind not in ("decoder", "encoder"):  # one self-attention stack over one text
        raise LmlabError(
            f"attention maps cover decoders and encoders; this model is model.kind={cfg.kind}"
        )
    ids = encode_text(model, tokenizer, text)
    device = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model(x, need_weights=True)
    model.train(was_training)
    attns = getattr(out, "attentions", None)
    if not attns or any(w is None for w in attns):
        raise LmlabError(f"model.kind={cfg.kind} returned no attention weights")
    weights = [w[0].float().cpu() for w in attns]  # (H, T, T)
    from lmlab.nn.masks import MASKS

    t = len(ids)
    a = cfg.attention
    mask = MASKS.get(a.mask, "model.attention.mask")(t, t, torch.device("cpu"), a.window)
    labels = [token_label(tokenizer.token_bytes(i)) for i in ids]
    return AttentionMaps(weights, labels, labels, mask, ids)


def seq2seq_attention_maps(
    model: torch.nn.Module, tokenizer: Any, source: str, target: str | None = None
) -> dict[str, AttentionMaps]:
    """An encoder-decoder's attention on one (source, target) pair, per layer, keyed ``cross``
    (decoder queries x source keys, (H, T, S)), ``encoder`` (source x source, (H, S, S)) and
    ``decoder`` (causal self-attention, (H, T, T)).

    The source is encoded as the model reads it (``encode_for_model``); ``target`` defaults to
    the model's greedy output for it. The decoder reads the start token then the target, so
    query row t predicts target token t: rows are labelled by the token they predict (the
    target's tokens, then ``</s>``). Raises LmlabError for a model that is not an
    encoder-decoder, a missing tokenizer, an empty source, or a source or target longer than
    model.max_seq_len.
    """
    from lmlab.generation.generate import SamplingParams
    from lmlab.generation.seq2seq import generate_from_sources

    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ModelConfig) or cfg.kind != "encoder_decoder":
        raise LmlabError(
            "--source needs an encoder-decoder (seq2seq) model; give a decoder or encoder --text"
        )
    if tokenizer is None:
        raise LmlabError(
            "this model has no tokenizer (no tokenizer.json), so --source cannot be encoded"
        )
    if target is None:  # the model's own greedy output (checks the source on the way)
        greedy = SamplingParams(max_new_tokens=cfg.max_seq_len, temperature=0.0)
        target = generate_from_sources(model, tokenizer, [source], greedy)[0]
    src = tokenizer.encode_for_model(source)
    if not source or not src:
        raise LmlabError(f"--source {source!r} encodes to no tokens")
    tgt = tokenizer.encode(target)
    eos, start = cfg.seq2seq.eos_token_id, cfg.seq2seq.decoder_start_token_id
    if start is None:
        raise LmlabError("model.seq2seq.decoder_start_token_id is not set")
    for side, n in (("--source", len(src)), ("--target (+ the start token)", len(tgt) + 1)):
        if n > cfg.max_seq_len:
            raise LmlabError(
                f"{side} is {n} tokens, more than the model's context of {cfg.max_seq_len} "
                "(model.max_seq_len); shorten it"
            )
    device = next(model.parameters()).device
    x = torch.tensor([src], dtype=torch.long, device=device)
    dec = torch.tensor([[start, *tgt]], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model(input_ids=x, decoder_input_ids=dec, need_weights=True)
    model.train(was_training)
    predicted = [*tgt, eos] if eos is not None else tgt
    src_labels = [token_label(tokenizer.token_bytes(i)) for i in src]
    tgt_labels = [token_label(tokenizer.token_bytes(i)) for i in predicted][: len(tgt) + 1]
    t = len(tgt) + 1
    causal = torch.ones(t, t, dtype=torch.bool).tril()

    def layers(ws: list[torch.Tensor | None], what: str) -> list[torch.Tensor]:
        if not ws or any(w is None for w in ws):
            raise LmlabError(f"the model returned no {what} attention weights")
        return [w[0].float().cpu() for w in ws if w is not None]

    return {
        "cross": AttentionMaps(
            layers(out.cross_attentions, "cross"), tgt_labels, src_labels, None, src
        ),
        "encoder": AttentionMaps(
            layers(out.encoder_attentions, "encoder"), src_labels, src_labels, None, src
        ),
        "decoder": AttentionMaps(
            layers(out.attentions, "decoder self"), tgt_labels, tgt_labels, causal, tgt
        ),
    }


def _select(n: int, index: int | None, what: str, flag: str) -> list[int]:
    if index is None:
        return list(range(n))
    if not 0 <= index < n:
        raise LmlabError(f"{flag} {index} is out of range: the model has {n} {what} (0..{n - 1})")
    return [index]


@dataclass
class AttentionReport:
    """What ``lmlab attention`` found: the tokens, per-head stats, and the PNG files written."""

    tokens: list[str]
    heads: list[HeadStats]
    files: list[Path]
    thresholds: dict[str, float]
    target_tokens: list[str] | None = None  # seq2seq: the decoder rows' labels (tokens = source)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "target_tokens": self.target_tokens,
            "heads": [h.as_dict() for h in self.heads],
            "files": [str(f) for f in self.files],
            "thresholds": self.thresholds,
        }


def attention_report(
    path: str | Path,
    text: str | None = None,
    layer: int | None = None,
    head: int | None = None,
    out: str | Path | None = "attention",
    device: str = "cpu",
    source: str | None = None,
    target: str | None = None,
    html: str | Path | None = None,
    window: str | None = None,
) -> AttentionReport:
    """Load the model at ``path`` (anything lmlab.interop.load.load accepts), run it on
    ``text``, and compute per-head stats for the chosen layer(s) and head(s) (0-based; None:
    all). Writes ``out/layer-LL.png`` (one grid per layer, one panel per head) unless ``out`` is
    None. Raises LmlabError for a layer or head out of range and for bad text.

    An encoder-decoder takes ``source`` (and optionally ``target``, default: its greedy output)
    instead of ``text``: the stats are its cross-attention's (:func:`seq2seq_attention_maps`),
    and it writes ``out/cross-layer-LL.png`` (target tokens on y, source tokens on x),
    ``out/encoder-layer-LL.png`` and ``out/decoder-layer-LL.png``.

    ``html``: also write one self-contained page there (:mod:`lmlab.analysis.html_view`; an
    encoder-decoder's has cross, encoder and decoder tabs). An existing file is refused before
    the model is loaded, never replaced. ``window`` ("START:END", :func:`parse_window`): the
    PNGs and the page show token positions START .. END-1 only (the stats cover every token).
    """
    from lmlab.analysis.html_view import check_html_beside_pngs, check_html_out
    from lmlab.interop.load import load
    from lmlab.training.hardware import resolve_device

    if html is not None:
        check_html_out(html)
        if out is not None:
            check_html_beside_pngs(html, out, PNG_NAME, "[cross-|encoder-|decoder-]layer-LL.png")
    if (text is None) == (source is None):
        raise LmlabError("give --text (decoder or encoder models) or --source (encoder-decoder)")
    if target is not None and source is None:
        raise LmlabError("--target goes with --source (encoder-decoder models)")
    model, tokenizer = load(path, str(resolve_device(device)))
    kind = getattr(getattr(model, "cfg", None), "kind", None)
    if source is not None or kind == "encoder_decoder":
        if source is None:
            raise LmlabError(
                f"{path} is an encoder-decoder (seq2seq) model: give --source TEXT (and "
                "optionally --target TEXT) instead of --text"
            )
        return _seq2seq_report(
            path, model, tokenizer, source, target, layer, head, out, html, window
        )
    assert text is not None
    maps = self_attention_maps(model, tokenizer, text)
    layers = _select(len(maps.weights), layer, "layers", "--layer")
    n_heads = maps.weights[0].shape[0]
    heads = _select(n_heads, head, "heads per layer", "--head")
    stats: list[HeadStats] = []
    files: list[Path] = []
    for li in layers:
        w = maps.weights[li][heads]
        stats += head_stats(w, maps.mask, layer=li, heads=heads)
    shown = maps if window is None else maps.window(*parse_window(window, len(maps.key_labels)))
    if out is not None:
        files = _save_heatmaps(out, [(shown, layers, "", Path(path).name)], heads)
    if html is not None:
        files.append(
            _save_page(html, Path(path).name, {"self": ("self-attention", shown)}, layers, heads)
        )
    return AttentionReport(maps.query_labels, stats, files, _thresholds())


PNG_NAME = re.compile(r"(?:(?:cross|encoder|decoder)-)?layer-\d+\.png")


def _seq2seq_report(
    path: str | Path,
    model: torch.nn.Module,
    tokenizer: Any,
    source: str,
    target: str | None,
    layer: int | None,
    head: int | None,
    out: str | Path | None,
    html: str | Path | None = None,
    window: str | None = None,
) -> AttentionReport:
    maps = seq2seq_attention_maps(model, tokenizer, source, target)
    cross = maps["cross"]
    layers = _select(len(cross.weights), layer, "decoder layers", "--layer")
    heads = _select(cross.weights[0].shape[0], head, "heads per layer", "--head")
    stats: list[HeadStats] = []
    for li in layers:
        stats += head_stats(cross.weights[li][heads], None, distance=False, layer=li, heads=heads)
    files: list[Path] = []
    if window is not None:  # positions on each axis: target rows, source columns
        longest = max(len(cross.query_labels), len(cross.key_labels))
        maps = {k: m.window(*parse_window(window, longest)) for k, m in maps.items()}
    if out is not None:
        titles = {"cross": "cross-attention", "encoder": "encoder", "decoder": "decoder self"}
        groups = [
            (
                m,
                _select(len(m.weights), layer, "layers", "--layer"),
                f"{name}-",
                f"{Path(path).name}: {titles[name]}",
            )
            for name, m in maps.items()
        ]
        files = _save_heatmaps(out, groups, heads)
    if html is not None:
        names = {"cross": "cross-attention", "encoder": "encoder self", "decoder": "decoder self"}
        panels = {k: (names[k], maps[k]) for k in ("cross", "encoder", "decoder")}
        files.append(_save_page(html, Path(path).name, panels, layer, heads))
    return AttentionReport(cross.key_labels, stats, files, _thresholds(), cross.query_labels)


def _thresholds() -> dict[str, float]:
    """The flag thresholds a report records next to its numbers."""
    return {
        "blurred_entropy_ratio": BLURRED_ENTROPY_RATIO,
        "collapsed_max_weight": COLLAPSED_MAX_WEIGHT,
    }


def _save_heatmaps(
    out: str | Path, groups: list[tuple[AttentionMaps, list[int], str, str]], heads: list[int]
) -> list[Path]:
    """One PNG per (maps, layer) into ``out``: ``{prefix}layer-LL.png`` titled ``{title}, layer
    L`` (``{title}: layer L`` when the group has no prefix). Raises LmlabError if ``out``
    cannot be created."""
    from lmlab.analysis.attention_plot import plot_heads, save_figure

    folder = Path(out)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LmlabError(f"cannot create the output folder {folder}: {e.strerror}") from None
    files: list[Path] = []
    for maps, layers, prefix, title in groups:
        for li in layers:
            fig = plot_heads(
                maps.weights[li][heads],
                maps.query_labels,
                maps.key_labels,
                heads=heads,
                mask=maps.mask,
                title=f"{title}, layer {li}" if prefix else f"{title}: layer {li}",
                query_offset=maps.query_offset,
                key_offset=maps.key_offset,
            )
            files.append(save_figure(fig, folder / f"{prefix}layer-{li:02d}.png"))
    return files


def _save_page(
    html: str | Path,
    title: str,
    panels: dict[str, tuple[str, AttentionMaps]],
    layers: list[int] | int | None,
    heads: list[int],
) -> Path:
    """One HTML page with a tab per ``panels`` entry (id -> (title, maps)): the chosen
    ``layers`` (a list, or the --layer value: None = all) and ``heads`` of each."""
    from lmlab.analysis.html_view import attention_panel, write_page

    built = []
    for pid, (name, maps) in panels.items():
        chosen = (
            layers
            if isinstance(layers, list)
            else _select(len(maps.weights), layers, "layers", "--layer")
        )
        weights = [maps.weights[li][heads] for li in chosen]
        built.append(
            attention_panel(pid, name, weights, maps.query_labels, maps.key_labels, maps.mask,
                            layers=chosen, heads=heads, offsets=(maps.query_offset,
                                                                 maps.key_offset))
        )  # fmt: skip
    return write_page(html, f"{title}: attention", built)


def format_stats(stats: list[HeadStats]) -> str:
    """A table: layer, head, entropy / uniform max (nats), mean distance (tokens), sink share,
    mean max weight, and the flags."""
    lines = [
        f"{'layer':>5} {'head':>4} {'entropy':>8} {'max':>6} {'distance':>8} {'sink':>6} "
        f"{'max_w':>6}  flag"
    ]
    for s in stats:
        dist = "-" if s.mean_distance is None else f"{s.mean_distance:8.2f}"
        flag = "blurred" if s.blurred else "collapsed" if s.collapsed else ""
        lines.append(
            f"{s.layer:>5} {s.head:>4} {s.entropy:8.3f} {s.entropy_max:6.3f} {dist:>8} "
            f"{s.sink:6.3f} {s.max_weight:6.3f}  {flag}"
        )
    return "\n".join(lines)
