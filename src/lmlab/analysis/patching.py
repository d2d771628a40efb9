"""Activation patching: which activations carry the difference between a clean and a corrupted
prompt.

Run the model on a clean prompt (``"When Mary and John went to the store, John gave a drink
to"`` -> `` Mary``) and on a corrupted one of the same token length (the names swapped), then
re-run the corrupted prompt with ONE activation replaced by its value from the clean run and
measure how much of the clean behaviour comes back. The method is the causal tracing of Meng
et al. 2022 ("Locating and Editing Factual Associations in GPT", ROME; they restore clean
states into a noised run) and the path/activation patching of Wang et al. 2022
("Interpretability in the Wild", IOI); the normalised score and its caveats follow Heimersheim
& Nanda 2024 ("How to use and interpret activation patching").

Everything here is written against :mod:`lmlab.hooks` (``run_with_cache`` / ``run_with_hooks``)
and works on any model kind whose forward takes ``model(ids)`` (decoders, encoders), and on
encoder-decoders (``model(input_ids=source, decoder_input_ids=ids)``; below the tables).

Legend: B batch (one row per patch in a batched run), T tokens, V vocab, L layers, H heads,
hd head_dim. The metric m(logits) is the logit difference ``logits[pos, target] -
logits[pos, versus]`` (:func:`logit_diff`, in logits) or, with no ``versus``, the target's
log-probability ``log_softmax(logits[pos])[target]`` (:func:`target_log_prob`, in nats). The
score of a patch is

    score = (m_patched - m_corrupt) / (m_clean - m_corrupt)

1 = the patch restores the clean metric fully, 0 = no effect, negative = it moves the metric
further from clean, above 1 = it overshoots. All metrics and scores are float64.

What can be patched (``what``), each the clean activation written into the corrupted run:

==============  ==============================  ======================  =====================
what            hook point                      one patch               score map
==============  ==============================  ======================  =====================
``resid_pre``   ``layers.{i}.hook_resid_pre``   layer i, position t     (L, T)
``resid_mid``   ``layers.{i}.hook_resid_mid``   layer i, position t     (L, T)
``resid_post``  ``layers.{i}.hook_resid_post``  layer i, position t     (L, T)
``attn_out``    ``layers.{i}.attn.hook_out``    layer i, position t     (L, T)
``ffn_out``     ``layers.{i}.ffn.hook_out``     layer i, position t     (L, T)
``heads``       ``layers.{i}.attn.hook_z``      layer i, head h, all    (L, H)
                                                positions (z[:, h])
==============  ==============================  ======================  =====================

An encoder-decoder (``model.kind: encoder_decoder``) is patched with ``clean_source`` /
``corrupted_source`` (the encoder inputs, S tokens each) next to the decoder inputs
``clean_ids`` / ``corrupted_ids`` (T tokens each; in the usual case one source word changes and
the decoder input is the same in both runs). The metric is read from the decoder's logits. The
decoder-only names above then mean the decoder's points (``decoder.layers.{i}...``, maps
(L_dec, T) and (L_dec, H)), and :data:`ENCODER_DECODER_POINTS` adds:

======================  ==========================================  ================  ==========
what                    hook point                                  one patch         score map
======================  ==========================================  ================  ==========
``encoder.resid_pre``   ``encoder.layers.{i}.hook_resid_pre``       layer i, source   (L_enc, S)
                                                                    position s
``encoder.resid_mid``   ``encoder.layers.{i}.hook_resid_mid``       layer i, s        (L_enc, S)
``encoder.resid_post``  ``encoder.layers.{i}.hook_resid_post``      layer i, s        (L_enc, S)
``encoder.attn_out``    ``encoder.layers.{i}.attn.hook_out``        layer i, s        (L_enc, S)
``encoder.ffn_out``     ``encoder.layers.{i}.ffn.hook_out``         layer i, s        (L_enc, S)
``encoder.heads``       ``encoder.layers.{i}.attn.hook_z``          layer i, head h,  (L_enc, H)
                                                                    all positions
``resid_cross``         ``decoder.layers.{i}.hook_resid_cross``     layer i, t        (L_dec, T)
``cross_out``           ``decoder.layers.{i}.cross_attn.hook_out``  layer i, t        (L_dec, T)
``cross_heads``         ``decoder.layers.{i}.cross_attn.hook_z``    layer i, cross-   (L_dec, H)
                                                                    attention head h,
                                                                    all positions
======================  ==========================================  ================  ==========

An encoder patch changes the memory that every decoder layer's cross-attention reads: each
patched row runs the whole model, encoder included, with its own patch, and no cache is passed,
so each row's cross-attention keys and values are computed from that row's own encoder output.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lmlab.errors import LmlabError
from lmlab.hooks import ActivationCache, hook_names, run_with_cache, run_with_hooks

# what -> the hook name of layer i; "heads" patches one head of hook_z at every position
POINTS: dict[str, str] = {
    "resid_pre": "layers.{i}.hook_resid_pre",
    "resid_mid": "layers.{i}.hook_resid_mid",
    "resid_post": "layers.{i}.hook_resid_post",
    "attn_out": "layers.{i}.attn.hook_out",
    "ffn_out": "layers.{i}.ffn.hook_out",
    "heads": "layers.{i}.attn.hook_z",
}
DEFAULT_WHAT = ("resid_pre", "attn_out", "ffn_out", "heads")
# an encoder-decoder's points: the encoder's under "encoder.", the decoder's under the
# decoder-only names, plus its cross-attention
ENCODER_DECODER_POINTS: dict[str, str] = {
    **{f"encoder.{w}": f"encoder.{name}" for w, name in POINTS.items()},
    "resid_pre": "decoder.layers.{i}.hook_resid_pre",
    "resid_mid": "decoder.layers.{i}.hook_resid_mid",
    "resid_cross": "decoder.layers.{i}.hook_resid_cross",
    "resid_post": "decoder.layers.{i}.hook_resid_post",
    "attn_out": "decoder.layers.{i}.attn.hook_out",
    "cross_out": "decoder.layers.{i}.cross_attn.hook_out",
    "ffn_out": "decoder.layers.{i}.ffn.hook_out",
    "heads": "decoder.layers.{i}.attn.hook_z",
    "cross_heads": "decoder.layers.{i}.cross_attn.hook_z",
}
ENCODER_DECODER_DEFAULT_WHAT = ("encoder.resid_pre", "resid_pre", "heads", "cross_heads")
BATCH = 32  # patched runs per batched forward at most
LOGIT_BUDGET = 1 << 26  # and at most this many logits (R T V floats) per batched forward


def _at(logits: torch.Tensor, position: int) -> torch.Tensor:
    """logits (B, T, V) or (T, V) -> (B, V) float64 at ``position`` (negative from the end)."""
    if logits.dim() == 2:
        logits = logits[None]
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, T, V) or (T, V), got {tuple(logits.shape)}")
    t = logits.shape[1]
    if not -t <= position < t:
        raise LmlabError(f"position {position} is outside the {tokens_phrase(t)}")
    return logits[:, position].double()


def logit_diff(logits: torch.Tensor, target: int, versus: int, position: int = -1) -> torch.Tensor:
    """logits (B, T, V) or (T, V) float -> (B,) float64: ``logits[:, position, target] -
    logits[:, position, versus]``, in logits (the IOI metric of Wang et al. 2022). Invariant to
    a constant added to every logit, so it needs no softmax over V."""
    x = _at(logits, position)
    return x[:, target] - x[:, versus]


def target_log_prob(logits: torch.Tensor, target: int, position: int = -1) -> torch.Tensor:
    """logits (B, T, V) or (T, V) float -> (B,) float64: ``log_softmax(logits[:, position])
    [:, target]``, in nats (the metric when there is no contrast token)."""
    return torch.log_softmax(_at(logits, position), -1)[:, target]


def metric(
    logits: torch.Tensor, target: int, versus: int | None = None, position: int = -1
) -> torch.Tensor:
    """(B,) float64: :func:`logit_diff` when ``versus`` is given, else :func:`target_log_prob`."""
    if versus is None:
        return target_log_prob(logits, target, position)
    return logit_diff(logits, target, versus, position)


HEADS_FIRST = ("hook_q", "hook_k", "hook_v", "hook_z", "hook_scores", "hook_pattern",
               "hook_scores_2", "hook_pattern_2")  # fmt: skip


def _heads_first(name: str) -> bool:
    """Whether the point's tensor is (B, H or K, T, ...): tokens on axis 2, not 1."""
    return name.rsplit(".", 1)[-1] in HEADS_FIRST


