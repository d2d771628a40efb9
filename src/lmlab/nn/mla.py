"""Multi-head latent attention (MLA): keys and values expanded from one cached low-rank latent
(DeepSeek-AI 2024, "DeepSeek-V2", sec. 2.1; DeepSeek-V3 keeps it).

Legend: B batch, T query tokens, S key tokens (cache + T), D d_model, H heads, c kv_lora_rank,
c' q_lora_rank, n qk_nope_head_dim, r qk_rope_head_dim, dv v_head_dim.

Per token h (D,), the paper's eq. (9)-(19), in Hugging Face's DeepseekV3Attention names:

    c_KV = RMSNorm(W_DKV h)              kv_a_proj_with_mqa[:c], kv_a_layernorm     (c,)
    k_R  = RoPE(W_KR h)                  kv_a_proj_with_mqa[c:], one key for all heads (r,)
    [k_C; v_C]_i = W_UK,UV c_KV          kv_b_proj                           (H, n + dv)
    q = W_UQ RMSNorm(W_DQ h)             q_a_proj, q_a_layernorm, q_b_proj   (H, n + r)
        (q_lora_rank 0: q = W_Q h, q_proj)
    q_i = [q_C,i; RoPE(q_R,i)],  k_i = [k_C,i; k_R],  o_i = softmax(q_i k_i^T / sqrt(n + r)) v_C,i
    out = W_O [o_1; ...; o_H]            o_proj

Only c_KV and k_R are cached: (c + r) numbers per token and layer, against 2 H hd for multi-head
attention. Decoding expands the cached latent each step (``absorb: false``), or, with ``absorb:
true``, folds W_UK into the query and W_UV after the attention so the softmax runs over the latent
itself (the paper's sec. 2.1.2 remark): q_i W_UK,i . c_KV + q_R,i . k_R, a single shared "kv
head" of c + r channels, the same numbers in another order.

RoPE is the model's ``position`` (a RoPE kind) applied to the r decoupled channels only, so its
rotated width int(head_dim * partial_rotary_factor) must equal r: as in HF's DeepseekV3Config,
``model.attention.head_dim`` is the RoPE head dim. HF's ``rope_interleave: true`` (DeepSeek's
checkpoints) is ``model.position.interleaved: true`` (HF returns the rotated pairs de-interleaved,
a permutation applied to q and k alike, so every score is the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmlab.errors import ConfigError
from lmlab.nn.attention import (
    ATTENTION,
    Attention,
    AttentionOutput,
    SoftmaxAttention,
    attend,
    bound_mask,
)
from lmlab.nn.attention_core import ATTENTION_BACKENDS
from lmlab.nn.fused import linear
from lmlab.nn.hooks import HookPoint
from lmlab.nn.kv_cache import LayerKVCache, SlidingWindowKVCache
from lmlab.nn.norm import RMSNorm
from lmlab.nn.position import POSITION, RotaryPosition, rotary_dim
from lmlab.nn.rope_scaling import yarn_mscale

if TYPE_CHECKING:
    from lmlab.config import ModelConfig
    from lmlab.nn.position import PositionEncoding


@dataclass(frozen=True)
class MLADims:
    """The resolved sizes of one MLA layer (a 0 field resolved as its docstring says)."""

    kv_lora_rank: int  # c
    q_lora_rank: int  # c', 0: a plain q projection
    nope: int  # n, per head
    rope: int  # r, shared by q heads and the one k_R
    v: int  # dv, per head
    absorb: bool  # attention over the latent

    @classmethod
    def of(cls, m: ModelConfig) -> MLADims:
        f = mla_fields(m)
        rope = f["qk_rope_head_dim"] or rotary_dim(m.head_dim, m.position.partial_rotary_factor)
        return cls(
            kv_lora_rank=f["kv_lora_rank"],
            q_lora_rank=f["q_lora_rank"],
            nope=f["qk_nope_head_dim"] or m.head_dim,
            rope=rope,
            v=f["v_head_dim"] or m.head_dim,
            absorb=f["absorb"],
        )


def softmax_mscale(m: ModelConfig) -> float:
    """DeepSeek's softmax-scale multiplier root, yarn_mscale(factor, mscale_all_dim) =
    0.1 mscale_all_dim ln(factor) + 1 of ``m.position.scaling`` (1.0 without mscale_all_dim):
    DeepSeek-V2/V3 (and HF's ``yarn_apply_mscale``) multiply 1/sqrt(n + r) by its square."""
    s = m.position.scaling
    return yarn_mscale(s.factor, s.mscale_all_dim) if s.mscale_all_dim else 1.0


def mla_fields(m: ModelConfig) -> dict[str, Any]:
    """The values of the fields MLA declares, as set on ``m.attention`` (defaults when unset)."""
    return {name: getattr(m.attention, name) for name in MultiHeadLatentAttention.fields}


@ATTENTION.register("mla")
class MultiHeadLatentAttention(Attention):
    """Multi-head latent attention: k and v expanded from a cached low-rank latent plus one
    shared RoPE key (DeepSeek-AI 2024, DeepSeek-V2 sec. 2.1); caches (c + r) numbers a token.

    Fields (``model.attention``): ``kv_lora_rank`` c; ``q_lora_rank`` c' (0: a plain q
    projection); ``qk_nope_head_dim`` n and ``v_head_dim`` dv (0: head_dim);
    ``qk_rope_head_dim`` r (0: the RoPE's rotated channels; if set, it must equal them);
    ``absorb`` (attention over the latent, W_UK folded into q and W_UV after the softmax);
    ``softmax_mscale`` (DeepSeek-V2/V3 with YaRN: the 1/sqrt(n + r) softmax scale times
    :func:`softmax_mscale` squared, so the scores' temperature follows the context extension).
    """

    keep_float = ("kv_b_proj",)  # lmlab.nn.quant leaves it float (absorb reads its weight)

    fields = {
        "kv_lora_rank": (int, 32),
        "q_lora_rank": (int, 0),
        "qk_nope_head_dim": (int, 0),
        "qk_rope_head_dim": (int, 0),
        "v_head_dim": (int, 0),
        "absorb": (bool, False),
        "softmax_mscale": (bool, False),
    }
    examples: tuple[dict, ...] = (
        {},
        {"attention": {"absorb": True}},
        {
            "attention": {
                "q_lora_rank": 12,
                "kv_lora_rank": 20,
                "qk_nope_head_dim": 6,
                "v_head_dim": 5,
                "absorb": True,
            },
            "position": {"interleaved": True},
        },
        {
            "attention": {"softmax_mscale": True},
            "position": {
                "scaling": {
                    "kind": "yarn",
                    "factor": 4.0,
                    "original_max_seq_len": 8,
                    "mscale": 1.0,
                    "mscale_all_dim": 0.5,
                }
            },
        },
        {"attention": {"mask": "sliding_window", "window": 4}},
        {"attention": {"backend": "math", "absorb": True, "mask": "sliding_window", "window": 4}},
        {"attention": {"absorb": True, "mask": "streaming", "window": 6, "sink_tokens": 2}},
    )

    @classmethod
    def check(cls, m: ModelConfig) -> None:
        """Positive sizes; a RoPE position kind rotating exactly qk_rope_head_dim channels; no
        kv heads, QK-norm or V-norm (the latent has one expansion per head)."""
        a, f = m.attention, mla_fields(m)
        for name in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"):
            low = 1 if name == "kv_lora_rank" else 0
            if f[name] < low:
                raise ConfigError(f"model.attention.{name} must be >= {low}, got {f[name]}")
        if f["v_head_dim"] < 0:
            raise ConfigError(f"model.attention.v_head_dim must be >= 0, got {f['v_head_dim']}")
        pos = POSITION.get(m.position.kind, "model.position.kind")
        if not issubclass(pos, RotaryPosition):
            raise ConfigError(
                "model.attention.kind=mla rotates a decoupled part of q and k: it needs a RoPE "
                f"model.position.kind (rope), not {m.position.kind}"
            )
        rotated = rotary_dim(m.head_dim, m.position.partial_rotary_factor)
        r = f["qk_rope_head_dim"]
        if r and r != rotated:
            raise ConfigError(
                f"model.attention.qk_rope_head_dim ({r}) must equal the RoPE's rotated "
                f"channels int(head_dim * partial_rotary_factor) = {rotated}: set "
                f"model.attention.head_dim: {r} (HF DeepSeek's head_dim)"
            )
        if a.n_kv_heads not in (None, a.n_heads):
            raise ConfigError(
                "model.attention.n_kv_heads does not apply to kind=mla: every head's k and v "
                "come from one shared latent (set kv_lora_rank instead)"
            )
        for name in ("qk_norm", "v_norm"):
            if getattr(a, name):
                raise ConfigError(f"model.attention.{name} is not supported by kind=mla")
        s = m.position.scaling
        if f["softmax_mscale"] and not (s.kind == "yarn" and s.mscale_all_dim):
            raise ConfigError(
                "model.attention.softmax_mscale multiplies the softmax scale by "
                "yarn_mscale(factor, mscale_all_dim)^2: it needs model.position.scaling.kind="
                f"yarn with mscale_all_dim set (got kind={s.kind}, "
                f"mscale_all_dim={s.mscale_all_dim})"
            )

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        nn.Module.__init__(self)  # not Attention's: its q/k/v projections are not MLA's
        a = cfg.attention
        if a.qk_norm or a.v_norm:  # a block that switches them on (hybrid) after validation
            raise ConfigError("model.attention.kind=mla has no per-head q/k/v norms (qk_norm)")
        self.dims = dims = MLADims.of(cfg)
        h, c, n, r, dv = a.n_heads, dims.kv_lora_rank, dims.nope, dims.rope, dims.v
        self.n_heads = self.n_kv_heads = h  # keys and values are expanded per head
        self.head_dim = n + r  # q and k; v has dv
        self.absorb = dims.absorb
        self.dropout = a.dropout
        self.scale = (n + r) ** -0.5 if a.scaled else 1.0
        if mla_fields(cfg)["softmax_mscale"]:  # DeepSeek-V2/V3 with YaRN
            self.scale *= softmax_mscale(cfg) ** 2
        self.backend = a.backend
        self.backend_fn = ATTENTION_BACKENDS.get(a.backend, "model.attention.backend")
        self.mask_fn = bound_mask(cfg)  # streaming and local_global bound to their fields
        self.window = a.window
        d = cfg.d_model
        out_bias = a.bias if a.out_bias is None else a.out_bias
        self.q_proj: nn.Linear | None = None  # type: ignore[assignment]
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if dims.q_lora_rank:
            self.q_a_proj = nn.Linear(d, dims.q_lora_rank, bias=a.bias)
            self.q_a_layernorm = RMSNorm(cfg, dim=dims.q_lora_rank)
            self.q_b_proj = nn.Linear(dims.q_lora_rank, h * (n + r), bias=False)
        else:
            self.q_proj = nn.Linear(d, h * (n + r), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, c + r, bias=a.bias)  # [W_DKV; W_KR]
        self.kv_a_layernorm = RMSNorm(cfg, dim=c)
        self.kv_b_proj = nn.Linear(c, h * (n + dv), bias=False)  # [W_UK; W_UV] per head
        self.o_proj = nn.Linear(h * dv, d, bias=out_bias)
        self.o_proj.is_residual_proj = True  # type: ignore[assignment]
        # hook points (lmlab.hooks); q/k/v are the expanded per-head tensors (absorb: false)
        self.hook_q = HookPoint()  # (B, H, T, n + r)
        self.hook_k = HookPoint()  # (B, H, S, n + r) over cached + new keys
        self.hook_v = HookPoint()  # (B, H, S, dv)
        self.hook_scores = HookPoint()  # (B, H, T, S)
        self.hook_pattern = HookPoint()  # (B, H, T, S)
        self.hook_z = HookPoint()  # (B, H, T, dv) per-head output before o_proj
        self.hook_out = HookPoint()  # (B, T, D)

    # The latent cache is softmax attention's layer cache (dynamic, bounded by a sliding window,
    # every key kept for a mask that reads them all, or the StreamingLLM cache, which evicts
    # latents as it evicts keys), holding c_KV (B, 1, S, c) in its ``k`` slot and the rotated
    # k_R (B, 1, S, r) in ``v``; forward reaches it only through Attention.cached_keys.
    new_cache = SoftmaxAttention.new_cache
    streams = True

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, D) -> q (B, H, T, n + r), before RoPE."""
        b, t, _ = x.shape
        if self.q_proj is not None:
            q = linear(self.q_proj, x)
        else:
            assert self.q_a_proj and self.q_a_layernorm and self.q_b_proj
            q = linear(self.q_b_proj, self.q_a_layernorm(linear(self.q_a_proj, x)))
        return q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)

    def latent(
        self, x: torch.Tensor, q_rope: torch.Tensor, position: PositionEncoding, positions
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, D) -> (rotated q_rope (B, H, T, r), c_KV (B, 1, T, c), rotated k_R
        (B, 1, T, r)): what the cache stores."""
        b, t, _ = x.shape
        c, r = self.dims.kv_lora_rank, self.dims.rope
        ckv, k_rope = linear(self.kv_a_proj_with_mqa, x).split([c, r], dim=-1)
        ckv = self.kv_a_layernorm(ckv).view(b, 1, t, c)
        q_rope, k_rope = position.rotate(q_rope, k_rope.view(b, 1, t, r), positions)
        return q_rope, ckv, k_rope

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight split per head: W_UK (H, n, c) and W_UV (H, dv, c)."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.dims.nope + self.dims.v, -1)
        return w[:, : self.dims.nope], w[:, self.dims.nope :]

    def forward(
        self,
        x: torch.Tensor,
        position: PositionEncoding,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        cache: LayerKVCache | SlidingWindowKVCache | None = None,
    ) -> AttentionOutput:
        """x (B, T, D) at ``positions`` (T,) or (B, T) -> AttentionOutput(out (B, T, D)), the
        weights (B, H, T, S) through ``hook_pattern``; arguments as
        :meth:`SoftmaxAttention.forward`, the cache one of :meth:`new_cache` (extended in place
        with the new latents)."""
        b, t, _ = x.shape
        h, n, dv = self.n_heads, self.dims.nope, self.dims.v
        q_nope, q_rope = self.query(x).split([n, self.dims.rope], dim=-1)
        q_rope, ckv, k_rope = self.latent(x, q_rope, position, positions)
        c = self.cached_keys(ckv, k_rope, positions, key_mask, cache)  # the latents, evicted too
        ckv, k_rope = c.k, c.v  # (B, 1, S, c), (B, 1, S, r)
        s = ckv.shape[2]
        bias = position.score_bias(positions, s)  # None for RoPE kinds
        w_uk, w_uv = self.up_weights()
        core = dict(backend=self.backend_fn, scale=self.scale, mask_fn=c.mask_fn)
        core["hooks"] = (self.hook_scores, self.hook_pattern)
        core.update(window=self.window, key_mask=c.key_mask, bias=bias, dropout_p=self.dropout_p)
        if self.absorb:  # q_C W_UK . c_KV + q_R . k_R over one shared latent "kv head"
            q_lat = torch.einsum("bhtn,hnc->bhtc", q_nope, w_uk)  # (B, H, T, c)
            q = torch.cat([q_lat, q_rope], dim=-1)  # (B, H, T, c + r)
            k = torch.cat([ckv, k_rope], dim=-1)  # (B, 1, S, c + r)
            y_lat, _ = attend(q, k, ckv, n_rep=h, **core)  # type: ignore[arg-type]
            y = torch.einsum("bhtc,hvc->bhtv", y_lat, w_uv)  # (B, H, T, dv)
        else:  # expand every cached latent: k_C, v_C (B, H, S, n), (B, H, S, dv)
            kv = linear(self.kv_b_proj, ckv.squeeze(1)).view(b, s, h, n + dv).transpose(1, 2)
            k_nope, v = kv.split([n, dv], dim=-1)
            k = torch.cat([k_nope, k_rope.expand(-1, h, -1, -1)], dim=-1)  # (B, H, S, n + r)
            q = torch.cat([q_nope, q_rope], dim=-1)  # (B, H, T, n + r)
            q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
            y, _ = attend(q, k, v, n_rep=1, **core)  # type: ignore[arg-type]
        y = self.hook_z(y)
        out = self.hook_out(linear(self.o_proj, y.transpose(1, 2).reshape(b, t, h * dv)))
        return AttentionOutput(out)

    def saved_norm_elements(self) -> int:
        """Elements per token autograd keeps for the latent norms (lmlab.training.memory): the
        kv_a_proj output (c + r), the normalised latent and the norm's output, 2 c, and 3 c' of
        the q norm."""
        d = self.dims
        return d.kv_lora_rank + d.rope + 2 * d.kv_lora_rank + 3 * d.q_lora_rank

    def saved_projection_elements(self) -> int:
        """Elements per token autograd keeps of q, k, v, the attention output and o_proj's input
        (lmlab.training.memory; softmax's (3 H + 2 K) hd), plus the rotation's cos/sin and the
        softmax's log-sum-exp. Expanded: q and k H (n + r) each, the kv_b_proj output v lives in
        H (n + dv), the output and o_proj's input H dv each. Absorbed: q_C H (n + r), the
        latent query H (c + r), the latent keys and values repeated per head H (c + r) and H c,
        the latent output H c (the einsum keeps it once more), o_proj's input H dv."""
        d, h = self.dims, self.n_heads
        if self.absorb:
            per_head = d.nope + d.rope + 2 * (d.kv_lora_rank + d.rope) + 2 * d.kv_lora_rank + d.v
        else:
            per_head = 2 * (d.nope + d.rope) + d.nope + 2 * d.v
        return h * per_head + h + d.rope

    # ------------------------------------------------------------------ declared costs

    @classmethod
    def cached_tokens(cls, cfg: ModelConfig, context: int) -> int:
        """Tokens held while decoding token ``context``: softmax attention's cache's (all, or at
        most ``window`` with a sliding window)."""
        return SoftmaxAttention.cached_tokens(cfg, context)

    @classmethod
    def kv_cache_bytes_per_token(cls, cfg: ModelConfig, dtype_bytes: int = 4) -> int:
        """Bytes one token adds to this layer's cache: c_KV and k_R, (c + r) dtype_bytes."""
        d = MLADims.of(cfg)
        return (d.kv_lora_rank + d.rope) * dtype_bytes

    @classmethod
    def kv_cache_bytes(
        cls, cfg: ModelConfig, batch: int, context: int, dtype_bytes: int = 4
    ) -> int:
        """batch * :meth:`cached_tokens` * :meth:`kv_cache_bytes_per_token`."""
        per_token = cls.kv_cache_bytes_per_token(cfg, dtype_bytes)
        return batch * cls.cached_tokens(cfg, context) * per_token

    @classmethod
    def score_flops_per_token(cls, cfg: ModelConfig, seq_len: int) -> int:
        """FLOPs per query token besides the weights, against ``seq_len`` keys: QK^T and AV,
        2 T H (n + r) + 2 T H dv expanded; over the latent (absorb) 2 T H (c + r) + 2 T H c
        (the absorbed W_UK, W_UV products cost what kv_b_proj costs, counted as weights)."""
        d, h = MLADims.of(cfg), cfg.attention.n_heads
        if d.absorb:
            return 2 * seq_len * h * (2 * d.kv_lora_rank + d.rope)
        return 2 * seq_len * h * (d.nope + d.rope + d.v)

    @classmethod
    def saved_score_elements(cls, cfg: ModelConfig, seq_len: int) -> int:
        """Score elements per query token autograd keeps: 2 H T on ``math``, 0 for sdpa."""
        return 2 * cfg.attention.n_heads * seq_len if cfg.attention.backend == "math" else 0
