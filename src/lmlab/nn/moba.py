"""MoBA, Mixture of Block Attention (Lu et al. 2025, Moonshot AI, arXiv 2502.13189).

Legend: B batch, T query tokens, S key tokens (cache + T), H heads, K kv heads, hd head_dim,
N key blocks (ceil(S / block_size)), n blocks a query attends to (<= top_k). Masks are bool
with True = may attend.

The keys are split into blocks of ``bs = model.attention.moba_block_size`` consecutive tokens
(block j = the real tokens of index j bs .. (j+1) bs - 1, counting real tokens only, so a
left-padded row has the blocks it has alone). Query t of index i (its block c = i // bs) scores
each block wholly in its past with the parameter-free gate (paper eq. 5-6)

    s_j = q_t . mean(K_block_j),   j < c,

keeps the ``top_k - 1`` highest and always its own block c, causally (keys <= i); future blocks
never. ``top_k`` counts the own block, as the paper (sparsity 1 - top_k bs / N) and the
reference code (the own block's gate is set to +inf before the top-k) do. One softmax runs over
the union of the selected keys. q and k are the rotated (RoPE) ones; the gate is per query head,
with GQA each query head scores its kv head's pooled keys (the reference code repeats the kv
heads before pooling). The gate has no parameters and passes no gradient (top-k indices).

Because the gate reads only complete past blocks and the query, the selection of a query is the
same whether the sequence is processed whole or chunk by chunk through the ordinary KV cache.

Two implementations, ``model.attention.moba_impl``: ``dense`` builds the (B, H, T, S) selection
mask and calls the attention core (the test oracle; every score is computed, then masked);
``gathered`` (default) gathers each query's n selected key blocks, (B, H, T, n bs, hd), and
computes n bs scores per query instead of S (the pure-PyTorch analogue of the paper's
FlashAttention varlen kernel; the gathered key/value copies cost n bs hd per query and head).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from lmlab.errors import ConfigError
from lmlab.nn.attention import ATTENTION, AttentionOutput, SoftmaxAttention, repeat_kv
from lmlab.nn.kv_cache import LayerKVCache

if TYPE_CHECKING:
    from lmlab.config import ModelConfig
    from lmlab.nn.position import PositionEncoding

MOBA_IMPLS = ("gathered", "dense")


def moba_section(m: ModelConfig) -> Any:
    """``m.attention``, typed to read the fields MoBA declares (``moba_block_size``,
    ``moba_top_k``, ``moba_impl``; the config schema adds them, mypy cannot see them)."""
    return m.attention


def token_index(
    key_mask: torch.Tensor | None, t: int, s: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each key's and query's index among the real tokens of its row.

    ``key_mask`` (B, S) bool (True = real token) or None (every token real). Returns (keys (B or
    1, S) int64, queries (B or 1, T) int64), the queries being the last T keys; a padding token
    gets the index of the last real token before it (-1 when there is none)."""
    if key_mask is None:
        idx = torch.arange(s, device=device).unsqueeze(0)  # (1, S)
    else:
        idx = key_mask.long().cumsum(-1) - 1  # (B, S)
    return idx, idx[:, s - t :]


