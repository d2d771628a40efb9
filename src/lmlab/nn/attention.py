"""Self-attention: ``softmax(Q K^T / sqrt(d_k)) V`` (Vaswani et al. 2017), and linear attention.

Legend: B batch, T query tokens, S key tokens (cache + T), D d_model, H heads, K kv heads,
hd head_dim. Masks are bool with True = may attend; which keys a query sees is the registered
mask ``model.attention.mask`` (causal, bidirectional, sliding_window; see :mod:`lmlab.nn.masks`),
intersected with the caller's key padding mask.

Softmax kinds call the one attention core :func:`~lmlab.nn.attention_core.attend` (masks, GQA,
padding, score bias) with the backend ``model.attention.backend`` names in
:data:`~lmlab.nn.attention_core.ATTENTION_BACKENDS`: ``sdpa`` calls
:func:`torch.nn.functional.scaled_dot_product_attention` (fused, fast, no weights); ``math`` spells
the formula out and can return the attention weights for visualisation. Grouped-query
attention (Ainslie et al. 2023) shares each of the K key/value heads among H/K query heads;
K == H is multi-head attention, K == 1 multi-query attention (Shazeer 2019). Options on both
kinds: ``qk_norm`` (RMSNorm of each q and k head), ``scaled`` (False drops the 1/sqrt(d_k)
factor), attention ``dropout``, per-projection bias (``bias``, ``out_bias``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.errors import ConfigError, LmlabError
from lmlab.nn.attention_core import (  # noqa: F401  (re-exported from their old home)
    ATTENTION_BACKENDS,
    SDPA_GQA,
    AttentionFn,
    attend,
    attention_math,
    attention_sdpa,
    repeat_kv,
)
from lmlab.nn.fused import fusable_linears, fused_linear, global_hooks, linear, training_forward
from lmlab.nn.hooks import HookPoint
from lmlab.nn.kv_cache import LayerCache, LayerKVCache, LinearAttentionState, SlidingWindowKVCache
from lmlab.nn.masks import MASKS, MaskFn, causal_mask
from lmlab.nn.norm import RMSNorm
from lmlab.nn.position import PositionEncoding as PositionEncodingBase
from lmlab.nn.position import RotaryPosition
from lmlab.registry import Registry

if TYPE_CHECKING:
    from lmlab.config import ModelConfig
    from lmlab.nn.position import PositionEncoding

# Training (gradients on): q, k and v as one matmul over their weights concatenated in the graph
# (Attention.train_fused_qkv_weights); False runs the three projections (for A/B benchmarks).
TRAIN_FUSED_QKV = True
# bf16 CPU training with RoPE: the fused causal attention reads that matmul's output as it is and
# rotates q and k itself (SoftmaxAttention.fused_rope_attention); False splits and rotates
# first (lmlab.nn.rope_kernel.rope_split), then attends (A/B benchmarks: train_step_ab.py
# --rope-attention).
TRAIN_ROPE_ATTENTION = True
_LOW_PRECISION = (torch.bfloat16, torch.float16)

ATTENTION: Registry[type[nn.Module]] = Registry("attention", "model.attention.kind")
ATTENTION.notes = """
When to use: `softmax`, softmax(QK^T/sqrt(d_k))V, is the default (Vaswani et al. 2017);
`model.attention.n_kv_heads` < `n_heads` gives grouped-query attention (GQA, Ainslie et al.
2023) and 1 gives multi-query attention (MQA, Shazeer 2019), to shrink the KV cache at little
quality cost. `linear` is for very long sequences, and to see attention as an RNN: a
constant-size recurrent state when decoding.

Options every kind reads:

- `model.attention.qk_norm: true`: RMSNorm on each q and k head before RoPE (Dehghani et al.
  2023; Qwen3); stable training at high learning rates.
- `model.attention.scaled: false`: drops the 1/sqrt(d_k) factor (Vaswani et al. 2017, 3.2.1);
  the tutorial's experiment on why the scale exists.
- `model.attention.bias`, `out_bias`: biases on q/k/v and, separately, o (Qwen2, Yang et al.
  2024); loading Qwen2 weights.
- `model.attention.dropout`: dropout on the attention weights in training (Srivastava et al.
  2014); small-data regularisation.
- `model.attention.backend`: `sdpa` is PyTorch's fused kernel; `math` spells the formula out and
  returns attention weights (its softmax runs in float32, or float64 for a float64 model); use
  `math` to look at attention maps.