@dataclass(frozen=True)
class Patch:
    """One replacement: the activation at hook ``name`` takes the source run's value at token
    ``position`` (an int, on axis 1 of a (B, T, ...) point, axis 2 of a heads-first (B, H, T,
    ...) attention point, the query axis of scores and patterns; None = every position) or in
    head ``head`` (axis 1 of a heads-first point) at every position."""

    name: str
    position: int | None = None
    head: int | None = None


def _row_hooks(
    rows: Sequence[Sequence[Patch]], source: ActivationCache
) -> dict[str, Callable[[torch.Tensor, str], torch.Tensor]]:
    """One hook per named point: batch row r of the activation takes ``source``'s (batch row 0)
    values at the places ``rows[r]`` names."""
    by_name: dict[str, list[tuple[int, Patch]]] = {}
    for r, patches in enumerate(rows):
        for p in patches:
            if p.position is not None and p.head is not None:
                raise ValueError(f"{p}: give a position or a head, not both")
            by_name.setdefault(p.name, []).append((r, p))

    def make(items: list[tuple[int, Patch]]) -> Callable[[torch.Tensor, str], torch.Tensor]:
        def hook(x: torch.Tensor, name: str) -> torch.Tensor:
            src = source[name][0].to(x.dtype)  # (T, ...) or (H, T, hd)
            x = x.clone()
            for r, p in items:
                if p.head is not None:
                    x[r, p.head] = src[p.head]
                elif p.position is not None and _heads_first(name):
                    x[r, :, p.position] = src[:, p.position]
                elif p.position is not None:
                    x[r, p.position] = src[p.position]
                else:
                    x[r] = src
            return x

        return hook

    return {name: make(items) for name, items in by_name.items()}


