"""Local + global attention: a sliding window plus global tokens (Longformer, Beltagy et al.
2020, sec. 3.1; BigBird, Zaheer et al. 2020, sec. 2 "global tokens" + "window").

Legend: B batch, T query tokens, S key tokens (cached + new). Masks are bool, True = may attend;
the queries are the last T of the S key positions, as every mask of :mod:`lmlab.nn.masks`.

Query at position p may attend to key at position j (causal: j <= p) when

- j is in p's window, ``p - j < window`` (bidirectional: ``|p - j| < window``), as
  ``sliding_window``; or
- j is global: every later query reads it (Longformer's "symmetric" global attention); or
- p is global: it reads every earlier key (bidirectional: every key).

A position is global when ``p < global_tokens`` (the first g tokens, BigBird-ITC's / Longformer's
[CLS]) or ``global_every > 0`` and ``p % global_every == 0`` (every k-th token, a strided set).
Positions count real tokens: with a key padding mask the first real token is position 0, as
:func:`~lmlab.nn.masks.position_ids_from_attention_mask` numbers a left-padded row, so a padded
row sees exactly what it sees alone.

The KV cache keeps every key (``keeps_all_keys``): a global key is read by all later queries.

Two computations of the same numbers. Dense: the (T, S) mask of :func:`local_global_allowed`
applied to every score by the attention core (the oracle; also the path for ``need_weights``, a
score bias (ALiBi, T5), a non-softmax backend (sigmoid), the bidirectional form, padding that
is not left padding, and S < 8 window). Block-sparse (:func:`local_global_sparse`, which the
attention core runs through the mask's ``sparse_attend`` hook everywhere else, training, prefill,
chunks and decode steps alike): per query the bq + window - 1 keys of its block's band
(bq = min(T, window)), the G global keys, and for the Gq global queries every earlier key,
(B, H, T, bq + window - 1 + G) + (B, H, Gq, S) scores instead of (B, H, T, S). Its declared
costs (``score_flops_per_token``, ``saved_score_elements``) are the sparse ones.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lmlab.errors import ConfigError
from lmlab.nn.masks import MASKS, MaskFn, check_window, position_ids_from_attention_mask

if TYPE_CHECKING:
    from lmlab.config import ModelConfig


def local_global_allowed(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int,
    global_tokens: int = 1,
    global_every: int = 0,
    causal: bool = True,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rule of the module docstring on broadcastable int64 positions: q_pos (..., T, 1),
    k_pos (..., 1, S) -> (..., T, S) bool, True = may attend. ``order``: the causal condition
    when not ``k_pos <= q_pos`` (on indices, for padded rows)."""

    def is_global(p: torch.Tensor) -> torch.Tensor:
        g = p < global_tokens
        return g | (p % global_every == 0) if global_every > 0 else g

    gap = q_pos - k_pos
    near = (gap < window) if causal else (gap.abs() < window)
    allowed = near | is_global(k_pos) | is_global(q_pos)
    if causal:
        allowed = allowed & ((k_pos <= q_pos) if order is None else order)
    return allowed


