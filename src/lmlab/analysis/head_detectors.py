"""Head detectors: score every attention head for four well-known behaviours.

Legend: B batch, H query heads, T query tokens, S key tokens (T = S here: one pass, no cache),
L the length of one random block. Every score is a mean attention weight, so it lies in [0, 1]
(a row's weights sum to at most 1) and reads as "the share of its attention the head puts on
the key the behaviour predicts", averaged over queries and sequences:

- ``previous_token``: query i -> key i - 1, over queries i >= 1 (a previous-token head, the
  first half of the induction circuit; Olsson et al. 2022, "In-context Learning and Induction
  Heads").
- ``induction``: on random tokens repeated twice (x_0 .. x_{L-1} x_0 .. x_{L-1}), query L + j ->
  key j + 1, the token after the previous occurrence of the query's token, over j = 0 .. L-1
  (Olsson et al. 2022's repeated-random-tokens measurement, as TransformerLens runs it).
- ``duplicate_token``: on the same input, query L + j -> key j, the earlier copy of the same
  token (the duplicate-token heads of Wang et al. 2022, "Interpretability in the Wild", IOI).
- ``sink``: query i -> key 0, over queries i >= 1 (the "attention sink" of Xiao et al. 2023,
  "Efficient Streaming Language Models with Attention Sinks"). For a pattern with an explicit
  learned sink column (attention kind ``sink``, gpt-oss), it is that column's share instead: the
  attention the head gives to "nothing" (:func:`sink_scores` with ``sink_column=True``).

TransformerLens's ``detect_head`` scores a head as sum(A * P) / sum(A) over the whole map for a
0/1 detection pattern P; lmlab averages the one predicted weight over the query rows the
behaviour defines. Restricted to those rows (each summing to 1 with one predicted key, which
the random blocks guarantee by holding each token once) the two are the same number; the
whole-map ratio also counts rows with no predicted key (row 0; the first copy, for induction
and duplicate-token), which scales it down (about by half for induction). The random tokens
are drawn without replacement within a block (so "the previous occurrence" is one position)
from the vocabulary less the special ids, with a seeded ``torch.Generator``.

A head is flagged a kind when its score is >= its threshold (:data:`THRESHOLDS`, 0.4 each): 40%
of its attention on one predicted key, where a uniform causal head puts 1 / (i + 1) on it
(mean 0.06 at T = 64, 0.04 at T = 100), and where the detector literature draws its line
(induction-score recipes built on TransformerLens commonly flag heads above 0.4).

Model kinds: a decoder as above. An encoder (bidirectional) is scored the same way: the
scores are still defined (its query L + j may also attend forward), but induction is a causal
notion (predicting the next token from the previous occurrence), so an encoder's induction
score is a "look at the token after my earlier copy" score only. An encoder-decoder: its
decoder's self-attention (``decoder.layers.{i}.attn.hook_pattern``), fed the same repeated
tokens as decoder input and as the source. Attention kinds: every kind with a ``hook_pattern``;
``differential`` gives two maps per differential head (``hook_pattern``, ``hook_pattern_2``),
reported as H heads the way its attention weights are numbered (heads 0 .. H/2-1 the first
maps, H/2 .. H-1 the second); ``nsa`` has no single attention map and is refused by name.
``sigmoid`` rows need not sum to 1 (each weight is still in [0, 1]).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmlab.errors import LmlabError

DETECTORS = ("previous_token", "induction", "duplicate_token", "sink")
THRESHOLDS: dict[str, float] = dict.fromkeys(DETECTORS, 0.4)
DEFAULT_SEQ_LEN = 50  # tokens per random block (TransformerLens's induction tutorial uses 50)
DEFAULT_BATCH = 4
# Elements of the largest tensor one pass of the repeated tokens may need (the logits
# B x 2L x V, or one layer's scores B x H x 2L x 2L): 2^31 float32 are 8 GiB.
MAX_PASS_ELEMENTS = 1 << 31


# ------------------------------------------------------------------ scores of one layer's map


def _check_map(pattern: torch.Tensor, what: str) -> tuple[int, int]:
    if pattern.dim() != 4 or pattern.shape[-2] < 2:
        raise ValueError(f"{what}: pattern must be (B, H, T, S) with T >= 2, got "
                         f"{tuple(pattern.shape)}")  # fmt: skip
    return pattern.shape[-2], pattern.shape[-1]


def _mean_at(pattern: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Mean over B and the (q, k) pairs of pattern[b, h, q, k]: (H,) float64."""
    picked = pattern[:, :, q.to(pattern.device), k.to(pattern.device)]  # (B, H, n)
    return picked.detach().to("cpu", torch.float64).mean(dim=(0, 2))


