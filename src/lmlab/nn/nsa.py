"""NSA, Native Sparse Attention (Yuan et al. 2025, "Native Sparse Attention: Hardware-Aligned and
Natively Trainable Sparse Attention", arXiv 2502.11089).

Legend: B batch, T query tokens, S key tokens (cache + T), D d_model, H heads, K kv heads,
hd head_dim, r = H / K heads per kv group, l compress_block, d compress_stride, l'
select_block, n select_top_k, w nsa_window, Nc compressed blocks, Ns selection blocks.

Each query t (its real-token index i, keys counted in real tokens so a left-padded row equals
the row alone) reads three branches over its causal keys (paper eq. 5):

    o_t = g_cmp o_cmp + g_slc o_slc + g_win o_win,   [g_cmp, g_slc, g_win] = sigmoid(W_g x_t)

one gate per branch and head (``gate_proj``, D -> 3 H).

1. compressed (eq. 7): block c covers tokens [c d, c d + l); its key and value are
   ``compress_k`` / ``compress_v`` (nn.Linear(l hd, hd), shared by all heads) applied to the
   block's l keys (values) flattened in order. This is the paper's phi with its MLP reduced to
   one linear layer: a weight per (position in block, channel in, channel out), so the
   intra-block position encoding is built in (each position has its own weights) and no extra
   table is needed. Keys are compressed after RoPE (the cached keys), so the cache holds only
   raw keys. Only complete blocks ending at or before i are seen: c d + l - 1 <= i.
2. selected (eq. 8-11): p_cmp, the compressed-branch probabilities, summed over the r heads of
   a kv group (the group shares its selection, sec. 3.3.2), are mapped to selection blocks
   j = [j l', (j + 1) l') by token overlap: p_slc[j] = sum_c p_cmp[c] |block c & block j| (the
   paper's eq. 9 up to a constant; require d | l' and l <= l', so every past selection block
   holds a visible compressed block). The n highest blocks among those starting at or before i
   are read, the query's own (local) block and the first block always (own, first, then by
   score); then softmax attention over the tokens of those blocks only, causal inside.
   The top-n choice carries no gradient (as the paper); everything else does.
3. sliding (sec. 3.3.3): softmax attention over the last w tokens, i - w < index <= i.

Keys and values: the compressed and selected branches share q/k/v projections (``k_proj``,
``v_proj``: the selected blocks are the raw tokens the compressed keys summarise); the sliding
branch has its own (``window_k_proj``, ``window_v_proj``), as the paper's independent branch
keys, so local patterns do not shortcut the other two. One query (``q_proj``) serves all three.

Computation: the selected and sliding branches gather their n l' and w keys per query
(:func:`gathered_attention`), never a dense T x S product; the compressed branch is dense over
the Nc ~ S / d compressed keys. All score maths is spelled out here (``backend`` is not read).
Cache (:class:`NSACache`): all raw keys/values (any past block may be selected) plus the last
w - 1 sliding keys/values; compressed keys are recomputed from the raw ones each step.
Positions: RoPE-style kinds (or none/learned/sinusoidal); a score-bias position (ALiBi, T5) is
refused (a compressed key has no single position).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.errors import ConfigError, LmlabError
from lmlab.nn.attention import ATTENTION, AttentionOutput, SoftmaxAttention
from lmlab.nn.hooks import HookPoint
from lmlab.nn.kv_cache import LayerCache, LayerKVCache, SlidingWindowKVCache
from lmlab.nn.moba import compact, token_index
from lmlab.nn.position import POSITION, PositionEncoding

if TYPE_CHECKING:
    from lmlab.config import ModelConfig

BRANCHES = ("compressed", "selected", "sliding")


def nsa_section(m: ModelConfig) -> Any:
    """``m.attention``, typed to read the fields NSA declares (mypy cannot see them)."""
    return m.attention


# ----------------------------------------------------------------------------- the branches


def compress(kc: torch.Tensor, proj: nn.Linear, block: int, stride: int) -> torch.Tensor:
    """kc (B, K, S, hd) in real-token order -> (B, K, Nc, hd): ``proj`` of each block of
    ``block`` keys starting every ``stride`` tokens, flattened (position-major) to block hd
    numbers; Nc = (max(S, l) - l) // d + 1 (slots past S are zeros: such blocks are never
    visible)."""
    s = kc.shape[2]
    if s < block:
        kc = F.pad(kc, (0, 0, 0, block - s))
    blocks = kc.unfold(2, block, stride)  # (B, K, Nc, hd, l)
    return proj(blocks.transpose(-1, -2).flatten(-2))  # (B, K, Nc, hd)


def compressed_visible(
    query_index: torch.Tensor, n_blocks: int, block: int, stride: int
) -> torch.Tensor:
    """(B or 1, T) real-token indices -> (B or 1, T, Nc) bool: block c ends at or before the
    query, c d + l - 1 <= i."""
    ends = torch.arange(n_blocks, device=query_index.device) * stride + block - 1
    return ends[None, None, :] <= query_index[:, :, None]


def softmax_probs(scores: torch.Tensor, seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Softmax over the last dim of ``scores`` where ``seen`` (True = may attend), in at least
    float32, cast to ``dtype``; a row that sees nothing gets 0."""
    scores = scores.masked_fill(~seen, float("-inf"))
    w = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    return w.nan_to_num(0.0).to(dtype)