KV cache (follows the mask, no field of its own): dynamic (grows with the sequence), sliding
(`sliding_window`: keeps the last window-1 tokens) or recurrent (linear attention's fixed-size
state). `KVCache.nbytes()` reports its bytes.
"""


@dataclass
class AttentionOutput:
    """What an attention forward returns: out (B, T, D). Its attention map is not returned:
    it is what the layer's ``hook_pattern`` sees (:meth:`Attention.map_points`)."""

    out: torch.Tensor  # (B, T, D)


@dataclass
class CachedKeys:
    """What one call attends over (:meth:`Attention.cached_keys`): the cached keys and values
    followed by the new ones, k and v (B, K', S, d) (any K' and d: MLA caches its latent and its
    RoPE key in these slots), the structural mask function of this call (bool, True = may
    attend; None: none), the key mask (B, S' >= S) bool, True = a real key, and the keys'
    absolute positions (B, S) int64 (-1 = an empty slot or padding) when the slots are not the
    contiguous positions seq_len - S .. seq_len - 1 (a streaming cache), else None."""

    k: torch.Tensor
    v: torch.Tensor
    mask_fn: MaskFn | None
    key_mask: torch.Tensor | None
    positions: torch.Tensor | None = None


def _norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)``, skipping the module call of an ``nn.Identity`` (no QK-norm)."""
    return x if type(norm) is nn.Identity else norm(x)


def bound_mask(cfg: ModelConfig) -> MaskFn:
    """The mask function of ``model.attention.mask`` for ``cfg``: a mask with fields of its own
    is bound to them once (streaming: its window and sink tokens; local_global: its global
    tokens)."""
    mask = MASKS.get(cfg.attention.mask, "model.attention.mask")
    bind = getattr(mask, "from_config", None) or getattr(mask, "bind", None)
    return bind(cfg) if bind is not None else mask


class Attention(nn.Module):
    """What both attention kinds share: q/k/v/o projections, optional QK-norm, the mask.

    Subclasses implement ``forward(x, position, positions, key_mask=None, cache=None) ->
    AttentionOutput`` and ``new_cache()`` (their per-layer decoding state). Their attention map
    is what their ``hook_pattern`` point sees (the attention core calls it on the weights of
    :meth:`attend`); a model's ``need_weights=True`` records it (:meth:`map_points`,
    :meth:`attention_map`), so a forward takes no flag for it.

    ``streams``: whether the kind runs with ``model.attention.mask: streaming`` (the StreamingLLM
    cache, :mod:`lmlab.nn.sinks`). A kind declares ``streams = True`` when its forward attends
    over per-token cached keys and reaches them only through :meth:`cached_keys` (the one step
    that appends to the cache and returns what to attend to, with its mask); otherwise
    ``streams_refusal`` says why it cannot (the validation message quotes it).
    """

    streams: bool = False
    streams_refusal = "its forward does not read its keys through Attention.cached_keys"

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        a = cfg.attention
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.dropout = a.dropout
        self.scale = 1.0 / math.sqrt(self.head_dim) if a.scaled else 1.0  # softmax kinds
        self.backend = a.backend  # the name; backend_fn is the function it selects
        self.backend_fn = ATTENTION_BACKENDS.get(a.backend, "model.attention.backend")
        self.mask_fn = bound_mask(cfg)
        self.window = a.window  # tokens a query sees (itself included); sliding_window only
        d, hd = cfg.d_model, self.head_dim
        out_bias = a.bias if a.out_bias is None else a.out_bias
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=a.bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=a.bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=a.bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=out_bias)
        self.o_proj.is_residual_proj = True  # type: ignore[assignment]
        # QK-norm: RMSNorm over each head's hd channels of q and k, before RoPE (Dehghani et al.
        # 2023, ViT-22B; as in Qwen3). Bounds the logits q.k, which stabilises training.
        self.q_norm = RMSNorm(cfg, dim=hd) if a.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg, dim=hd) if a.qk_norm else nn.Identity()
        # v_norm: the same on each v head; with qk_norm, HybridNorm's QKV-norm (Zhuo et al. 2025).
        self.v_norm = RMSNorm(cfg, dim=hd) if a.v_norm else nn.Identity()
        # named hook points (lmlab.hooks): identities costing one check when unhooked
        self.hook_q = HookPoint()  # (B, H, T, hd) after QK-norm and rotation
        self.hook_k = HookPoint()  # (B, K, T, hd) the new tokens' keys, before the cache
        self.hook_v = HookPoint()  # (B, K, T, hd)
        self.hook_scores = HookPoint()  # (B, H, T, S) masked pre-softmax scores
        self.hook_pattern = HookPoint()  # (B, H, T, S) attention weights
        self.hook_z = HookPoint()  # (B, H, T, hd) per-head output before o_proj
        self.hook_out = HookPoint()  # (B, T, D) o_proj output

    @property
    def dropout_p(self) -> float:
        """The attention-weight dropout probability of this call: 0 in eval mode."""
        return self.dropout if self.training else 0.0

    def project(
        self, x: torch.Tensor, position: PositionEncoding, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, D) -> q (B, H, T, hd), k and v (B, K, T, hd), q and k normalised (QK-norm)
        and rotated to ``positions`` (T,) or (B, T)."""
        b, t, _ = x.shape
        h, kv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = fused_linear(self, "qkv", ("q_proj", "k_proj", "v_proj"), x)
        if qkv is None:
            fused = self.train_fused_qkv_weights(x)
            joint = fused is not None and self.joint_rotation(position)
            if joint and isinstance(position, RotaryPosition) and position.split_kernel_ready():
                # training, no head norms, RoPE: lmlab's kernel splits, adds the bias and rotates
                # in one call each way (the matmul runs bias-free)
                weight, bias = fused  # type: ignore[misc]
                qkv = F.linear(x, weight).view(b, t, h + 2 * kv, hd)
                split = position.rotate_split(qkv, h, kv, positions, bias)
                if split is not None:
                    q, k, v = split
                    return self.hook_q(q), self.hook_k(k), self.hook_v(v)
                qkv = (
                    qkv.view(b, t, -1) if bias is None else qkv.view(b, t, -1) + bias.to(qkv.dtype)
                )
            elif fused is not None:
                qkv = F.linear(x, *fused)
            if qkv is not None and joint:
                # training, no head norms, RoPE or none: q and k rotate as one tensor
                qk, v = qkv.view(b, t, h + 2 * kv, hd).split([h + kv, kv], dim=2)
                qk = qk.transpose(1, 2)  # (B, H + K, T, hd)
                if isinstance(position, RotaryPosition):
                    qk = position.rotate_heads(qk, positions)
                q, k = qk.split([h, kv], dim=1)
                return self.hook_q(q), self.hook_k(k), self.hook_v(v.transpose(1, 2))
        if qkv is not None:  # one matmul (inference: lmlab.nn.fused; training: above)
            q, k, v = qkv.view(b, t, h + 2 * kv, hd).split([h, kv, kv], dim=2)
        else:
            q = linear(self.q_proj, x).view(b, t, h, hd)
            k = linear(self.k_proj, x).view(b, t, kv, hd)
            v = linear(self.v_proj, x).view(b, t, kv, hd)
        q = _norm(self.q_norm, q).transpose(1, 2)  # (B, H, T, hd)
        k = _norm(self.k_norm, k).transpose(1, 2)  # (B, K, T, hd)
        v = _norm(self.v_norm, v).transpose(1, 2)
        q, k = position.rotate(q, k, positions)  # q (B, H, T, hd), k (B, K, T, hd)
        return self.hook_q(q), self.hook_k(k), self.hook_v(v)

    def train_fused_qkv_weights(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The q, k and v weights concatenated ((H + 2 K) hd, D) and their biases ((H + 2 K)
        hd,) or None, inside the autograd graph (their gradients flow back to ``q_proj`` /
        ``k_proj`` / ``v_proj``, whose parameters and names stay), for one matmul over x (B, T,
        D): while gradients are recorded (training) in bf16/fp16 or under autocast, when
        :data:`TRAIN_FUSED_QKV` is on and the three are plain linears with biases on all or none
        (:func:`~lmlab.nn.fused.fusable_linears`, no global module hooks), not under
        torch.compile. None otherwise (the caller runs the three). Under bf16 autocast the input
        and the weights are cast once instead of three times, and the input's gradient is one
        matmul instead of three summed."""
        if not TRAIN_FUSED_QKV or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None
        if not (x.dtype in _LOW_PRECISION or torch.is_autocast_enabled(x.device.type)):
            return None  # float32 training: no casts to save, and its bits stay the unfused ones
        mods = [self._modules["q_proj"], self._modules["k_proj"], self._modules["v_proj"]]
        if global_hooks() or not fusable_linears(mods):  # type: ignore[arg-type]
            return None
        weights = [m._parameters["weight"] for m in mods]  # type: ignore[union-attr]
        biases = [m._parameters["bias"] for m in mods]  # type: ignore[union-attr]
        bias = None if biases[0] is None else torch.cat(biases)  # type: ignore[arg-type]
        return torch.cat(weights), bias  # type: ignore[arg-type]

    def joint_rotation(self, position: PositionEncoding) -> bool:
        """Whether q and k may rotate as one tensor: no q/k/v norms, and a position kind whose
        rotate is RoPE's (the same angles for every head) or none at all."""
        norms = (self.q_norm, self.k_norm, self.v_norm)
        kind = type(position).rotate
        rotary = kind is RotaryPosition.rotate or kind is PositionEncodingBase.rotate
        return rotary and all(type(n) is nn.Identity for n in norms)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask_fn: MaskFn | None,
        key_mask: torch.Tensor | None,
        bias: torch.Tensor | None,
        hooks: tuple[HookPoint, HookPoint] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q (B, H, T, hd), k and v (B, K, S, hd) -> (y (B, H, T, hd), weights (B, H, T, S) or
        None): :func:`~lmlab.nn.attention_core.attend` with this module's backend, scale, GQA
        ratio, window and dropout; ``mask_fn`` None for no structural mask. ``hooks``: the
        (scores, pattern) hook points of this call, default this layer's ``hook_scores`` and
        ``hook_pattern``."""
        return attend(
            q,
            k,
            v,
            backend=self.backend_fn,
            scale=self.scale,
            n_rep=self.n_heads // self.n_kv_heads,
            mask_fn=mask_fn,
            window=self.window,
            key_mask=key_mask,
            bias=bias,
            dropout_p=self.dropout_p,
            hooks=(self.hook_scores, self.hook_pattern) if hooks is None else hooks,
        )

    def map_points(self, cache: LayerCache | None) -> tuple[HookPoint, ...]:
        """The hook points whose tensors make this layer's attention map for a model forward
        with ``need_weights=True`` and this layer's ``cache`` (the model records them for that
        call; :meth:`attention_map` joins them): ``hook_pattern``. A kind without one map for
        the call raises LmlabError here, before the forward runs."""
        return (self.hook_pattern,)

    def attention_map(self, recorded: list[torch.Tensor]) -> torch.Tensor:
        """What each of :meth:`map_points` saw in one forward -> this layer's attention map
        (B, H, T, S), the ``attentions`` entry of the model's output: the pattern itself."""
        return recorded[0]

    def cached_keys(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None,
        cache: LayerCache | None,
    ) -> CachedKeys:
        """The one "cached keys" step of every attention forward that attends over cached keys:
        the new keys and values (B, K', T, d) at ``positions`` (T,) or (B, T) are appended to
        ``cache`` (None: no cache) and what this call attends over comes back as
        :class:`CachedKeys`, with the structural mask of the call (:meth:`structure`) and the
        key mask (``key_mask`` (B, S_total) bool, True = real token, or None).

        A mask kind with its own cache (``keys``: streaming, which evicts keys and so builds
        its mask on their positions) handles both; otherwise ``cache.update(k, v)``."""
        hook = getattr(self.mask_fn, "keys", None)
        if hook is not None:
            return hook(k, v, positions, key_mask, cache)
        if cache is not None:
            k, v = cache.update(k, v)  # type: ignore[attr-defined]  # (B, K', S, d)
        return CachedKeys(k, v, self.structure(key_mask), key_mask)

    def structure(self, key_mask: torch.Tensor | None, mask_fn: MaskFn | None = None) -> MaskFn:
        """The structural mask function of one call (``mask_fn``, default this layer's): a mask
        over real-token positions (one with a ``padded`` method, local_global) given the key
        padding mask (B, S); others as is."""
        mask_fn = self.mask_fn if mask_fn is None else mask_fn
        padded = getattr(mask_fn, "padded", None)
        return mask_fn if padded is None or key_mask is None else padded(key_mask)

    def merge_heads(self, y: torch.Tensor) -> torch.Tensor:
        """(B, H, T, hd) -> o_proj of (B, T, H*hd) -> (B, T, D) (through the hook points
        ``hook_z`` and ``hook_out``)."""
        y = self.hook_z(y)
        b, _, t, _ = y.shape
        out = linear(self.o_proj, y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
        return self.hook_out(out)

    def saved_norm_elements(self) -> int:
        """Elements per token autograd keeps for the head norms this layer has (QK-norm,
        V-norm, HybridNorm's QKV-norm): each norm's output, H hd for q and K hd for k and v
        (lmlab.training.memory; 0 without them)."""
        sizes = [(self.q_norm, self.n_heads), (self.k_norm, self.n_kv_heads)]
        sizes.append((self.v_norm, self.n_kv_heads))
        return sum(n * self.head_dim for norm, n in sizes if not isinstance(norm, nn.Identity))

    # ------------------------------------------------------------------ declared costs
    # What a module cannot show by its weights, per layer, for a ModelConfig (read by
    # lmlab.analysis.costs; parameters and matmul FLOPs are counted from the module itself).
    # Every kind here computes QK^T and AV and caches a key and a value per token unless it
    # says otherwise; a kind also declares kv_cache_bytes (and cached_tokens) for its cache.

    @classmethod
    def kv_cache_bytes_per_token(cls, cfg: ModelConfig, dtype_bytes: int = 4) -> int:
        """Bytes one token adds to this layer's cache: its key and value, 2 K hd dtype_bytes
        (with a sliding window, until the cache holds the window)."""
        return 2 * cfg.n_kv_heads * cfg.head_dim * dtype_bytes

    @classmethod
    def score_flops_per_token(cls, cfg: ModelConfig, seq_len: int) -> int:
        """FLOPs per query token and layer besides the weights: QK^T and AV against ``seq_len``
        keys, 4 T H hd (2 per multiply-add; PaLM, Chowdhery et al. 2022, app. B). Every T x T
        score is computed and then masked, so the mask does not change it (linear attention's
        parallel form: phi(Q) phi(K)^T and its product with V, the same count), except a mask
        with a sparse path (:meth:`sparse_mask_cost`), which declares its own."""
        own = cls.sparse_mask_cost(cfg, "score_flops_per_token", seq_len)
        return 4 * seq_len * cfg.attention.n_heads * cfg.head_dim if own is None else own

    sparse_mask_path = False  # whether the attention core's mask sparse path runs (softmax)

    @classmethod
    def sparse_mask_cost(cls, cfg: ModelConfig, name: str, seq_len: int) -> int | None:
        """The mask's own cost ``name`` (local_global's ``score_flops_per_token`` /
        ``saved_score_elements``) where its sparse path computes this kind's attention: a kind
        with ``sparse_mask_path`` (a softmax backend) and a position that adds no score bias;
        None otherwise, or where the mask declares none or its path does not run."""
        from lmlab.nn.position import POSITION, PositionEncoding

        own = getattr(MASKS.get(cfg.attention.mask), name, None)
        position = POSITION.get(cfg.position.kind)
        if (
            own is None
            or not cls.sparse_mask_path
            or (
                position.score_bias is not PositionEncoding.score_bias  # ALiBi, T5: dense
            )
        ):
            return None
        return own(cfg, seq_len)


@ATTENTION.register("softmax")
class SoftmaxAttention(Attention):
    """Scaled dot-product attention with separate q/k/v/o projections; MHA, GQA or MQA."""

    streams = True  # its keys go through cached_keys (a subclass with another forward: check)
    sparse_mask_path = True  # a softmax backend: a mask's sparse path computes its attention

    examples: tuple[dict, ...] = (
        {},
        {"attention": {"n_kv_heads": 2}},
        {"attention": {"n_kv_heads": 1}},
        {"attention": {"backend": "math"}},
        {"attention": {"qk_norm": True}},
        {"attention": {"scaled": False}},
    )

    def new_cache(self) -> LayerKVCache | SlidingWindowKVCache:
        """A dynamic cache, or a bounded one when a sliding window limits what a query sees; the
        mask kind's own cache when it has one (streaming), the full one when it reads every key
        (local_global: a global key is read by every later query)."""
        if hasattr(self.mask_fn, "new_cache"):
            return self.mask_fn.new_cache()
        if self.window is None or getattr(self.mask_fn, "keeps_all_keys", False):
            return LayerKVCache()
        return SlidingWindowKVCache(self.window)

    def forward(
        self,
        x: torch.Tensor,
        position: PositionEncoding,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        cache: LayerKVCache | SlidingWindowKVCache | None = None,
    ) -> AttentionOutput:
        """x (B, T, D) at absolute ``positions`` (T,) or (B, T) -> AttentionOutput(out (B, T, D));
        the weights (B, H, T, S) go through ``hook_pattern``.

        ``key_mask`` (B, S_total) bool, True = real token, covers every token seen so far
        (cached + new); padding keys are never attended to, and a query with no key to attend to
        outputs 0. ``cache`` (if given) holds the keys/values of earlier tokens and is extended in
        place.
        """
        y = None
        if cache is None and key_mask is None:
            y = self.fused_rope_attention(x, position, positions)
        if y is None:
            q, k, v = self.project(x, position, positions)
            c = self.cached_keys(k, v, positions, key_mask, cache)  # k, v (B, K, S, hd)
            bias = position.score_bias(positions, c.k.shape[2])  # (H, T, S) or None
            y, _ = self.attend(q, c.k, c.v, c.mask_fn, c.key_mask, bias)
        return AttentionOutput(self.merge_heads(y))

    def fused_rope_attention(
        self, x: torch.Tensor, position: PositionEncoding, positions: torch.Tensor
    ) -> torch.Tensor | None:
        """x (B, T, D) -> y (B, H, T, hd) (a view of a (B, T, H, hd) tensor) in one operator
        call after the fused q/k/v matmul: torch.ops.lmlab.rope_causal_attention_bf16 rotates q
        and k of the matmul's output (B, T, H + 2 K, hd) in one pass into one tensor (v copied),
        attends over its strided heads, and its backward writes the gradient of that output
        itself, dq and dk rotated back as they are written: what :meth:`project`'s RoPE split
        kernel and :meth:`attend`'s fused causal attention compute, the same bits, without the
        split's three tensors and its own pass backward (step 1.03x at nanoGPT's CPU shape,
        1.00x at the Mini-GPT shape: benchmarks/README.md). None where it does not apply (the
        caller projects and attends): it takes bf16 CPU training with the ``sdpa`` backend (the
        fused attention preferred here, :func:`~lmlab.nn.attention_core.fused_attention_applies`),
        the causal mask without padding or a cache, no dropout, 1 < T <= BMM_CAUSAL_MAX_T, RoPE
        over every channel in the half-split layout with positions shared by the batch,
        head_dim a multiple of 32, no q/k/v bias or head norms, no hook on q, k, v, the scores or
        the pattern, and a class that keeps this module's projection and attention
        (:data:`TRAIN_ROPE_ATTENTION` switches it off)."""
        if not (TRAIN_ROPE_ATTENTION and torch.is_grad_enabled()) or self.dropout_p:
            return None  # training only (inference keeps torch's fused attention)
        if self.backend_fn is not attention_sdpa:
            return None
        if self.mask_fn is not causal_mask or not isinstance(position, RotaryPosition):
            return None
        cls, kind = type(self), type(position)
        if not (
            cls.project is Attention.project
            and cls.attend is Attention.attend
            and cls.cached_keys is Attention.cached_keys
            and kind.score_bias is PositionEncodingBase.score_bias
            and kind.rotate_split is RotaryPosition.rotate_split  # what project would call
        ):
            return None
        if getattr(self.q_proj, "bias", None) is not None:
            return None  # a q/k/v bias: the split path (checked before any weight is joined)
        from lmlab.nn import attention_core, train_kernel

        points = (self.hook_q, self.hook_k, self.hook_v, self.hook_scores, self.hook_pattern)
        b, t, _ = x.shape
        hd = self.head_dim
        if any(p.fns for p in points) or not (1 < t <= attention_core.BMM_CAUSAL_MAX_T):
            return None
        if hd % 32 or not attention_core.fused_attention_takes(hd, hd):
            return None
        if x.device.type != "cpu" or not position.split_kernel_ready():
            return None
        amp = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        if not (x.dtype == torch.bfloat16 or (amp and x.dtype == torch.float32)):
            return None  # the matmul's output would not be bf16
        if not self.joint_rotation(position) or not train_kernel.attention_bf16_preferred():
            return None
        tables = position.shared_tables(positions, torch.bfloat16)
        if tables is None:
            return None
        fused = self.train_fused_qkv_weights(x)
        if fused is None or fused[1] is not None:
            return None
        if not (fused[0].requires_grad or x.requires_grad):
            return None  # nothing to train: the kernel's backward would never run
        training_forward()  # project's fused_linear would have noted it (stale no_grad copies)
        h, kv = self.n_heads, self.n_kv_heads
        qkv = F.linear(x, fused[0]).view(b, t, h + 2 * kv, hd)
        if qkv.dtype != torch.bfloat16:
            return None  # not what autocast was expected to give: the caller's path
        return torch.ops.lmlab.rope_causal_attention_bf16(qkv, *tables, h, kv, self.scale)

    # ------------------------------------------------------------------ declared costs
    # What the module cannot show by its weights: per layer, for a ModelConfig (see
    # lmlab.analysis.costs). Parameters and matmul FLOPs are counted from the module itself.

    @classmethod
    def cached_tokens(cls, cfg: ModelConfig, context: int) -> int:
        """Tokens the cache holds while decoding token ``context``: all of them, or at most
        ``window`` with a sliding window (window - 1 kept between steps + the new one)."""
        own = getattr(MASKS.get(cfg.attention.mask), "cached_tokens", None)  # streaming
        if own is not None:
            return own(cfg, context)
        window = cfg.attention.window if cfg.attention.mask == "sliding_window" else None
        return context if window is None else min(context, window)

    @classmethod
    def kv_cache_bytes(
        cls, cfg: ModelConfig, batch: int, context: int, dtype_bytes: int = 4
    ) -> int:
        """Bytes this layer's cache holds for ``batch`` sequences while decoding token
        ``context``: batch * :meth:`cached_tokens` * :meth:`kv_cache_bytes_per_token` (the
        dynamic cache, or the sliding-window one bounded at ``window`` tokens)."""
        return (
            batch * cls.cached_tokens(cfg, context) * cls.kv_cache_bytes_per_token(cfg, dtype_bytes)
        )

    @classmethod
    def saved_score_elements(cls, cfg: ModelConfig, seq_len: int) -> int:
        """Score elements per query token and layer that autograd keeps for backward: the
        scores and probabilities, 2 H T, on the ``math`` backend; 0 for ``sdpa`` (its fused
        kernels keep one log-sum-exp per row); a mask's sparse path its own count, whatever the
        backend (:meth:`~Attention.sparse_mask_cost`). See :mod:`lmlab.training.memory`."""
        own = cls.sparse_mask_cost(cfg, "saved_score_elements", seq_len)
        if own is not None:
            return own
        return 2 * cfg.attention.n_heads * seq_len if cfg.attention.backend == "math" else 0


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = elu(x) + 1 > 0, the feature map of Katharopoulos et al. 2020 (their eq. 7)."""
    return F.elu(x) + 1.0


@ATTENTION.register("linear")
class LinearAttention(Attention):
    """Linear attention: sim(q, k) = phi(q) . phi(k) with phi = elu + 1, so causal attention is an
    RNN whose state is sum phi(k) v^T (Katharopoulos et al. 2020, "Transformers are RNNs").

    Output i = sum_j phi(q_i).phi(k_j) v_j / sum_j phi(q_i).phi(k_j) over the keys j it sees
    (no softmax, no 1/sqrt(d_k)). Training uses the parallel (masked, T x S) form, which also
    gives the normalised weights; cached decoding uses the recurrent form with a constant-size
    :class:`LinearAttentionState`. Masks: causal or bidirectional (a sliding window has no
    constant-size state). Score biases (ALiBi) cannot apply and raise LmlabError.
    """

    examples: tuple[dict, ...] = ({}, {"attention": {"n_kv_heads": 2}})
    streams_refusal = (
        "its cache is a constant-size recurrent state (sum phi(k) v^T), with no per-token keys "
        "to evict: its memory is already flat at any length"
    )

    @staticmethod
    def check(m: ModelConfig) -> None:
        """A causal or bidirectional mask (streaming is refused by its own check, which quotes
        ``streams_refusal``); no ``scaled: false`` (there is no 1/sqrt(d_k))."""
        if m.attention.mask not in ("causal", "bidirectional", "streaming"):
            raise ConfigError(
                "model.attention.kind=linear supports model.attention.mask causal or "
                f"bidirectional, got {m.attention.mask!r} (a sliding window has no "
                "constant-size recurrent state)"
            )
        if not m.attention.scaled:
            raise ConfigError(
                "model.attention.scaled=false has no effect with model.attention.kind=linear "
                "(linear attention has no 1/sqrt(d_k) factor); remove it or use kind=softmax"
            )

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__(cfg, layer_idx)
        if cfg.attention.mask not in ("causal", "bidirectional"):
            raise ConfigError(
                f"model.attention.kind=linear supports model.attention.mask causal or "
                f"bidirectional, got {cfg.attention.mask!r}"
            )

    def new_cache(self) -> LinearAttentionState:
        """The recurrent state (sum phi(k) v^T, sum phi(k)), empty."""
        return LinearAttentionState()

    def forward(
        self,
        x: torch.Tensor,
        position: PositionEncoding,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> AttentionOutput:
        """x (B, T, D) -> AttentionOutput(out (B, T, D)); the normalised weights over the new
        tokens (B, H, T, T) go through ``hook_pattern``.

        Arguments as :meth:`SoftmaxAttention.forward`; ``cache`` must be a
        :class:`LinearAttentionState` (TypeError otherwise).
        """
        t = x.shape[1]
        if cache is not None and not isinstance(cache, LinearAttentionState):
            raise TypeError(f"linear attention needs a LinearAttentionState, got {type(cache)}")
        past = cache if cache is not None and cache.seq_len > 0 else None
        q, k, v = self.project(x, position, positions)
        if position.score_bias(positions, t + (past.seq_len if past else 0)) is not None:
            raise LmlabError("linear attention has no scores to add a position bias (ALiBi) to")
        fq, fk = elu_feature_map(q), elu_feature_map(k)  # (B, H, T, hd), (B, K, T, hd)
        if key_mask is not None:  # padding keys contribute nothing, now or to the state
            fk = fk * key_mask[:, -t:, None].to(fk.dtype)[:, None]
        rep = self.n_heads // self.n_kv_heads

        # Parallel form over the new tokens: sim (B, H, T, T), zero where the mask forbids.
        sim = torch.matmul(fq, repeat_kv(fk, rep).transpose(-2, -1))
        sim = self.hook_scores(sim.masked_fill(~self.mask_fn(t, t, x.device), 0.0))
        den = sim.sum(-1, keepdim=True)  # (B, H, T, 1)
        past_num = None
        if past is not None:  # recurrent form: the state sums over every earlier token
            assert past.state is not None and past.normalizer is not None
            past_num = torch.matmul(fq, repeat_kv(past.state, rep))  # (B, H, T, hd)
            den = den + torch.matmul(fq, repeat_kv(past.normalizer, rep).unsqueeze(-1))
        den = den.clamp_min(torch.finfo(den.dtype).tiny)  # no visible key: 0 / tiny = 0
        w = self.hook_pattern(sim / den)  # (B, H, T, T) normalised weights over the new tokens
        dropout_p = self.dropout_p
        y = torch.matmul(F.dropout(w, p=dropout_p) if dropout_p else w, repeat_kv(v, rep))
        if past_num is not None:
            y = y + past_num / den
        if cache is not None:
            cache.update(fk, v)
        return AttentionOutput(self.merge_heads(y))

    def map_points(self, cache: LayerCache | None) -> tuple[HookPoint, ...]:
        """``hook_pattern`` (B, H, T, T); with earlier tokens in ``cache`` LmlabError: the state
        keeps no per-key information, so there are no weights over the cached tokens."""
        if cache is not None and cache.seq_len > 0:
            raise LmlabError(
                "linear attention cannot return weights over cached tokens (its state keeps no "
                "per-key information); ask for weights on a forward pass without a cache"
            )
        return (self.hook_pattern,)

    # ------------------------------------------------------------------ declared costs

    @classmethod
    def cached_tokens(cls, cfg: ModelConfig, context: int) -> int:
        """Tokens held: none, the recurrent state keeps no per-token keys or values."""
        return 0

    @classmethod
    def kv_cache_bytes_per_token(cls, cfg: ModelConfig, dtype_bytes: int = 4) -> int:
        """Bytes one token adds: 0, the state has a constant size."""
        return 0

    @classmethod
    def kv_cache_bytes(
        cls, cfg: ModelConfig, batch: int, context: int, dtype_bytes: int = 4
    ) -> int:
        """Bytes of this layer's recurrent state for ``batch`` sequences, whatever ``context``:
        sum phi(k) v^T and sum phi(k), K (hd hd + hd) numbers per sequence (Katharopoulos et
        al. 2020, eq. 10-12)."""
        hd = cfg.head_dim
        return batch * cfg.n_kv_heads * (hd * hd + hd) * dtype_bytes

    @classmethod
    def saved_score_elements(cls, cfg: ModelConfig, seq_len: int) -> int:
        """Elements per query token and layer autograd keeps of the parallel form: the masked
        similarities phi(q) phi(k)^T and their normalised weights, 2 H T (the math backend's
        count), plus the feature maps phi(q) and phi(k) (H + K) hd."""
        a = cfg.attention
        return 2 * a.n_heads * seq_len + (a.n_heads + cfg.n_kv_heads) * cfg.head_dim
