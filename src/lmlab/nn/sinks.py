"""Attention sinks: a learned sink logit per head (gpt-oss), and the StreamingLLM cache.

Legend: B batch, T query tokens, S key tokens (cache + T), H heads, K kv heads, hd head_dim.
Masks are bool with True = may attend.

- attention kind ``sink`` (:class:`SinkAttention`): softmax attention whose denominator holds
  one more term, exp(s_h), a learned logit per head with no value (OpenAI 2025, gpt-oss; the
  "off-by-one" softmax of Miller 2023 is s_h = 0): p_j = exp(a_j) / (exp(s_h) + sum_k exp(a_k)),
  out = sum_j p_j v_j. A head can so attend to "nothing". The parameter is ``sinks`` (H,), as in
  Hugging Face ``GptOssAttention``, so weights map by name.
- mask kind ``streaming`` (:func:`streaming_mask`, Xiao et al. 2023, "Efficient Streaming
  Language Models with Attention Sinks"): a query sees the first ``sink_tokens`` tokens and
  the last ``window - sink_tokens`` tokens up to itself; its cache
  (:class:`StreamingKVCache`) keeps just those, so memory is bounded by ``window`` tokens.

Positions (a choice, see docs/attention-designs.md): **absolute**, lmlab's convention everywhere.
Keys are cached after RoPE at their position in the stream, so cached decoding equals the full
pass under the dense mask (the contract's kv_cache check). StreamingLLM instead re-numbers the
cached tokens 0..window-1 at every step (re-rotating the keys), which keeps every RoPE distance
inside the trained range but equals no full pass; that is not done here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from lmlab.errors import ConfigError
from lmlab.nn.attention import ATTENTION, CachedKeys, SoftmaxAttention
from lmlab.nn.kv_cache import LayerKVCache, SlidingWindowKVCache, _nbytes
from lmlab.nn.masks import MASKS, MaskFn, _query_key_positions

if TYPE_CHECKING:
    from lmlab.config import ModelConfig

DEFAULT_SINK_TOKENS = 4  # StreamingLLM's choice (Xiao et al. 2023, sec. 3.2)


# ----------------------------------------------------------------------------- sink attention


def with_sink_column(mask_fn: MaskFn | None) -> MaskFn:
    """A mask function over S + 1 keys: ``mask_fn``'s (T, S) (or (B, 1, T, S)) mask over the
    real keys, then one always-visible column for the sink (True = may attend)."""

    def fn(t: int, s: int, device: torch.device | str | None = None, window: int | None = None):
        if mask_fn is None:
            return torch.ones(t, s, dtype=torch.bool, device=device)
        m = mask_fn(t, s - 1, device, window)
        return torch.cat([m, m.new_ones(*m.shape[:-1], 1)], dim=-1)

    return fn


@ATTENTION.register("sink")
class SinkAttention(SoftmaxAttention):
    """Softmax attention with a learned per-head sink logit in the denominator (OpenAI 2025,
    gpt-oss; Hugging Face ``GptOssAttention.sinks``); any mask, GQA, padding, both backends.

    Each head h gets one extra score column holding ``sinks[h]``; the softmax runs over the keys
    and that column, which is then dropped, so a row's weights sum to 1 - p_sink <= 1. On both
    backends the sink is folded in as an extra key with a zero value whose score is set by an
    additive bias, so sdpa and math compute the same function (a query with no visible key sees
    only the sink and outputs 0). ``hook_pattern`` sees (B, H, T, S + 1), the sink's column
    last; the model's attention map (``need_weights``) is (B, H, T, S), the sink column dropped.
    The cache is :class:`SoftmaxAttention`'s (the sink is a parameter, not a token).
    """

    examples: tuple[dict, ...] = (
        {},
        {"attention": {"n_kv_heads": 2}},
        {"attention": {"n_kv_heads": 1, "backend": "math"}},
        {"attention": {"mask": "sliding_window", "window": 4}},
        {"attention": {"mask": "streaming", "window": 6, "sink_tokens": 2}},
    )

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__(cfg, layer_idx)
        self.sinks = nn.Parameter(torch.zeros(self.n_heads))  # (H,) logits, exp(0) = 1 at init

    def attend(self, q, k, v, mask_fn, key_mask, bias, hooks=None):
        """As :meth:`Attention.attend`, with the sink: q (B, H, T, hd), k and v (B, K, S, hd)
        -> (y (B, H, T, hd), weights (B, H, T, S) or None)."""
        b, _, t, _ = q.shape
        s = k.shape[2]
        zero = k.new_zeros(b, self.n_kv_heads, 1, self.head_dim)  # the sink's key and value
        k, v = torch.cat([k, zero], dim=2), torch.cat([v, zero], dim=2)  # (B, K, S + 1, hd)
        # the sink column's score is sinks[h] (its key is 0, so q.k adds nothing)
        past = q.new_zeros(1, self.n_heads, t, s)
        if bias is not None:  # a position bias (H, T, S) or (B, H, T, S)
            past = past + bias.to(q.dtype)
        # the sink column's score is sinks[h] (its key is 0, so q.k adds nothing)
        sink = self.sinks.to(q.dtype).view(1, -1, 1, 1).expand(past.shape[0], -1, t, 1)
        full_bias = torch.cat([past, sink], dim=-1)  # (B or 1, H, T, S + 1)
        if key_mask is not None:
            real = key_mask[:, -s:]
            key_mask = torch.cat([real, real.new_ones(real.shape[0], 1)], dim=1)  # (B, S + 1)
        sunk = with_sink_column(mask_fn)  # the hooked pattern keeps the sink column (S + 1)
        y, w = super().attend(q, k, v, sunk, key_mask, full_bias, hooks)
        return y, None if w is None else w[..., :s]

    def attention_map(self, recorded: list[torch.Tensor]) -> torch.Tensor:
        """The pattern (B, H, T, S + 1) -> the map (B, H, T, S): the sink's column dropped."""
        return recorded[0][..., :-1]

    @classmethod
    def saved_score_elements(cls, cfg: ModelConfig, seq_len: int) -> int:
        """Score elements per query token and layer kept for backward: scores and
        probabilities over S + 1 columns on math, 2 H (T + 1); on sdpa the additive bias
        (B, H, T, S + 1) that carries the sink, H (T + 1) (lmlab.training.memory)."""
        per = cfg.attention.n_heads * (seq_len + 1)
        return 2 * per if cfg.attention.backend == "math" else per