def compressed_attention(
    q: torch.Tensor,
    kcmp: torch.Tensor,
    vcmp: torch.Tensor,
    query_index: torch.Tensor,
    block: int,
    stride: int,
    scale: float,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, T, hd), kcmp/vcmp (B, K, Nc, hd) -> (out (B, H, T, hd), p (B, K, r, T, Nc)): the
    compressed branch and its probabilities (before dropout), per kv group."""
    b, h, t, hd = q.shape
    kv, nc = kcmp.shape[1], kcmp.shape[2]
    qg = q.view(b, kv, h // kv, t, hd)  # head h reads kv head h // r
    scores = torch.einsum("bkrtd,bknd->bkrtn", qg, kcmp) * scale  # (B, K, r, T, Nc)
    seen = compressed_visible(query_index, nc, block, stride)[:, None, None]
    p = softmax_probs(scores, seen, q.dtype)
    w = F.dropout(p, p=dropout_p) if dropout_p > 0.0 else p
    return torch.einsum("bkrtn,bknd->bkrtd", w, vcmp).reshape(b, h, t, hd), p


@torch.no_grad()
def select_blocks(
    p_cmp: torch.Tensor,
    query_index: torch.Tensor,
    s: int,
    block: int,
    stride: int,
    select_block: int,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection blocks each kv group reads, from p_cmp (B, K, r, T, Nc).

    Returns (blocks (B, K, T, n) int64 in [0, Ns), n = min(top_k, Ns), Ns = ceil(S / l'); valid
    (B, K, T, n) bool, False for a slot with no block (fewer candidate blocks than n, or a query
    with no real token)). Score of block j: sum over the group's heads and over compressed
    blocks c of p_cmp[c] times the tokens blocks c and j share; the own block i // l' ranks
    first, block 0 second, blocks starting after i are never chosen."""
    imp = p_cmp.sum(2).float()  # (B, K, T, Nc): the group's heads summed
    nc, ns = imp.shape[-1], -(-s // select_block)
    start = torch.arange(nc, device=imp.device) * stride  # block c: [c d, c d + l)
    first = torch.div(start, select_block, rounding_mode="floor")  # l <= l': blocks c overlaps
    last = torch.div(start + block - 1, select_block, rounding_mode="floor")  # first or first + 1
    share = (torch.minimum(start + block, (first + 1) * select_block) - start).to(imp.dtype)
    score = imp.new_zeros(*imp.shape[:-1], ns + 1)  # slot ns: blocks past S (never ranked)
    score.scatter_add_(-1, first.expand_as(imp), imp * share)
    score.scatter_add_(-1, last.clamp_max(ns).expand_as(imp), imp * (block - share))
    score = score[..., :ns]  # (B, K, T, Ns)
    own = torch.div(query_index, select_block, rounding_mode="floor")[:, None, :, None]
    j = torch.arange(ns, device=imp.device)
    score = torch.where(j == 0, torch.finfo(score.dtype).max, score)
    score = torch.where(j == own, float("inf"), score)
    score = score.masked_fill(j > own, float("-inf"))  # future blocks; all for index -1
    vals, blocks = score.topk(min(top_k, ns), dim=-1)
    return blocks, vals > float("-inf")


def gathered_attention(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    slots: torch.Tensor,
    seen: torch.Tensor,
    scale: float,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention of each query over its own m gathered keys only.

    q (B, H, T, hd); kc, vc (B, K, S, hd); slots (B, K, T, m) int64 key slots; seen (B, K, T, m)
    bool (True = may attend; a slot outside [0, S) must be unseen). Returns (B, H, T, hd):
    softmax of the (B, K, r, T, m) gathered scores (float32 at least), 0 for a query that
    sees nothing. Each kv group's keys are gathered once for its r heads."""
    b, h, t, hd = q.shape
    kv, s = kc.shape[1], kc.shape[2]
    m = slots.shape[-1]
    index = slots.clamp(0, s - 1).reshape(b, kv, t * m, 1).expand(-1, -1, -1, hd)
    kg = kc.gather(2, index).view(b, kv, t, m, hd)  # (B, K, T, m, hd)
    vg = vc.gather(2, index).view(b, kv, t, m, hd)
    qg = q.view(b, kv, h // kv, t, hd)
    scores = torch.einsum("bkrtd,bktmd->bkrtm", qg, kg) * scale  # (B, K, r, T, m)
    w = softmax_probs(scores, seen[:, :, None], q.dtype)
    if dropout_p > 0.0:
        w = F.dropout(w, p=dropout_p)
    return torch.einsum("bkrtm,bktmd->bkrtd", w, vg).reshape(b, h, t, hd)


def selected_slots(
    blocks: torch.Tensor, valid: torch.Tensor, query_index: torch.Tensor, select_block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks, valid (B, K, T, n) -> (slots, seen) (B, K, T, n l'): the selected blocks' token
    slots, seen where the block is valid and the token is at or before the query."""
    offs = torch.arange(select_block, device=blocks.device)
    slots = (blocks[..., None] * select_block + offs).flatten(-2)
    seen = valid.repeat_interleave(select_block, dim=-1)
    return slots, seen & (slots <= query_index[:, None, :, None])


def window_slots(
    query_index: torch.Tensor, window: int, kv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B or 1, T) real-token indices -> (slots, seen) (B or 1, K, T, w): the w tokens
    i - w < index <= i, seen where the index is >= 0."""
    offs = torch.arange(1 - window, 1, device=query_index.device)
    slots = query_index[:, :, None] + offs  # (B or 1, T, w)
    slots = slots[:, None].expand(-1, kv, -1, -1)
    return slots, slots >= 0


# ----------------------------------------------------------------------------- the cache


class NSACache:
    """One NSA layer's decoding state: every raw key/value (``raw``, a :class:`LayerKVCache`,
    (B, K, S, hd) each: any past block may be selected) and the sliding branch's last w - 1
    keys/values (``window``, a :class:`SlidingWindowKVCache`)."""

    def __init__(self, window: int) -> None:
        self.raw = LayerKVCache()
        self.window = SlidingWindowKVCache(window)

    def update(
        self, k: torch.Tensor, v: torch.Tensor, kw: torch.Tensor, vw: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add the new (B, K, T, hd) keys/values of both key sets; return all raw ones
        (B, K, S, hd) and the sliding ones (B, K, min(seen, w - 1) + T, hd)."""
        k, v = self.raw.update(k, v)
        kw, vw = self.window.update(kw, vw)
        return k, v, kw, vw

    @property
    def seq_len(self) -> int:
        return self.raw.seq_len

    def nbytes(self) -> int:
        """Bytes held by both key sets."""
        return self.raw.nbytes() + self.window.nbytes()


# ----------------------------------------------------------------------------- the module


@ATTENTION.register("nsa")
class NativeSparseAttention(SoftmaxAttention):
    """NSA, Native Sparse Attention (Yuan et al. 2025): gated sum of compressed-block, top-n
    selected-block and sliding-window attention; causal masks, GQA, padding, KV cache.

    Fields (``model.attention``): ``compress_block`` l and ``compress_stride`` d (tokens per
    compressed block, and between block starts; d <= l); ``select_block`` l' (a multiple of
    d, >= l); ``select_top_k`` n (selection blocks a query reads, its own and the first
    included); ``nsa_window`` w (the sliding branch's tokens, the query included).
    """

    streams = False  # its forward and cache are its own; StreamingLLM's eviction is refused
    streams_refusal = (
        "its compressed and selected branches rank every past key block, and a StreamingLLM "
        "cache has evicted the blocks between the sinks and the window, the ones selection "
        "would retrieve; over sinks + window only it would be a sliding window with gates"
    )

    examples: tuple[dict, ...] = (
        {},
        {"attention": {"compress_block": 4, "compress_stride": 2, "select_block": 4}},
        {
            "attention": {
                "compress_block": 4,
                "compress_stride": 2,
                "select_block": 4,
                "select_top_k": 2,
                "nsa_window": 3,
                "n_kv_heads": 2,
            }
        },
        {
            "attention": {
                "compress_block": 2,
                "compress_stride": 2,
                "select_block": 6,
                "select_top_k": 1,
                "nsa_window": 1,
                "n_kv_heads": 1,
                "qk_norm": True,
            }
        },
    )
    fields = {
        "compress_block": (int, 8),  # l: tokens per compressed block
        "compress_stride": (int, 4),  # d: tokens between compressed block starts
        "select_block": (int, 8),  # l': tokens per selection block
        "select_top_k": (int, 2),  # n: selection blocks per query, own and first included
        "nsa_window": (int, 8),  # w: sliding-branch tokens, the query included
    }

    @classmethod
    def check(cls, m: ModelConfig) -> None:
        """A causal mask; 1 <= d <= l <= l' <= max_seq_len, d | l'; 1 <= n <=
        ceil(max_seq_len / l') (more blocks than exist selects nothing more); 1 <= w <=
        max_seq_len; no score-bias position kind."""
        a = nsa_section(m)
        if a.mask not in ("causal", "streaming"):  # streaming: its check quotes streams_refusal
            raise ConfigError(
                f"model.attention.kind=nsa needs model.attention.mask=causal, got {a.mask!r} "
                "(its sliding branch is model.attention.nsa_window)"
            )
        for name in ("compress_block", "select_block", "nsa_window"):
            if not 1 <= getattr(a, name) <= m.max_seq_len:
                raise ConfigError(
                    f"model.attention.{name} must be in [1, model.max_seq_len={m.max_seq_len}]"
                    f", got {getattr(a, name)}"
                )
        if not 1 <= a.compress_stride <= a.compress_block:
            raise ConfigError(
                "model.attention.compress_stride must be in [1, compress_block="
                f"{a.compress_block}], got {a.compress_stride}"
            )
        if a.select_block % a.compress_stride or a.select_block < a.compress_block:
            raise ConfigError(
                f"model.attention.select_block ({a.select_block}) must be a multiple of "
                f"compress_stride ({a.compress_stride}) and >= compress_block "
                f"({a.compress_block}), so every past selection block holds a whole "
                "compressed block"
            )
        blocks = -(-m.max_seq_len // a.select_block)  # selection blocks in the longest context
        if not 1 <= a.select_top_k <= blocks:
            raise ConfigError(
                f"model.attention.select_top_k must be in [1, {blocks}] (the own block counts; "
                f"ceil(max_seq_len={m.max_seq_len} / select_block={a.select_block}) blocks "
                f"exist), got {a.select_top_k}"
            )
        pos = POSITION.get(m.position.kind, "model.position.kind")
        if pos.score_bias is not PositionEncoding.score_bias:
            raise ConfigError(
                f"model.attention.kind=nsa does not take model.position.kind={m.position.kind}"
                " (a score bias; a compressed key has no single position): use rope or none"
            )

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__(cfg, layer_idx)
        del self.hook_scores, self.hook_pattern  # three branches: no one (B, H, T, S) map
        a = nsa_section(cfg)
        self.block, self.stride = a.compress_block, a.compress_stride
        self.select_block, self.top_k = a.select_block, a.select_top_k
        self.nsa_window = a.nsa_window
        d, kvd, hd = cfg.d_model, self.n_kv_heads * self.head_dim, self.head_dim
        self.window_k_proj = nn.Linear(d, kvd, bias=a.bias)
        self.window_v_proj = nn.Linear(d, kvd, bias=a.bias)
        self.compress_k = nn.Linear(self.block * hd, hd)
        self.compress_v = nn.Linear(self.block * hd, hd)
        self.gate_proj = nn.Linear(d, len(BRANCHES) * self.n_heads)

    def new_cache(self) -> NSACache:  # type: ignore[override]
        """Every raw key/value and the sliding branch's last w - 1 (:class:`NSACache`)."""
        return NSACache(self.nsa_window)

    def project_all(
        self, x: torch.Tensor, position: PositionEncoding, positions: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """x (B, T, D) -> q (B, H, T, hd), k, v (B, K, T, hd) of the compressed/selected
        branches and kw, vw (B, K, T, hd) of the sliding branch; q, k, kw rotated (and QK-normed,
        the same norm for both key sets)."""
        b, t, _ = x.shape
        kv, hd = self.n_kv_heads, self.head_dim
        q = self.q_norm(self.q_proj(x).view(b, t, self.n_heads, hd)).transpose(1, 2)
        k = torch.cat([self.k_proj(x), self.window_k_proj(x)], dim=-1).view(b, t, 2 * kv, hd)
        v = torch.cat([self.v_proj(x), self.window_v_proj(x)], dim=-1).view(b, t, 2 * kv, hd)
        k, v = self.k_norm(k).transpose(1, 2), self.v_norm(v).transpose(1, 2)
        q, k = position.rotate(q, k, positions)  # q (B, H, T, hd), k (B, 2K, T, hd)
        (k, kw), (v, vw) = k.split(kv, dim=1), v.split(kv, dim=1)
        return self.hook_q(q), self.hook_k(k), kw, self.hook_v(v), vw  # hooks: branches 1-2

    def branches(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kw: torch.Tensor,
        vw: torch.Tensor,
        key_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, H, T, hd); k, v (B, K, S, hd); kw, vw (B, K, Sw, hd), the last Sw keys;
        key_mask (B, >= S) or None -> (o_cmp, o_slc, o_win), each (B, H, T, hd)."""
        t, s, sw = q.shape[2], k.shape[2], kw.shape[2]
        km = None if key_mask is None else key_mask[:, -s:]
        kmw = None if key_mask is None else key_mask[:, -sw:]
        _, qi = token_index(km, t, s, q.device)  # (B or 1, T)
        kc, vc, _ = compact(k, v, km)
        kcmp = compress(kc, self.compress_k, self.block, self.stride)  # (B, K, Nc, hd)
        vcmp = compress(vc, self.compress_v, self.block, self.stride)
        p = self.dropout_p
        o_cmp, p_cmp = compressed_attention(
            q, kcmp, vcmp, qi, self.block, self.stride, self.scale, p
        )
        blocks, valid = select_blocks(
            p_cmp, qi, s, self.block, self.stride, self.select_block, self.top_k
        )
        slots, seen = selected_slots(blocks, valid, qi, self.select_block)
        o_slc = gathered_attention(q, kc, vc, slots, seen, self.scale, p)
        _, qiw = token_index(kmw, t, sw, q.device)
        kcw, vcw, _ = compact(kw, vw, kmw)
        slots, seen = window_slots(qiw, self.nsa_window, self.n_kv_heads)
        b = q.shape[0]
        slots, seen = slots.expand(b, -1, -1, -1), seen.expand(b, -1, -1, -1)
        o_win = gathered_attention(q, kcw, vcw, slots, seen, self.scale, p)
        return o_cmp, o_slc, o_win

    def gates(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, D) -> g (3, B, H, T, 1) = sigmoid(W_g x): compressed, selected, sliding."""
        b, t, _ = x.shape
        g = torch.sigmoid(self.gate_proj(x)).view(b, t, len(BRANCHES), self.n_heads)
        return g.permute(2, 0, 3, 1)[..., None]

    def forward(
        self,
        x: torch.Tensor,
        position: PositionEncoding,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        cache: NSACache | None = None,  # type: ignore[override]
    ) -> AttentionOutput:
        """x (B, T, D) at ``positions`` (T,) or (B, T) -> AttentionOutput(out (B, T, D)).

        ``key_mask`` (B, S_total) bool, True = real token; blocks and windows count real tokens.
        ``cache`` (:meth:`new_cache`) is extended in place. There is no attention map
        (:meth:`map_points`)."""
        q, k, kw, v, vw = self.project_all(x, position, positions)
        if cache is not None:
            k, v, kw, vw = cache.update(k, v, kw, vw)
        o_cmp, o_slc, o_win = self.branches(q, k, v, kw, vw, key_mask)
        g = self.gates(x)
        y = g[0] * o_cmp + g[1] * o_slc + g[2] * o_win  # (B, H, T, hd)
        return AttentionOutput(self.merge_heads(y))

    def map_points(self, cache: LayerCache | None) -> tuple[HookPoint, ...]:
        """None: LmlabError, three branches over different keys have no one (B, H, T, S)
        weight matrix (``need_weights=True`` is refused before the forward runs)."""
        raise LmlabError(
            "model.attention.kind=nsa has no single attention map (three gated branches, "
            "one over compressed keys); attention maps need another kind"
        )

    # ------------------------------------------------------------------ declared costs

    @classmethod
    def cached_tokens(cls, cfg: ModelConfig, context: int) -> int:
        """Tokens the raw cache holds while decoding token ``context``: all of them."""
        return context

    @classmethod
    def kv_cache_bytes_per_token(cls, cfg: ModelConfig, dtype_bytes: int = 4) -> int:
        """Bytes one token adds: its raw key and value and, until the window fills, its
        sliding key and value, 4 K hd dtype_bytes."""
        return 4 * cfg.n_kv_heads * cfg.head_dim * dtype_bytes

    @classmethod
    def kv_cache_bytes(
        cls, cfg: ModelConfig, batch: int, context: int, dtype_bytes: int = 4
    ) -> int:
        """batch (context + min(context, w)) 2 K hd dtype_bytes: every raw key/value and the
        sliding ones the last step reads (w - 1 kept + the new one)."""
        w = nsa_section(cfg).nsa_window
        per = 2 * cfg.n_kv_heads * cfg.head_dim * dtype_bytes
        return batch * (context + min(context, w)) * per

    @classmethod
    def key_counts(cls, cfg: ModelConfig, seq_len: int) -> tuple[int, int, int, int]:
        """(Nc, Ns, n l', w'): compressed keys, selection blocks, gathered selected keys and
        gathered sliding keys per query at ``seq_len`` keys."""
        a = nsa_section(cfg)
        nc = (max(seq_len, a.compress_block) - a.compress_block) // a.compress_stride + 1
        ns = -(-seq_len // a.select_block)
        return nc, ns, min(a.select_top_k, ns) * a.select_block, a.nsa_window

    @classmethod
    def score_flops_per_token(cls, cfg: ModelConfig, seq_len: int) -> int:
        """FLOPs per query token and layer besides the weights, at ``seq_len`` keys: QK^T and
        AV against the Nc compressed, n l' selected and w sliding keys, 4 (Nc + n l' + w) H hd,
        and the block scores (each compressed block's probability times its token share, added to
        the two selection blocks it overlaps), 4 Nc K. (The compression matmuls are counted
        from compress_k/v's weights, once per token; they run K / d times per token.)"""
        nc, _, slc, w = cls.key_counts(cfg, seq_len)
        h, hd = cfg.attention.n_heads, cfg.head_dim
        return 4 * (nc + slc + w) * h * hd + 4 * nc * cfg.n_kv_heads

    def saved_projection_elements(self) -> int:
        """Elements per token autograd keeps of the projections (lmlab.training.memory; softmax's
        (3 H + 2 K) hd): q and the two copies the gathered branches' products make, 3 H hd;
        the three branch outputs the gates multiply, 3 H hd; o_proj's input, H hd; the gates,
        3 H; and the rotation's cos/sin, about hd (the keys are kept as gathered copies,
        counted in :meth:`saved_score_elements`)."""
        h, hd = self.n_heads, self.head_dim
        return 7 * h * hd + len(BRANCHES) * h + hd

    @classmethod
    def saved_score_elements(cls, cfg: ModelConfig, seq_len: int) -> int:
        """Elements per query token and layer autograd keeps, in float32 elements, at
        ``seq_len`` tokens: the compression's inputs and outputs, 2 K Nc (l + 1) hd / T; the
        compressed probabilities (twice: the softmax's and the product's), 2 H Nc; and per
        gathered branch of m keys (n l' selected, w sliding): the gathered keys and values,
        2 K m hd, the int64 gather index, 2 K m, the bool mask, K m / 4, and the
        probabilities twice, 2 H m."""
        a = nsa_section(cfg)
        nc, _, slc, w = cls.key_counts(cfg, seq_len)
        h, kv, hd = cfg.attention.n_heads, cfg.n_kv_heads, cfg.head_dim
        compression = -(-2 * kv * nc * (a.compress_block + 1) * hd // max(seq_len, 1))
        gathered = sum(2 * kv * m * hd + 2 * kv * m + -(-kv * m // 4) + 2 * h * m for m in (slc, w))
        return compression + 2 * h * nc + gathered