def run_patched(
    model: nn.Module,
    ids: torch.Tensor,
    source: ActivationCache,
    rows: Sequence[Sequence[Patch]],
    source_ids: torch.Tensor | None = None,
    **forward_kwargs: Any,
) -> torch.Tensor:
    """Run ``ids`` (T,) or (1, T) int64 once per entry of ``rows``, batched (R = len(rows)
    copies in one forward), row r with the patches ``rows[r]`` taken from ``source`` (a
    :class:`~lmlab.hooks.ActivationCache` of a run on one sequence of the same length, holding
    every named point). ``forward_kwargs`` (e.g. ``attention_mask`` (R, T)) go to the model.
    ``source_ids`` (S,) or (1, S): an encoder-decoder's source; ``ids`` are then its decoder
    input, and each row runs the encoder too (``model(input_ids=, decoder_input_ids=)``, no
    cache, so an encoder patch reaches that row's cross-attention keys and values only).
    Returns the logits (R, T, V). Batched rows equal one-at-a-time runs to float rounding of
    the batched matmuls (bit for bit where the backend's kernels do not depend on the batch;
    MoE layers multiply each expert's routed tokens together, about 1e-6 apart; routing is
    dropless, so rows never compete for an expert).
    Raises LmlabError for a hook name the model lacks or a point that did not run."""
    ids = _one_row(ids, "ids")
    batch = ids.expand(len(rows), -1)
    fns = _row_hooks(rows, source)
    if source_ids is None:
        out = run_with_hooks(model, batch, fns, **forward_kwargs)
    else:
        src = _one_row(source_ids, "source_ids").expand(len(rows), -1)
        out = run_with_hooks(model, None, fns, input_ids=src, decoder_input_ids=batch,
                             **forward_kwargs)  # fmt: skip
    logits: torch.Tensor = out.logits
    return logits


def tokens_phrase(n: int) -> str:
    """``n`` with "token" or "tokens": "1 token", "3 tokens"."""
    return f"{n} token" if n == 1 else f"{n} tokens"


def _same_length(clean: torch.Tensor, corrupted: torch.Tensor, what: str, eg: str = "") -> None:
    """Raise LmlabError unless the (1, T) clean and corrupted ``what`` (prompt, source) have the
    same token length: patching swaps activations position by position."""
    tc, tx = clean.shape[1], corrupted.shape[1]
    if tc != tx:
        raise LmlabError(
            f"the clean {what} is {tokens_phrase(tc)} and the corrupted one {tx}: activation "
            f"patching swaps activations position by position, so give {what}s of the same token "
            f"length (change words for words that are one token each{eg})"
        )