# ----------------------------------------------------------------------------- streaming mask


def streaming_visible(
    q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, sink_tokens: int
) -> torch.Tensor:
    """The StreamingLLM rule on token positions (int tensors broadcasting to (..., T, S)):
    key k is visible to query q iff k <= q and (k < sink_tokens or k > q - (window -
    sink_tokens)): the first ``sink_tokens`` tokens and the last ``window - sink_tokens`` up to
    the query itself (Xiao et al. 2023, fig. 1d). Returns bool, True = may attend."""
    return (k_pos <= q_pos) & ((k_pos < sink_tokens) | (k_pos > q_pos - (window - sink_tokens)))


def streaming_kinds() -> list[str]:
    """The registered attention kinds that declare ``streams = True`` (their forward reads its
    keys through :meth:`~lmlab.nn.attention.Attention.cached_keys`, so the mask's ``keys`` hook
    evicts them), in registry order; plugins included."""
    return [name for name, cls in ATTENTION.items() if getattr(cls, "streams", False)]


def check_streaming(m: ModelConfig) -> None:
    """streaming reads ``window`` in [2, max_seq_len] and ``sink_tokens`` in [0, window - 1]."""
    a = m.attention
    if a.window is None or not 2 <= a.window <= m.max_seq_len:
        raise ConfigError(
            f"model.attention.window must be set in [2, model.max_seq_len={m.max_seq_len}] for "
            f"model.attention.mask=streaming (tokens a query sees: the sinks + the recent "
            f"ones, itself included), got {a.window}"
        )
    sink_tokens = a.sink_tokens  # type: ignore[attr-defined]
    if not 0 <= sink_tokens < a.window:
        raise ConfigError(
            f"model.attention.sink_tokens must be in [0, model.attention.window - 1 = "
            f"{a.window - 1}] (a query must see itself), got {sink_tokens}"
        )
    kind = ATTENTION.get(a.kind, "model.attention.kind")
    if not getattr(kind, "streams", False):
        why = getattr(kind, "streams_refusal", "it does not declare streams = True")
        raise ConfigError(
            f"model.attention.mask=streaming cannot run with model.attention.kind={a.kind}: "
            f"{why}; kinds that stream: {', '.join(streaming_kinds())}"
        )
    from lmlab.nn.position import POSITION, PositionEncoding

    if POSITION.get(m.position.kind).score_bias is not PositionEncoding.score_bias:
        raise ConfigError(
            f"model.attention.mask=streaming cannot be combined with model.position.kind="
            f"{m.position.kind}: its score bias is built over cache slots, not token positions"
        )