def previous_token_scores(pattern: torch.Tensor) -> torch.Tensor:
    """pattern (B, H, T, S) attention weights (query i at position i, key j at position j;
    S >= T) -> (H,) float64: mean of pattern[b, h, i, i - 1] over b and queries i = 1 .. T-1.
    Raises ValueError for a pattern that is not 4-D with T >= 2."""
    t, _ = _check_map(pattern, "previous_token_scores")
    q = torch.arange(1, t)
    return _mean_at(pattern, q, q - 1)


def sink_scores(pattern: torch.Tensor, sink_column: bool = False) -> torch.Tensor:
    """pattern (B, H, T, S) -> (H,) float64: mean of pattern[b, h, i, 0] over b and queries
    i = 1 .. T-1 (the first token's share). ``sink_column=True``: the last column is a learned
    sink (attention kind ``sink``: S = T + 1), and the score is its share, pattern[b, h, i, -1],
    over the same queries. Raises ValueError for a pattern that is not 4-D with T >= 2."""
    t, s = _check_map(pattern, "sink_scores")
    q = torch.arange(1, t)
    return _mean_at(pattern, q, torch.full_like(q, s - 1 if sink_column else 0))


def _repeat_rows(pattern: torch.Tensor, block: int, what: str) -> torch.Tensor:
    t, s = _check_map(pattern, what)
    if block < 1 or t < 2 * block or s < 2 * block:
        raise ValueError(f"{what}: a block of {block} repeated twice needs T, S >= "
                         f"{2 * block}, got {tuple(pattern.shape)}")  # fmt: skip
    return torch.arange(block, 2 * block)  # the second copy's positions L + j


def induction_pattern_scores(pattern: torch.Tensor, block: int) -> torch.Tensor:
    """pattern (B, H, T, S) on tokens whose positions block .. 2 block - 1 repeat positions
    0 .. block - 1 -> (H,) float64: mean of pattern[b, h, L + j, j + 1] over b and
    j = 0 .. L-1 (L = ``block``): the token after the previous occurrence. Raises ValueError
    when T or S < 2 L."""
    q = _repeat_rows(pattern, block, "induction_pattern_scores")
    return _mean_at(pattern, q, q - block + 1)


def duplicate_token_pattern_scores(pattern: torch.Tensor, block: int) -> torch.Tensor:
    """As :func:`induction_pattern_scores`, key j instead of j + 1: mean of
    pattern[b, h, L + j, j], the earlier copy of the same token."""
    q = _repeat_rows(pattern, block, "duplicate_token_pattern_scores")
    return _mean_at(pattern, q, q - block)


# ------------------------------------------------------------------ the model