def _one_row(ids: torch.Tensor, what: str) -> torch.Tensor:
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise LmlabError(f"{what} must be one sequence, (T,) or (1, T); got {tuple(ids.shape)}")
    return ids


@dataclass
class PatchResult:
    """What :func:`patch_activations` measured. ``scores[what]`` is a float64 tensor (L, T) for
    the per-position points, (L, H) for ``heads``; ``patched[what]`` the patched metric itself
    (same shape). ``metric_clean`` / ``metric_corrupt`` are m on the clean and corrupted runs;
    ``metric_name`` is ``"logit_diff"`` (logits) or ``"log_prob"`` (nats). An encoder-decoder's
    maps: (L_enc, S) or (L_enc, H) for ``encoder.*``, the decoder's (L_dec, T) or (L_dec, H);
    ``n_source`` is S (None for other kinds)."""

    metric_name: str
    metric_clean: float
    metric_corrupt: float
    target: int
    versus: int | None
    position: int
    n_tokens: int
    scores: dict[str, torch.Tensor] = field(default_factory=dict)
    patched: dict[str, torch.Tensor] = field(default_factory=dict)
    n_source: int | None = None  # an encoder-decoder's source tokens S (n_tokens: decoder T)

    def top(self, n: int = 10, what: str | None = None) -> list[dict[str, Any]]:
        """The ``n`` patches with the largest |score| (of the map ``what``; None: of all maps):
        dicts of what, layer, position or head, score and the patched metric."""
        cells = []
        for w, s in self.scores.items():
            if what is not None and w != what:
                continue
            axis = "head" if w.endswith("heads") else "position"
            for (layer, j), v in zip(
                ((a, b) for a in range(s.shape[0]) for b in range(s.shape[1])),
                s.flatten().tolist(),
                strict=True,
            ):
                cells.append(
                    {
                        "what": w,
                        "layer": layer,
                        axis: j,
                        "score": v,
                        "patched": float(self.patched[w][layer, j]),
                    }
                )
        cells.sort(key=lambda c: -abs(c["score"]))
        return cells[:n]

    def as_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric_name,
            "metric_clean": self.metric_clean,
            "metric_corrupt": self.metric_corrupt,
            "target": self.target,
            "versus": self.versus,
            "position": self.position,
            "n_tokens": self.n_tokens,
            **({} if self.n_source is None else {"n_source": self.n_source}),
            "scores": {k: v.tolist() for k, v in self.scores.items()},
            "patched": {k: v.tolist() for k, v in self.patched.items()},
        }


def _layers(names: set[str], prefix: str = "") -> int:
    """How many ``{prefix}layers.{i}.hook_resid_pre`` points (layers) the model has."""
    n = 0
    while f"{prefix}layers.{n}.hook_resid_pre" in names:
        n += 1
    if n == 0:
        raise LmlabError(f"the model has no {prefix}layers.{{i}}.hook_resid_pre points")
    return n


def _stack(template: str) -> str:
    """The stack prefix of a hook template: ``""``, ``"encoder."`` or ``"decoder."``."""
    return template[: template.index("layers.")]


def _jobs(
    what: Sequence[str],
    points: dict[str, str],
    n_layers: dict[str, int],
    n_tokens: dict[str, int],
    clean: ActivationCache,
) -> list[tuple[str, int, list[Patch]]]:
    """(what, layer, the patches of that layer's row of the map), in map order. ``n_layers`` /
    ``n_tokens``: per stack prefix, its layers and the tokens its positions run over."""
    jobs = []
    for w in what:
        stack = _stack(points[w])
        for i in range(n_layers[stack]):
            name = points[w].format(i=i)
            if w.endswith("heads"):
                heads = clean[name].shape[1]
                jobs.append((w, i, [Patch(name, head=h) for h in range(heads)]))
            else:
                jobs.append((w, i, [Patch(name, position=t) for t in range(n_tokens[stack])]))
    return jobs