@MASKS.register(
    "streaming",
    options=("window",),
    fields={"sink_tokens": (int, DEFAULT_SINK_TOKENS)},
    check=check_streaming,
    examples=(
        {"attention": {"window": 6, "sink_tokens": 2}},
        {"attention": {"window": 4, "sink_tokens": 1, "backend": "math", "n_kv_heads": 1}},
        {"attention": {"window": 3, "sink_tokens": 0}},
    ),
)
def streaming_mask(
    t: int,
    s: int,
    device: torch.device | str | None = None,
    window: int | None = None,
    sink_tokens: int | None = None,
) -> torch.Tensor:
    """StreamingLLM attention (Xiao et al. 2023): a query sees the first ``sink_tokens`` keys
    (the attention sinks) and the last ``window - sink_tokens`` keys up to itself; the dense
    oracle over positions 0..S-1, queries the last T (:func:`streaming_visible`).

    ``model.attention.window`` (tokens a query sees at most, sinks included) and
    ``model.attention.sink_tokens`` (default 4). Its attention reads the rule on each row's token
    positions, so left padding and the bounded :class:`StreamingKVCache` give the same answer.
    Called with the shared signature only (``sink_tokens`` None) it uses the default, 4, at
    most window - 1. Returns a (T, S) bool mask. Raises ValueError unless 0 <= sink_tokens <
    window, or S < T.
    """
    if window is not None and sink_tokens is None:
        sink_tokens = min(DEFAULT_SINK_TOKENS, window - 1)
    if window is None or sink_tokens is None or not 0 <= sink_tokens < window:
        raise ValueError(f"a streaming mask needs 0 <= sink_tokens < window, got {sink_tokens}")
    q, k = _query_key_positions(t, s, device)
    return streaming_visible(q, k, window, sink_tokens)