def compact(
    k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """k, v (B, K, S, hd) -> the same with each row's real tokens first, in order (so real-token
    index j is slot j), and the permutation (B, S) int64 (None: no padding, nothing moved)."""
    if key_mask is None:
        return k, v, None
    order = torch.sort((~key_mask).to(torch.int8), dim=-1, stable=True).indices  # (B, S)
    index = order[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
    return k.gather(2, index), v.gather(2, index), order


def key_blocks(kc: torch.Tensor, block_size: int) -> torch.Tensor:
    """(B, K, S, hd) -> (B, K, N, bs, hd), zero-padded to N bs slots."""
    b, kv, s, hd = kc.shape
    n = -(-s // block_size)
    return F.pad(kc, (0, 0, 0, n * block_size - s)).view(b, kv, n, block_size, hd)


@torch.no_grad()
def block_gate(
    q: torch.Tensor, kc: torch.Tensor, query_index: torch.Tensor, block_size: int
) -> torch.Tensor:
    """The gate s_j = q . mean(K_block_j) (paper eq. 6) of each query for each block, float32.

    q (B, H, T, hd); kc (B, K, S, hd) in real-token order (:func:`compact`); query_index (B or
    1, T). Returns (B, H, T, N): -inf for every block not wholly before the query's own block
    (the own block, future blocks, and all blocks for a query with no real token)."""
    pooled = key_blocks(kc, block_size).float().mean(dim=3)  # (B, K, N, hd)
    pooled = repeat_kv(pooled, q.shape[1] // kc.shape[1])  # (B, H, N, hd)
    gate = torch.einsum("bhtd,bhnd->bhtn", q.float(), pooled)  # (B, H, T, N)
    own = torch.div(query_index, block_size, rounding_mode="floor")  # (B or 1, T)
    blocks = torch.arange(gate.shape[-1], device=q.device)
    past = blocks[None, None, None, :] < own[:, None, :, None]  # (B or 1, 1, T, N)
    return gate.masked_fill(~past, float("-inf"))


@torch.no_grad()
def select_blocks(
    gate: torch.Tensor, query_index: torch.Tensor, block_size: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks each query attends to: its top_k - 1 best past blocks and its own.

    gate (B, H, T, N) from :func:`block_gate`. Returns (blocks (B, H, T, n) int64 in [0, N),
    the own block last, and valid (B, H, T, n) bool: False for a slot left empty (fewer past
    blocks than top_k - 1, or a query with no real token))."""
    b, h, t, n_blocks = gate.shape
    vals, idx = gate.topk(min(top_k, n_blocks) - 1, dim=-1)  # (B, H, T, n - 1), < N - 1 past
    own = torch.div(query_index, block_size, rounding_mode="floor")  # (B or 1, T)
    own = own[:, None, :, None].expand(b, h, t, 1)
    blocks = torch.cat([idx, own.clamp_min(0)], dim=-1)
    valid = torch.cat([vals > float("-inf"), own >= 0], dim=-1)
    return blocks, valid


def selection_mask(
    blocks: torch.Tensor,
    valid: torch.Tensor,
    key_index: torch.Tensor,
    query_index: torch.Tensor,
    key_mask: torch.Tensor | None,
    block_size: int,
) -> torch.Tensor:
    """The dense (B, H, T, S) bool mask of the selection: key s is seen by query t iff it is a
    real token, its index is <= the query's and its block is one the query selected."""
    b, h, t, _ = blocks.shape
    n_blocks = -(-key_index.shape[-1] // block_size)  # N
    votes = torch.zeros(b, h, t, n_blocks, dtype=torch.long, device=blocks.device)
    chosen = votes.scatter_add(-1, blocks, valid.long()) > 0  # (B, H, T, N); repeats add up
    key_block = torch.div(key_index.clamp_min(0), block_size, rounding_mode="floor")
    key_block = key_block[:, None, None, :].expand(b, h, t, -1)  # (B, H, T, S)
    mask = chosen.gather(-1, key_block)
    mask = mask & (key_index[:, None, None, :] <= query_index[:, None, :, None])
    if key_mask is not None:
        mask = mask & key_mask[:, None, None, :]
    return mask


def gathered_attention(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    blocks: torch.Tensor,
    valid: torch.Tensor,
    query_index: torch.Tensor,
    block_size: int,
    scale: float,
    bias: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention of each query over its selected key blocks only.

    q (B, H, T, hd); kc, vc (B, K, S, hd) in real-token order (:func:`compact`, whose ``order``
    maps the slots back to key positions for ``bias``); blocks, valid (B, H, T, n) from
    :func:`select_blocks`; bias: additive scores broadcastable to (B, H, T, S) or None.

    Returns out (B, H, T, hd): softmax over the n bs gathered scores per query (float32 at
    least), masked to keys whose index is <= the query's; a query with no key outputs 0. The
    score tensor is (B, H, T, n bs), not (B, H, T, S)."""
    b, h, t, n = blocks.shape
    rep = h // kc.shape[1]
    bi = torch.arange(b, device=q.device)[:, None, None, None]
    hi = (torch.arange(h, device=q.device) // rep)[None, :, None, None]
    kg = key_blocks(kc, block_size)[bi, hi, blocks].flatten(3, 4)  # (B, H, T, n bs, hd)
    vg = key_blocks(vc, block_size)[bi, hi, blocks].flatten(3, 4)  # (B, H, T, n bs, hd)
    slot = blocks[..., None] * block_size + torch.arange(block_size, device=q.device)
    slot = slot.flatten(3, 4)  # (B, H, T, n bs): each gathered key's real-token index
    seen = valid.repeat_interleave(block_size, dim=-1) & (slot <= query_index[:, None, :, None])
    scores = torch.einsum("bhtd,bhtsd->bhts", q, kg) * scale  # (B, H, T, n bs)
    if bias is not None:
        s = kc.shape[2]
        where = slot.clamp_max(s - 1)
        if order is not None:  # slot -> key position
            where = order[:, None, None, :].expand(b, h, t, -1).gather(-1, where)
        bias = bias.to(scores.dtype).expand(b, h, t, s).gather(-1, where)
        scores = scores + bias
    scores = scores.masked_fill(~seen, float("-inf"))
    dtype = torch.promote_types(scores.dtype, torch.float32)
    w = torch.softmax(scores, dim=-1, dtype=dtype).to(q.dtype)
    if order is not None:  # padding: a query may see no key at all (0, not NaN)
        w = w.nan_to_num(0.0)
    if dropout_p > 0.0:
        w = F.dropout(w, p=dropout_p)
    return torch.einsum("bhts,bhtsd->bhtd", w, vg)


@ATTENTION.register("moba")
class MoBAAttention(SoftmaxAttention):
    """MoBA, Mixture of Block Attention (Lu et al. 2025): each query attends to its own block
    and the top_k - 1 past key blocks whose mean key scores highest; causal masks only."""

    examples: tuple[dict, ...] = (
        {},
        {"attention": {"moba_block_size": 4, "moba_top_k": 2}},
        {"attention": {"moba_block_size": 3, "moba_top_k": 2, "n_kv_heads": 1}},
        {"attention": {"moba_block_size": 4, "moba_top_k": 1, "backend": "math"}},
        {"attention": {"moba_block_size": 4, "moba_top_k": 2, "moba_impl": "dense"}},
        {"attention": {"moba_block_size": 2, "moba_top_k": 3, "n_kv_heads": 2}},
    )
    streams = False  # its forward is its own; StreamingLLM's eviction is refused, see below
    streams_refusal = (
        "its gate ranks every past key block by its mean key, and a StreamingLLM cache has "
        "evicted the blocks between the sinks and the window, the ones it would retrieve; "
        "over sinks + window only it would be a sliding window with a gate, not MoBA"
    )
    fields = {
        "moba_block_size": (int, 16),  # bs: tokens per key block
        "moba_top_k": (int, 3),  # blocks a query attends to, its own included
        "moba_impl": (str, "gathered"),  # gathered | dense (the masked oracle)
    }

    @classmethod
    def check(cls, m: ModelConfig) -> None:
        """A causal mask; 1 <= moba_block_size <= max_seq_len; moba_top_k >= 1; moba_impl
        gathered or dense."""
        a = moba_section(m)
        if a.mask not in ("causal", "streaming"):  # streaming: its check quotes streams_refusal
            raise ConfigError(
                f"model.attention.kind=moba needs model.attention.mask=causal, got {a.mask!r} "
                "(its gate picks among past blocks; a sliding window would drop them)"
            )
        if not 1 <= a.moba_block_size <= m.max_seq_len:
            raise ConfigError(
                f"model.attention.moba_block_size must be in [1, model.max_seq_len="
                f"{m.max_seq_len}], got {a.moba_block_size}"
            )
        if a.moba_top_k < 1:
            raise ConfigError(
                f"model.attention.moba_top_k must be >= 1 (the own block counts), got "
                f"{a.moba_top_k}"
            )
        if a.moba_impl not in MOBA_IMPLS:
            raise ConfigError(
                f"model.attention.moba_impl must be one of {', '.join(MOBA_IMPLS)}, got "
                f"{a.moba_impl!r}"
            )

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__(cfg, layer_idx)
        a = moba_section(cfg)
        self.block_size, self.top_k, self.impl = a.moba_block_size, a.moba_top_k, a.moba_impl

    def new_cache(self) -> LayerKVCache:
        """The ordinary dynamic cache: the gate may pick any past block."""
        return LayerKVCache()

    def forward(
        self,
        x: torch.Tensor,
        position: PositionEncoding,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        cache: LayerKVCache | None = None,  # type: ignore[override]
    ) -> AttentionOutput:
        """x (B, T, D) -> AttentionOutput(out (B, T, D)).

        Arguments as :meth:`SoftmaxAttention.forward`; blocks count real tokens (``key_mask``).
        A scores or pattern hook (``need_weights`` records the pattern) uses the dense path for
        this call (it has the (B, H, T, S) weights)."""
        t = x.shape[1]
        q, k, v = self.project(x, position, positions)
        if cache is not None:
            k, v = cache.update(k, v)  # (B, K, S, hd)
        s = k.shape[2]
        if key_mask is not None:
            key_mask = key_mask[:, -s:]
        key_index, query_index = token_index(key_mask, t, s, x.device)
        kc, vc, order = compact(k, v, key_mask)
        gate = block_gate(q, kc, query_index, self.block_size)
        blocks, valid = select_blocks(gate, query_index, self.block_size, self.top_k)
        bias = position.score_bias(positions, s)  # (H, T, S) or None
        if self.impl == "dense" or self.hook_pattern.fns or self.hook_scores.fns:
            mask = selection_mask(blocks, valid, key_index, query_index, key_mask, self.block_size)
            y, _ = self.attend(q, k, v, lambda *_: mask, key_mask, bias)
        else:
            y = gathered_attention(
                q,
                kc,
                vc,
                blocks,
                valid,
                query_index,
                self.block_size,
                self.scale,
                bias,
                order,
                self.dropout_p,
            )
        return AttentionOutput(self.merge_heads(y))

    # ------------------------------------------------------------------ declared costs
    # kv_cache_bytes and cached_tokens: SoftmaxAttention's (every past key is kept).

    @classmethod
    def _slots(cls, cfg: ModelConfig, seq_len: int) -> int:
        """Key slots a query's scores cover on the gathered path: n bs, n = min(top_k, N)
        (a query has at most N - 1 past blocks)."""
        a = moba_section(cfg)
        return min(a.moba_top_k, -(-seq_len // a.moba_block_size)) * a.moba_block_size

    @classmethod
    def score_flops_per_token(cls, cfg: ModelConfig, seq_len: int) -> int:
        """FLOPs per query token and layer besides the weights: the gate against N pooled keys,
        2 N H hd, plus QK^T and AV over the gathered n bs keys (gathered) or all ``seq_len``
        keys (dense, computed then masked), 4 keys H hd."""
        a = moba_section(cfg)
        h, hd = a.n_heads, cfg.head_dim
        keys = seq_len if a.moba_impl == "dense" else cls._slots(cfg, seq_len)
        return 2 * -(-seq_len // a.moba_block_size) * h * hd + 4 * keys * h * hd

    @classmethod
    def saved_score_elements(cls, cfg: ModelConfig, seq_len: int) -> int:
        """Elements per query token and layer autograd keeps: dense, SoftmaxAttention's count;
        gathered, the gathered keys and values, 2 H n bs hd, the probabilities, H n bs, their
        bool mask (H n bs bytes, counted as a quarter element) and two int64 gather indices
        per selected block (4 H n elements); in float32 elements."""
        a = moba_section(cfg)
        if a.moba_impl == "dense":
            return super().saved_score_elements(cfg, seq_len)
        slots, h = cls._slots(cfg, seq_len), a.n_heads
        n = slots // a.moba_block_size
        return h * slots * (2 * cfg.head_dim + 1) + -(-h * slots // 4) + 4 * h * n