class LocalGlobalMask:
    """Local + global attention: a sliding window plus global tokens that see and are seen by
    every token (Beltagy et al. 2020, Longformer; Zaheer et al. 2020, BigBird).

    Called as every mask, ``mask(t, s, device=None, window=None) -> (T, S)`` bool over positions
    0 .. S-1 (the queries last), with this instance's ``global_tokens`` (first g positions are
    global, >= 0), ``global_every`` (every k-th position is global; 0: none) and ``causal``.
    ``from_config(cfg)`` is the instance for ``model.attention.global_tokens`` /
    ``global_every``; ``padded(key_mask)`` the mask function of one call over real-token
    positions. Raises ValueError for a ``window`` < 1 or None, or S < T.
    """

    keeps_all_keys = True  # the KV cache holds every key (see the module docstring)

    def __init__(self, global_tokens: int = 1, global_every: int = 0, causal: bool = True) -> None:
        self.global_tokens, self.global_every, self.causal = global_tokens, global_every, causal

    def __repr__(self) -> str:
        return f"LocalGlobalMask({self.global_tokens}, {self.global_every}, {self.causal})"

    def from_config(self, cfg: ModelConfig) -> LocalGlobalMask:
        """The mask of ``cfg.attention``'s global_tokens and global_every (causal)."""
        g, every = (getattr(cfg.attention, n) for n in ("global_tokens", "global_every"))
        return LocalGlobalMask(g, every, self.causal)

    def _rule(self, q: torch.Tensor, k: torch.Tensor, window: int | None, **kw) -> torch.Tensor:
        if window is None or window < 1:
            raise ValueError(f"a local_global mask needs window >= 1, got {window}")
        return local_global_allowed(
            q, k, window, self.global_tokens, self.global_every, self.causal, **kw
        )

    def __call__(
        self, t: int, s: int, device: torch.device | str | None = None, window: int | None = None
    ) -> torch.Tensor:
        if s < t:
            raise ValueError(f"a mask needs at least as many keys as queries, got T={t}, S={s}")
        q = torch.arange(s - t, s, device=device).unsqueeze(1)  # (T, 1)
        k = torch.arange(s, device=device).unsqueeze(0)  # (1, S)
        return self._rule(q, k, window)

    def padded(self, key_mask: torch.Tensor) -> MaskFn:
        """The mask function for key padding mask (B, S') bool, True = real token: positions
        count real tokens (its last S columns are the keys); returns (B, 1, T, S) bool."""

        def fn(
            t: int, s: int, device: torch.device | str | None = None, window: int | None = None
        ) -> torch.Tensor:
            pos = position_ids_from_attention_mask(key_mask[:, -s:].to(device))  # (B, S)
            q, k = pos[:, None, -t:, None], pos[:, None, None, :]  # (B, 1, T, 1), (B, 1, 1, S)
            idx = torch.arange(s, device=device)
            order = idx[None, :] <= idx[s - t :, None]  # (T, S) causal on indices
            return self._rule(q, k, window, order=order)

        fn.sparse_attend = functools.partial(self.sparse_attend, from_key_mask=True)  # type: ignore[attr-defined]
        return fn

    def sparse_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        window: int | None,
        key_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        from_key_mask: bool = False,
    ) -> torch.Tensor | None:
        """The attention core's sparse hook: q (B, H, T, hd), k, v (B, K, S, hd) -> (B, H, T,
        hdv) by :func:`local_global_sparse`, or None where it does not apply (the core then runs
        the dense mask): :func:`sparse_applies` false, or positions taken from a ``key_mask``
        (``padded``) that is not left padding (the band is taken on indices)."""
        s = k.shape[2]
        if window is None or not sparse_applies(s, window, self.causal):
            return None
        if from_key_mask and key_mask is not None:
            real = key_mask[:, -s:]
            if bool((real[:, :-1] & ~real[:, 1:]).any()):  # a real token before a padding one
                return None
        return local_global_sparse(
            q,
            k,
            v,
            scale=scale,
            window=window,
            global_tokens=self.global_tokens,
            global_every=self.global_every,
            key_mask=key_mask,
            from_key_mask=from_key_mask,
            dropout_p=dropout_p,
        )

    # ------------------------------------------------------------------ declared costs
    # Per query token and layer of a training forward over seq_len tokens (S = T), when the
    # sparse path runs (None: it does not, the attention class's dense count applies). Read by
    # SoftmaxAttention's cost methods (lmlab.analysis.costs, lmlab.training.memory).

    def _shape(self, cfg: ModelConfig, seq_len: int) -> tuple[int, int, float] | None:
        """(L band slots per query, G global keys, Gq / T global queries per query) of a
        sequence of ``seq_len`` tokens, or None where :func:`sparse_applies` is false."""
        window = cfg.attention.window
        if window is None or not sparse_applies(seq_len, window, self.causal):
            return None
        g, every = self.from_config(cfg).global_tokens, self.from_config(cfg).global_every
        first = min(g, seq_len)
        n_global = first + (max(0, -(-seq_len // every) - -(-first // every)) if every else 0)
        return min(seq_len, window) + window - 1, n_global, n_global / seq_len

    def score_flops_per_token(self, cfg: ModelConfig, seq_len: int) -> int | None:
        """FLOPs of QK^T and AV the sparse path computes per query: 4 H hd over the L band slots
        (masked ones included) and the G global columns, plus the global rows' 4 H hd S spread
        over the T queries (Gq / T of them read all S = T keys)."""
        shape = self._shape(cfg, seq_len)
        if shape is None:
            return None
        ell, g, rows = shape
        per_key = 4 * cfg.attention.n_heads * cfg.head_dim
        return int(per_key * (ell + g + rows * seq_len))

    def saved_score_elements(self, cfg: ModelConfig, seq_len: int) -> int | None:
        """Elements autograd keeps per query of the sparse path (measured with saved-tensor
        hooks, tests/unit/test_local_global_sparse.py): the padded q (H hd), the band's k and
        v copies (2 K hd L / bq), the weights over L + G (H (L + G)) and their bool mask,
        shared by the heads (a quarter element per slot), with GQA (H > K) the matmul layouts
        of q and of the band weights (H hd + H L), and the global rows' gathered queries,
        weights and mask over S keys ((H hd + (H + 1/4) S) Gq / T)."""
        shape = self._shape(cfg, seq_len)
        if shape is None:
            return None
        ell, g, rows = shape
        h, kv, hd = cfg.attention.n_heads, cfg.n_kv_heads, cfg.head_dim
        bq = min(seq_len, cfg.attention.window or 1)
        band = h * hd + 2 * kv * hd * ell / bq + (h + 0.25) * (ell + g)
        if h > kv:  # the query heads of a kv head are regrouped for the batched matmuls
            band += h * hd + h * ell
        return int(band + ((h + 0.25) * seq_len + h * hd) * rows)


def check_local_global(m: ModelConfig) -> None:
    """local_global reads ``window`` (as sliding_window), ``global_tokens`` >= 0 and
    ``global_every`` >= 0 (0: none)."""
    if m.attention.window is None:
        raise ConfigError(
            "model.attention.window must be set for model.attention.mask=local_global "
            "(tokens a query sees, itself included, besides the global ones)"
        )
    check_window(m)
    for name in ("global_tokens", "global_every"):
        value = getattr(m.attention, name)
        if not 0 <= value <= m.max_seq_len:
            raise ConfigError(
                f"model.attention.{name} must be in [0, model.max_seq_len={m.max_seq_len}], "
                f"got {value}"
            )


local_global_mask = MASKS.register(
    "local_global",
    options=("window",),
    check=check_local_global,
    fields={"global_tokens": (int, 1), "global_every": (int, 0)},
    examples=(
        {"attention": {"window": 3}},
        {"attention": {"window": 2, "global_tokens": 2, "global_every": 4}},
        {"attention": {"window": 3, "global_tokens": 0, "global_every": 5, "backend": "math"}},
        # window 1: S >= 8 window from 8 tokens on, so the contract runs the sparse path
        {"attention": {"window": 1, "global_tokens": 1, "global_every": 3, "n_kv_heads": 2}},
    ),
)(LocalGlobalMask())


# ----------------------------------------------------------------------------- block-sparse path

SPARSE_MIN_KEYS_PER_WINDOW = 8  # the sparse path runs when S >= 8 window (see sparse_applies)


def sparse_applies(s: int, window: int | None, causal: bool) -> bool:
    """Whether :func:`local_global_sparse` computes a call of S keys: a causal mask and S >= 8
    ``window``. A query's band scores window + block - 1 <= 2 window - 1 keys, a quarter of S
    or less from 8 window on. Measured (benchmarks/local_global_sparse.py, window 128, one CPU
    thread): at S = 4 window the sparse path is 1.3x faster than the dense math formula but 2x
    slower than the fused sdpa kernel (the default backend), at 8 window about even with sdpa
    in time and memory, at 16 and 32 window 2.8x and 10x faster. Decode steps (T = 1) follow
    the same rule."""
    return causal and window is not None and s >= SPARSE_MIN_KEYS_PER_WINDOW * window


def _first_true(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """flags (B', N) bool -> (index (B', n) int64 of each row's True entries in order, padded,
    valid (B', n) bool), n = the most True entries of a row."""
    n = int(flags.sum(-1).max()) if flags.numel() else 0
    index = torch.sort((~flags).to(torch.int8), dim=-1, stable=True).indices[:, :n]
    return index, flags.gather(1, index)


def _softmax_rows(
    scores: torch.Tensor, allowed: torch.Tensor, dropout_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim of ``scores`` where ``allowed`` (float32 at least, as the math
    backend). Returns (weights, empty (..., 1) bool): a row with no allowed entry is opened
    fully (as :func:`~lmlab.nn.masks.combine_masks` does, so no row of -inf reaches backward)
    and the caller zeroes its output with ``empty``."""
    empty = ~allowed.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~(allowed | empty), float("-inf"))
    dtype = torch.promote_types(scores.dtype, torch.float32)
    w = torch.softmax(scores, dim=-1, dtype=dtype).to(scores.dtype)
    return (F.dropout(w, p=dropout_p) if dropout_p > 0.0 else w), empty


def local_global_sparse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    window: int,
    global_tokens: int,
    global_every: int,
    key_mask: torch.Tensor | None = None,
    from_key_mask: bool = False,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal local + global softmax attention computing only the allowed blocks; equal to the
    dense masked formula (:func:`local_global_allowed` + the attention core).

    q (B, H, T, hd); k (B, K, S, hd); v (B, K, S, hdv), K dividing H (GQA: query head h reads kv
    head h // (H / K), no repeated copy); queries are the last T keys. ``key_mask`` (B, S') bool,
    True = real token (its last S columns); padding keys are never attended and a query with no
    key outputs 0. ``from_key_mask``: positions count real tokens (a left-padded row as alone;
    then the padding must be left padding, the band being taken on indices); else positions are
    indices. Returns (B, H, T, hdv) in q's dtype.

    Three score tensors instead of (B, H, T, S), one softmax per query over their union:

    - band: queries in blocks of bq = min(T, window); block c scores the bq + window - 1 keys
      ending at its last query (an unfold view of k), masked to each query's window;
    - global columns: the G global real keys (first ``global_tokens``, every ``global_every``-th)
      for every query, masked to keys before its window (a key in both is counted once, in the
      band);
    - global rows: the Gq global real queries read every earlier key, (B, H, Gq, S), and their
      rows replace the band + columns result.
    """
    b, h, t, hd = q.shape
    n_kv, s = k.shape[1], k.shape[2]
    r, dev = h // n_kv, q.device
    real = None if key_mask is None else key_mask[:, -s:]  # (B, S)
    if from_key_mask and real is not None:
        pos = position_ids_from_attention_mask(real)  # (B, S)
    else:
        pos = torch.arange(s, device=dev).unsqueeze(0)  # (1, S)
    is_global = pos < global_tokens
    if global_every > 0:
        is_global = is_global | (pos % global_every == 0)
    if real is not None:
        is_global = is_global & real  # (B' , S): B' = B with padding, else 1
    kidx = torch.arange(s, device=dev)
    qidx = kidx[s - t :]  # (T,) query indices

    # band: query block c (queries c bq .. c bq + bq - 1) reads padded keys [c bq, c bq + L)
    bq = min(t, window)
    nb = -(-t // bq)
    tp, ell = nb * bq, bq + window - 1
    qb = F.pad(q, (0, 0, 0, tp - t)).reshape(b, n_kv, r, nb, bq, hd)  # (B, K, R, nb, bq, hd)
    pad = (0, 0, window - 1, tp - t)
    kb = F.pad(k, pad)[:, :, s - t :].unfold(2, ell, bq)  # (B, K, nb, hd, L), a view
    vb = F.pad(v, pad)[:, :, s - t :].unfold(2, ell, bq)  # (B, K, nb, hdv, L)
    band = torch.einsum("bkrnqd,bkndl->bkrnql", qb, kb) * scale  # (B, K, R, nb, bq, L)
    slot = torch.arange(ell, device=dev)
    start = s - t - (window - 1) + torch.arange(nb, device=dev) * bq  # key index of slot 0
    key_at = start[:, None] + slot  # (nb, L) key index of each slot
    gap = torch.arange(bq, device=dev)[:, None] + window - 1 - slot  # (bq, L) query - key
    allowed_band = (gap >= 0) & (gap < window) & (key_at >= 0)[:, None, :]  # (nb, bq, L)
    if real is not None:
        seen = F.pad(real, (window - 1, tp - t))[:, s - t :].unfold(1, ell, bq)  # (B, nb, L)
        allowed_band = allowed_band & seen[:, None, None, :, None, :]
    bb = 1 if real is None else b  # masks stay (B or 1, 1, 1, ...): shared by the heads
    allowed_band = allowed_band.expand(bb, 1, 1, nb, bq, ell).reshape(bb, 1, 1, tp, ell)
    scores, allowed = [band.flatten(3, 4)], [allowed_band]

    # global columns: the G global keys, for every query, outside its window
    gk, gk_valid = _first_true(is_global)  # (B', G)
    g = gk.shape[1]
    if g:
        index = gk.expand(b, g)[:, None, :, None]
        kg = k.gather(2, index.expand(b, n_kv, g, hd))  # (B, K, G, hd)
        vg = v.gather(2, index.expand(b, n_kv, g, v.shape[-1]))  # (B, K, G, hdv)
        qf = qb.reshape(b, n_kv, r * tp, hd)  # (B, K, R tp, hd), the padded q's storage
        cols = (qf @ kg.transpose(-2, -1)).view(b, n_kv, r, tp, g) * scale  # (B, K, R, tp, G)
        qpad = torch.arange(s - t, s - t + tp, device=dev)  # (tp,) query indices, padded
        far = qpad[None, :, None] - gk[:, None, :] >= window  # (B', tp, G): before the window
        allowed_cols = (far & gk_valid[:, None, :])[:, None, None]  # (B', 1, 1, tp, G)
        scores.append(cols)
        allowed.append(allowed_cols)
    w, empty = _softmax_rows(torch.cat(scores, -1), torch.cat(allowed, -1), dropout_p)
    y = torch.einsum("bkrnql,bkndl->bkrnqd", w[..., :ell].unflatten(3, (nb, bq)), vb)
    y = y.flatten(3, 4)  # (B, K, R, tp, hdv)
    if g:
        y = y + torch.einsum("bkrtg,bkgd->bkrtd", w[..., ell:], vg)
    y = y.masked_fill(empty, 0.0)[:, :, :, :t]  # a query with no key outputs 0

    # global rows: each global real query reads every earlier real key
    gq, gq_valid = _first_true(is_global[:, s - t :])  # (B', Gq)
    if gq.shape[1]:
        n = gq.shape[1]
        at = gq.expand(b, n)
        where = at[:, None, None, :, None].expand(b, n_kv, r, n, hd)
        qg = q.unflatten(1, (n_kv, r)).gather(3, where).reshape(b, n_kv, r * n, hd)
        rows = (qg @ k.transpose(-2, -1)).view(b, n_kv, r, n, s) * scale  # (B, K, R, Gq, S)
        causal = kidx[None, None, :] <= qidx[gq][:, :, None]  # (B', Gq, S)
        if real is not None:
            causal = causal & real[:, None, :]
        wg, none = _softmax_rows(rows, causal[:, None, None], dropout_p)  # mask (B', 1, 1, Gq, S)
        yg = (wg.view(b, n_kv, r * n, s) @ v).view(b, n_kv, r, n, -1)  # (B, K, R, Gq, hdv)
        yg = yg.masked_fill(none, 0.0)
        dump = torch.where(gq_valid, gq, t).expand(b, n)  # invalid slots land in row T
        y = F.pad(y, (0, 0, 0, 1)).scatter(3, dump[:, None, None, :, None].expand(*yg.shape), yg)[
            :, :, :, :t
        ]
    return y.reshape(b, h, t, -1)