def patch_activations(
    model: nn.Module,
    clean_ids: torch.Tensor,
    corrupted_ids: torch.Tensor,
    target: int,
    versus: int | None = None,
    what: Sequence[str] | None = None,
    key_mask: torch.Tensor | None = None,
    progress: Callable[[int, int], None] | None = None,
    position: int = -1,
    batch_size: int = BATCH,
    clean_source: torch.Tensor | None = None,
    corrupted_source: torch.Tensor | None = None,
) -> PatchResult:
    """Patch each clean activation into the corrupted run, one at a time, and score it.

    clean_ids, corrupted_ids: (T,) or (1, T) int64, the same T. ``target`` / ``versus``: token
    ids; the metric at ``position`` (default the last token) is ``logit_diff(target, versus)``,
    or with ``versus`` None the target's log-probability (nats). ``what``: keys of
    :data:`POINTS` (default resid_pre, attn_out, ffn_out, heads). ``key_mask`` (T,) or (1, T),
    1 = real token, 0 = padding, shared by both prompts: passed as ``attention_mask`` with
    positions counted over real tokens (left padding); padding positions are patched too (a
    padding key is never attended to, so that changes nothing but the padding row itself).

    An encoder-decoder needs ``clean_source`` / ``corrupted_source`` (S,) or (1, S) int64, the
    same S: the encoder inputs; ``clean_ids`` / ``corrupted_ids`` are then the decoder inputs
    (as the model was trained: the decoder start token first), the metric is read from the
    decoder's logits, and ``what`` takes keys of :data:`ENCODER_DECODER_POINTS` (default
    encoder.resid_pre, resid_pre, heads, cross_heads). No ``key_mask`` (no padding) there.

    The clean run is cached once (only the points patched); the corrupted run gives m_corrupt;
    then every (layer, position) and (layer, head) patch is one row of a batched forward of up
    to ``batch_size`` rows and :data:`LOGIT_BUDGET` logits (one map row per call at most, so
    ``progress(done, total)``, counted in patched runs, is called at least once per layer of
    each ``what``). The model runs in eval mode under ``torch.no_grad``; its mode is restored.
    Patched runs: L T per position map, L H for ``heads``, plus the clean and corrupted runs.

    Returns a :class:`PatchResult`. Raises LmlabError for prompts (or sources) of different
    lengths, more than one sequence, an unknown ``what``, a token id outside the vocabulary,
    m_clean == m_corrupt (the score is undefined: the corruption changes nothing the metric
    sees), a non-finite metric, sources given to a model without an encoder (or none to an
    encoder-decoder), or a model kind lacking a point (e.g. ``resid_mid`` of a hyper block).
    """
    clean_ids, corrupted_ids = _one_row(clean_ids, "clean"), _one_row(corrupted_ids, "corrupted")
    _same_length(clean_ids, corrupted_ids, "prompt", ", e.g. one name for another")
    tc = clean_ids.shape[1]
    names_all = set(hook_names(model))
    seq2seq = "decoder.layers.0.hook_resid_pre" in names_all
    sources = _sources(seq2seq, clean_source, corrupted_source, key_mask)
    points = ENCODER_DECODER_POINTS if seq2seq else POINTS
    if what is None:
        what = ENCODER_DECODER_DEFAULT_WHAT if seq2seq else DEFAULT_WHAT
    bad = [w for w in what if w not in points]
    if bad or not what:
        raise LmlabError(f"unknown patch target(s) {bad}; choose from {', '.join(points)}")
    if batch_size < 1:
        raise LmlabError(f"batch_size must be >= 1, got {batch_size}")
    stacks = {_stack(points[w]) for w in what}
    n_layers = {p: _layers(names_all, p) for p in stacks}
    n_tokens = {"": tc, "decoder.": tc, "encoder.": sources[0].shape[1] if sources else 0}
    names = [points[w].format(i=i) for w in what for i in range(n_layers[_stack(points[w])])]
    kwargs = _mask_kwargs(key_mask, tc)
    src_clean, src_corrupt = sources if sources else (None, None)

    def inputs(ids: torch.Tensor, src: torch.Tensor | None) -> tuple[Any, dict[str, Any]]:
        """One run's (positional ids, keywords): decoder-only ids, or a source and decoder ids."""
        if src is None:
            return ids, kwargs(1)
        return None, {"input_ids": src, "decoder_input_ids": ids}

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            ids, kw = inputs(clean_ids, src_clean)
            out, clean = run_with_cache(model, ids, names=names, **kw)
            vocab = out.logits.shape[-1]
            for what_id, tok in (("target", target), ("versus", versus)):
                if tok is not None and not 0 <= tok < vocab:
                    raise LmlabError(f"{what_id} token id {tok} is outside the vocabulary "
                                     f"(0..{vocab - 1})")  # fmt: skip
            m_clean = float(metric(out.logits, target, versus, position)[0])
            ids, kw = inputs(corrupted_ids, src_corrupt)
            corrupt_logits = run_with_hooks(model, ids, {}, **kw).logits
            m_corrupt = float(metric(corrupt_logits, target, versus, position)[0])
            if not (math.isfinite(m_clean) and math.isfinite(m_corrupt)):
                raise LmlabError(
                    f"the metric is not finite (clean {m_clean}, corrupted {m_corrupt})"
                )
            if m_clean == m_corrupt:
                raise LmlabError(
                    f"the metric is {m_clean:.6g} on both the clean and the corrupted prompt, so "
                    "the normalised score (patched - corrupt) / (clean - corrupt) is undefined; "
                    "corrupt a token the target depends on, or choose another --target/--versus"
                )
            result = PatchResult(
                "log_prob" if versus is None else "logit_diff",
                m_clean, m_corrupt, target, versus, position, tc,
                n_source=None if src_clean is None else src_clean.shape[1],
            )  # fmt: skip
            jobs = _jobs(what, points, n_layers, n_tokens, clean)
            per_call = max(1, min(batch_size, LOGIT_BUDGET // (tc * vocab)))
            total, done = sum(len(p) for _, _, p in jobs), 0
            rows: dict[str, list[torch.Tensor]] = {w: [] for w in what}
            for w, _, patches in jobs:
                values = []
                for k in range(0, len(patches), per_call):
                    chunk = [[p] for p in patches[k : k + per_call]]
                    extra = kwargs(len(chunk)) if src_corrupt is None else {}
                    logits = run_patched(model, corrupted_ids, clean, chunk, src_corrupt, **extra)
                    values.append(metric(logits, target, versus, position))
                    done += len(chunk)
                    if progress is not None:
                        progress(done, total)
                rows[w].append(torch.cat(values))
    finally:
        model.train(was_training)
    span = m_clean - m_corrupt
    for w in what:
        patched = torch.stack(rows[w]).cpu()
        result.patched[w] = patched
        result.scores[w] = (patched - m_corrupt) / span
    return result


def _sources(
    seq2seq: bool,
    clean: torch.Tensor | None,
    corrupted: torch.Tensor | None,
    key_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The checked (1, S) source pair of an encoder-decoder, None for other kinds. Raises
    LmlabError for sources given to a model without an encoder or missing for one, sources of
    different lengths, or a key_mask with an encoder-decoder."""
    if not seq2seq:
        if clean is not None or corrupted is not None:
            raise LmlabError(
                "clean_source / corrupted_source are an encoder-decoder's encoder inputs; this "
                "model has no encoder (no decoder.layers.{i} / encoder.layers.{i} hook points)"
            )
        return None
    if clean is None or corrupted is None:
        raise LmlabError(
            "an encoder-decoder is patched with clean_source and corrupted_source (the encoder "
            "inputs) next to the decoder inputs; give both (the same ids when only the decoder "
            "input differs)"
        )
    if key_mask is not None:
        raise LmlabError("key_mask (padding) is not supported for an encoder-decoder")
    clean, corrupted = _one_row(clean, "clean_source"), _one_row(corrupted, "corrupted_source")
    _same_length(clean, corrupted, "source")
    return clean, corrupted


def _mask_kwargs(key_mask: torch.Tensor | None, t: int) -> Callable[[int], dict[str, torch.Tensor]]:
    """rows -> the forward keywords for a batch of that many copies of one masked prompt."""
    if key_mask is None:
        return lambda rows: {}
    m = _one_row(key_mask, "key_mask")
    if m.shape[1] != t:
        raise LmlabError(f"key_mask covers {tokens_phrase(m.shape[1])}, the prompts {t}")
    from lmlab.nn.masks import position_ids_from_attention_mask

    m = m.long()
    pos = position_ids_from_attention_mask(m)
    return lambda rows: {"attention_mask": m.expand(rows, -1), "position_ids": pos.expand(rows, -1)}