@dataclass
class HeadScore:
    """One head's four scores (each in [0, 1], see the module docstring), 0-based layer and
    head, and the kinds whose threshold it reaches. ``text_previous_token`` / ``text_sink``:
    the same two scores on a given text (None when none was given)."""

    layer: int
    head: int
    previous_token: float
    induction: float
    duplicate_token: float
    sink: float
    kinds: list[str]
    text_previous_token: float | None = None
    text_sink: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The JSON record: layer, head, the four scores, kinds (text scores only if set)."""
        d: dict[str, Any] = {
            "layer": self.layer,
            "head": self.head,
            **{k: getattr(self, k) for k in DETECTORS},
            "kinds": list(self.kinds),
        }
        if self.text_previous_token is not None:
            d["text_previous_token"] = self.text_previous_token
            d["text_sink"] = self.text_sink
        return d


_LAYER = re.compile(r"(?:decoder\.)?layers\.(\d+)\.hook_resid_pre")


def _pattern_names(model: nn.Module) -> tuple[str, list[list[str]]]:
    """(prefix, per layer the hook names whose maps make its heads). Raises LmlabError for a
    model whose layers have no attention pattern (nsa), naming the kind."""
    from lmlab.hooks import hook_names

    cfg = getattr(model, "cfg", None)
    kind = getattr(cfg, "kind", "decoder")
    prefix = "decoder." if kind == "encoder_decoder" else ""
    names = set(hook_names(model))
    layers = sorted({int(m.group(1)) for n in names if (m := _LAYER.fullmatch(n))
                     and n.startswith(prefix)})  # fmt: skip
    if not layers:
        raise LmlabError("the model has no hooked layers (lmlab.hooks.hook_names lists none)")
    out = []
    for i in layers:
        first, second = (
            f"{prefix}layers.{i}.attn.hook_pattern",
            f"{prefix}layers.{i}.attn.hook_pattern_2",
        )
        if first not in names:
            att = getattr(getattr(cfg, "attention", None), "kind", "?")
            raise LmlabError(
                f"model.attention.kind={att} has no attention pattern in layer {i} ({first}: "
                "no single (B, H, T, S) map, e.g. nsa's three branches), so its heads cannot "
                "be scored"
            )
        out.append([first, second] if second in names else [first])
    return prefix, out


def _layer_scores(
    pattern: torch.Tensor, block: int | None, sink_column: bool
) -> dict[str, torch.Tensor]:
    """One map's scores (detector -> (H,) float64); the sink column, if any, is split off
    first so the token scores see the S real keys."""
    real = pattern[..., :-1] if sink_column else pattern
    out = {
        "previous_token": previous_token_scores(real),
        "sink": sink_scores(pattern, sink_column),
    }
    if block is not None:
        out["induction"] = induction_pattern_scores(real, block)
        out["duplicate_token"] = duplicate_token_pattern_scores(real, block)
    return out


def pattern_scores(
    model: nn.Module, ids: torch.Tensor, block: int | None = None
) -> list[dict[str, torch.Tensor]]:
    """Run ``model`` on ``ids`` (B, T) int64 (a decoder's or encoder's input; an
    encoder-decoder's decoder input, with ``ids`` as its source too) and score every layer's
    heads from its ``hook_pattern`` (each reduced as it is computed: memory is one layer's map):
    per layer a dict detector -> (H,) float64. ``block``: the repeat length L for induction and
    duplicate-token (None: only previous-token and sink). Raises LmlabError for a kind with no
    pattern (nsa)."""
    from lmlab.hooks import run_with_hooks

    prefix, groups = _pattern_names(model)
    found: dict[str, dict[str, torch.Tensor]] = {}

    def record(p: torch.Tensor, name: str) -> None:
        found[name] = _layer_scores(p, block, p.shape[-1] == p.shape[-2] + 1)

    fns = [(name, record) for group in groups for name in group]
    kwargs = {"decoder_input_ids": ids} if prefix else {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            run_with_hooks(model, ids, fns, **kwargs)
    finally:
        model.train(was_training)
    return [
        {k: torch.cat([found[n][k] for n in group]) for k in found[group[0]]} for group in groups
    ]


def repeated_random_tokens(
    vocab_size: int,
    seq_len: int,
    batch: int,
    seed: int = 0,
    avoid: Collection[int] = (),
) -> torch.Tensor:
    """(batch, 2 seq_len) int64: per row, ``seq_len`` distinct tokens drawn uniformly without
    replacement from 0 .. vocab_size-1 less ``avoid`` (special ids), then the same again.
    Seeded by ``seed`` (a CPU ``torch.Generator``). Raises LmlabError when fewer than
    ``seq_len`` tokens are left to draw."""
    allowed = torch.tensor(sorted(set(range(vocab_size)) - set(avoid)), dtype=torch.long)
    if len(allowed) < seq_len:
        raise LmlabError(
            f"--seq-len {seq_len} needs {seq_len} distinct tokens per block, but the vocabulary "
            f"has {len(allowed)} non-special tokens; give a shorter --seq-len"
        )
    g = torch.Generator().manual_seed(seed)
    rows = [allowed[torch.randperm(len(allowed), generator=g)[:seq_len]] for _ in range(batch)]
    first = torch.stack(rows)  # (batch, seq_len)
    return torch.cat([first, first], dim=1)


def repeated_token_scores(
    model: nn.Module,
    detector: str,
    seq_len: int | None = None,
    batch: int = DEFAULT_BATCH,
    seed: int = 0,
    avoid: Collection[int] = (),
) -> torch.Tensor:
    """One detector's scores of every head, (n_layers, H) float64, on the repeated random
    tokens of :func:`detect_heads` (same arguments and refusals)."""
    scores = detect_heads(model, seq_len, batch, seed, avoid=avoid)
    n_heads = max(s.head for s in scores) + 1
    return torch.tensor([getattr(s, detector) for s in scores], dtype=torch.float64).view(
        -1, n_heads
    )


def induction_scores(model: nn.Module, **kwargs: Any) -> torch.Tensor:
    """(n_layers, H) float64: mean attention from position L + j to key j + 1 on random tokens
    repeated twice (keywords: seq_len, batch, seed, avoid, as :func:`detect_heads`)."""
    return repeated_token_scores(model, "induction", **kwargs)


def duplicate_token_scores(model: nn.Module, **kwargs: Any) -> torch.Tensor:
    """(n_layers, H) float64: mean attention from position L + j to key j (the earlier copy)
    on the same input as :func:`induction_scores`."""
    return repeated_token_scores(model, "duplicate_token", **kwargs)


def _model_specials(model: nn.Module) -> set[int]:
    """The special ids a model's config names (encoder-decoder pad / start / end)."""
    s2s = getattr(getattr(model, "cfg", None), "seq2seq", None)
    ids = [getattr(s2s, f, None) for f in ("pad_token_id", "decoder_start_token_id",
                                          "eos_token_id")]  # fmt: skip
    return {i for i in ids if isinstance(i, int)}


def _check_args(model: nn.Module, seq_len: int, batch: int, seed: int) -> int:
    cfg = getattr(model, "cfg", None)
    ctx = getattr(cfg, "max_seq_len", None)
    if not isinstance(ctx, int):
        raise LmlabError("the model has no lmlab ModelConfig (model.cfg.max_seq_len)")
    if not (isinstance(seq_len, int) and seq_len >= 2):
        raise LmlabError(f"--seq-len must be >= 2 (tokens per repeated block), got {seq_len}")
    if 2 * seq_len > ctx:
        raise LmlabError(
            f"--seq-len {seq_len} repeated twice is {2 * seq_len} tokens, more than the model's "
            f"context of {ctx} (model.max_seq_len); give --seq-len <= {ctx // 2}"
        )
    if not (isinstance(batch, int) and batch >= 1):
        raise LmlabError(f"--batch must be >= 1, got {batch}")
    if not (isinstance(seed, int) and 0 <= seed < 2**63):
        raise LmlabError(f"--seed must be in [0, 2^63), got {seed}")
    tokens = batch * 2 * seq_len
    vocab = int(getattr(cfg, "vocab_size", None) or 1)
    n_heads = int(getattr(getattr(cfg, "attention", None), "n_heads", 1) or 1)
    largest = max(tokens * vocab, batch * n_heads * (2 * seq_len) ** 2)
    if largest > MAX_PASS_ELEMENTS:
        raise LmlabError(
            f"--batch {batch} x 2 --seq-len {seq_len} = {tokens:,} tokens in one pass needs a "
            f"tensor of {largest:,} elements (logits {tokens:,} x {vocab:,} vocabulary, or "
            f"{n_heads} heads' {2 * seq_len} x {2 * seq_len} attention scores), more than "
            f"{MAX_PASS_ELEMENTS:,} ({4 * MAX_PASS_ELEMENTS >> 30} GiB of float32); give a "
            "smaller --batch or --seq-len"
        )
    return ctx


def _check_thresholds(thresholds: Mapping[str, float] | None) -> dict[str, float]:
    t = dict(THRESHOLDS)
    for k, v in (thresholds or {}).items():
        if k not in THRESHOLDS:
            raise LmlabError(f"unknown detector {k!r} in thresholds; known: {', '.join(DETECTORS)}")
        if not 0.0 <= float(v) <= 1.0:
            raise LmlabError(f"threshold {k}={v} must be in [0, 1]")
        t[k] = float(v)
    return t


def default_seq_len(model: nn.Module) -> int:
    """:data:`DEFAULT_SEQ_LEN`, or half the model's context if that is shorter."""
    ctx = getattr(getattr(model, "cfg", None), "max_seq_len", 2 * DEFAULT_SEQ_LEN)
    return max(2, min(DEFAULT_SEQ_LEN, int(ctx) // 2))


def detect_heads(
    model: nn.Module,
    seq_len: int | None = None,
    batch: int = DEFAULT_BATCH,
    seed: int = 0,
    thresholds: Mapping[str, float] | None = None,
    avoid: Collection[int] = (),
    text_ids: list[int] | None = None,
) -> list[HeadScore]:
    """Score every head of ``model`` (an lmlab decoder, encoder or encoder-decoder; see the
    module docstring) on ``batch`` sequences of ``seq_len`` random tokens repeated twice
    (:func:`repeated_random_tokens`, seeded by ``seed``, never one of ``avoid`` nor a special
    id of the model's config). ``seq_len`` None: :func:`default_seq_len`. ``thresholds``:
    detector -> score at or above which a head is flagged that kind (default
    :data:`THRESHOLDS`). ``text_ids``: also score previous-token and sink on this one sequence
    of token ids (HeadScore.text_*). Returns one HeadScore per (layer, head), layer-major.

    Raises LmlabError for seq_len < 2 or 2 seq_len > model.max_seq_len, batch < 1, a seed
    outside [0, 2^63), too few non-special tokens, a bad threshold, a text of fewer than 2 or
    more than max_seq_len tokens, or an attention kind without a pattern (nsa)."""
    seq_len = default_seq_len(model) if seq_len is None else seq_len
    ctx = _check_args(model, seq_len, batch, seed)
    limits = _check_thresholds(thresholds)
    _pattern_names(model)  # refuse nsa before drawing anything
    cfg: Any = getattr(model, "cfg", None)
    device = next(model.parameters()).device
    ids = repeated_random_tokens(
        cfg.vocab_size, seq_len, batch, seed, set(avoid) | _model_specials(model)
    )
    layers = pattern_scores(model, ids.to(device), block=seq_len)
    text_layers = None
    if text_ids is not None:
        if not 2 <= len(text_ids) <= ctx:
            raise LmlabError(
                f"--text is {len(text_ids)} tokens; scoring it needs 2 .. {ctx} (model.max_seq_len)"
            )
        x = torch.tensor([text_ids], dtype=torch.long, device=device)
        text_layers = pattern_scores(model, x, block=None)
    out = []
    for li, scores in enumerate(layers):
        for h in range(len(scores["sink"])):
            values = {k: float(scores[k][h]) for k in DETECTORS}
            out.append(
                HeadScore(
                    layer=li,
                    head=h,
                    **values,
                    kinds=[k for k in DETECTORS if values[k] >= limits[k]],
                    text_previous_token=None
                    if text_layers is None
                    else float(text_layers[li]["previous_token"][h]),
                    text_sink=None if text_layers is None else float(text_layers[li]["sink"][h]),
                )
            )
    return out


SHOWN = 12  # flagged heads a summary line names (the table has them all)


def format_scores(scores: list[HeadScore], thresholds: Mapping[str, float] | None = None) -> str:
    """A table (one row per head: layer, head, the four scores, the text scores if any, the
    kinds), then per kind the flagged heads by score, e.g. ``induction heads (>= 0.4): L3H2
    0.81, L4H0 0.55`` (the first :data:`SHOWN`, then how many more)."""
    limits = _check_thresholds(thresholds)
    text = any(s.text_previous_token is not None for s in scores)
    head = f"{'layer':>5} {'head':>4} {'prev':>6} {'induct':>6} {'dup':>6} {'sink':>6}"
    head += f" {'t.prev':>6} {'t.sink':>6}" if text else ""
    lines = [head + "  kinds"]
    for s in scores:
        row = f"{s.layer:>5} {s.head:>4} {s.previous_token:6.3f} {s.induction:6.3f} "
        row += f"{s.duplicate_token:6.3f} {s.sink:6.3f}"
        if text:
            row += f" {s.text_previous_token or 0.0:6.3f} {s.text_sink or 0.0:6.3f}"
        lines.append(row + "  " + ",".join(s.kinds))
    lines.append("")
    for k in DETECTORS:
        hits = sorted((s for s in scores if k in s.kinds), key=lambda s: -getattr(s, k))
        found = ", ".join(f"L{s.layer}H{s.head} {getattr(s, k):.2f}" for s in hits[:SHOWN])
        found = (found or "none") + (
            f", ... ({len(hits) - SHOWN} more)" if len(hits) > SHOWN else ""
        )
        lines.append(f"{k.replace('_', '-')} heads (>= {limits[k]:g}): {found}")
    return "\n".join(lines)