def _gather_slots(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (B, K', S, d) -> x at slots ``idx`` (B, n) of each row, (B, K', n, d); k and v may
    differ in K' and d (MLA caches its latent and its RoPE key)."""
    return x.gather(2, idx[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


class StreamingKVCache:
    """The StreamingLLM cache: keys and values of the first ``sink_tokens`` tokens of each row
    and of its last ``window - sink_tokens - 1``, each (B, K, <= window - 1, hd), with their
    positions (B, <= window - 1) int64 (-1 = an empty slot or padding).

    After each :meth:`update` a row keeps exactly the keys a later query can see (a query at
    p = last + 1 sees positions < sink_tokens and > p - (window - sink_tokens)), gathered per
    row, so its memory stays at window - 1 tokens however long decoding runs. The order of the
    kept slots does not matter: the mask is built from their positions (:attr:`key_positions`).
    """

    streams = True  # bounded at any length: generation may run past max_seq_len on it

    def __init__(self, window: int, sink_tokens: int) -> None:
        if not 0 <= sink_tokens < window:
            raise ValueError(f"a streaming cache needs 0 <= sink_tokens < window, got {window}")
        self.window, self.sink_tokens = window, sink_tokens
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None  # (B, kept) positions of the kept keys
        self.key_positions: torch.Tensor | None = None  # (B, S) of the keys update returned
        self.seen = 0

    def update(
        self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add keys/values (B, K', T, d) at ``positions`` (B, T) int64 (-1 = padding); return
        the kept and the new ones, (B, K', S, d) (their positions in :attr:`key_positions`),
        then keep per row only what a later query can see, at most ``window - 1`` slots."""
        self.seen += k.shape[2]
        if self.k is not None and self.v is not None and self.pos is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
            positions = torch.cat([self.pos, positions], dim=1)
        self.key_positions = positions
        keep_n = self.window - 1
        if k.shape[2] <= keep_n:
            self.k, self.v, self.pos = k, v, positions
            return k, v
        last = positions.max(dim=1, keepdim=True).values  # (B, 1) the latest real position
        lo = last + 2 - (self.window - self.sink_tokens)  # oldest recent key the next query sees
        keep = (positions >= 0) & ((positions < self.sink_tokens) | (positions >= lo))  # (B, S)
        # per row: its kept slots first (stable, in order), then filler marked empty
        idx = torch.argsort(keep.to(torch.int8), dim=1, descending=True, stable=True)[:, :keep_n]
        self.k, self.v = _gather_slots(k, idx), _gather_slots(v, idx)  # (B, K', window - 1, d)
        self.pos = positions.gather(1, idx).masked_fill(~keep.gather(1, idx), -1)
        return k, v

    @property
    def seq_len(self) -> int:
        """Tokens seen so far (not the number kept)."""
        return self.seen

    def nbytes(self) -> int:
        """Memory held by the kept keys and values, in bytes (the (B, window - 1) int64
        positions are bookkeeping, as a dynamic cache's attention mask is, and not counted)."""
        return _nbytes(self.k, self.v)


@dataclass(frozen=True)
class StreamingMask:
    """``streaming_mask`` bound to one config's ``window`` and ``sink_tokens``: what an
    attention module holds as its ``mask_fn`` (see :meth:`keys`)."""

    window: int
    sink_tokens: int

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> StreamingMask:
        a = cfg.attention
        assert a.window is not None
        return cls(a.window, a.sink_tokens)  # type: ignore[attr-defined]

    def __call__(
        self, t: int, s: int, device: torch.device | str | None = None, window: int | None = None
    ) -> torch.Tensor:
        """The dense (T, S) mask (:func:`streaming_mask`); ``window`` is ignored (bound)."""
        return streaming_mask(t, s, device, self.window, self.sink_tokens)

    def new_cache(self) -> StreamingKVCache:
        return StreamingKVCache(self.window, self.sink_tokens)

    def keys(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None,
        cache: LayerKVCache | SlidingWindowKVCache | StreamingKVCache | None,
    ) -> CachedKeys:
        """New keys/values (B, K', T, d) at ``positions`` (T,) or (B, T) -> CachedKeys(k, v
        (B, K', S, d) with the kept ones, a mask function giving the (B, 1, T, S) rule on each
        row's positions, the (B, S) bool key mask of real keys, their positions (B, S) int64,
        -1 = empty or padding). ``key_mask`` (B, S_total) bool. This is the streaming branch of
        :meth:`~lmlab.nn.attention.Attention.cached_keys`."""
        b, t = k.shape[0], k.shape[2]
        q_pos = positions.expand(b, t) if positions.dim() == 1 else positions  # (B, T)
        real = torch.ones_like(q_pos, dtype=torch.bool) if key_mask is None else key_mask[:, -t:]
        new_pos = q_pos.masked_fill(~real, -1)
        if cache is None:
            k_pos = new_pos
        else:
            if not isinstance(cache, StreamingKVCache):
                raise TypeError(f"a streaming mask needs a StreamingKVCache, got {type(cache)}")
            k, v = cache.update(k, v, new_pos)
            assert cache.key_positions is not None
            k_pos = cache.key_positions  # (B, S)
        valid = k_pos >= 0  # (B, S)
        w, n = self.window, self.sink_tokens
        rule = streaming_visible(q_pos[:, :, None], k_pos[:, None, :], w, n)  # (B, T, S)
        structure = (rule & valid[:, None, :] & real[:, :, None])[:, None]  # (B, 1, T, S)
        return CachedKeys(k, v, lambda *_: structure, valid, k_pos)

    @classmethod
    def cached_tokens(cls, cfg: ModelConfig, context: int) -> int:
        """Tokens the cache holds while decoding token ``context``: at most ``window`` (window
        - 1 kept between steps + the new one)."""
        assert cfg.attention.window is not None
        return min(context, cfg.attention.window)


streaming_mask.bind = StreamingMask.from_config  # type: ignore[attr-defined]
streaming_mask.cached_tokens = StreamingMask.cached_tokens  # type: ignore[attr-defined]
