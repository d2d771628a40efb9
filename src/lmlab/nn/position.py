"""Positional encodings behind one interface with three hooks, each a no-op by default.

Legend: B batch, T query tokens, S key tokens, D d_model, H heads, K kv heads, hd head_dim.
``positions`` are int64 absolute positions, either (T,) shared by the batch or (B, T) per row
(a left-padded batch); the hooks accept both.

- :meth:`PositionEncoding.embed` adds to the token embeddings (sinusoidal, learned);
- :meth:`PositionEncoding.rotate` rotates q and k (RoPE);
- :meth:`PositionEncoding.score_bias` adds a (H, T, S) bias to the attention scores (ALiBi, T5).

RoPE context scaling (linear, NTK, dynamic NTK, YaRN) lives in :mod:`lmlab.nn.rope_scaling`.
Legend there and here: r rotary channels (hd * partial_rotary_factor).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from lmlab.checks import positive
from lmlab.errors import ConfigError, LmlabError
from lmlab.nn.rope_scaling import ROPE_SCALING, is_length_dependent
from lmlab.nn.rope_scaling import rope_inv_freq as rope_inv_freq  # re-exported
from lmlab.registry import Registry

if TYPE_CHECKING:
    from lmlab.config import ModelConfig

POSITION: Registry[type[PositionEncoding]] = Registry("position", "model.position.kind")
POSITION.notes = """
When to use: `none` for ablations; `sinusoidal` for the original Transformer, with no
parameters: the token embeddings are scaled by sqrt(d_model) first (`model.scale_embedding`,
default true here: unscaled std-0.02 embeddings drown under the amplitude-1 table); `learned`
for GPT-2 compatibility (it cannot go past max_seq_len); `rope`, which rotates q and k by
position-dependent angles, is the modern default (Llama, Mistral, NeoX); `alibi` for reading
past the training length and BLOOM-like models: a per-head score bias -slope * (i - j), with
slopes for any head count (float32 whatever the model's dtype); `t5_relative` for T5-style
encoder-decoders.

RoPE conventions (`rope` options):

- `model.position.rope_theta` (default 10000): the base. Frequencies and angles stay float32 in
  a bf16/fp16 model; only cos/sin are cast.
- Layout: half-split by default, pairing channels (i, i + r/2) as Llama does;
  `model.position.interleaved: true` pairs (2i, 2i+1) instead (Su et al. 2021; GPT-J), for
  RoFormer / GPT-J weights. Every conversion between the two lives in `lmlab.interop.rope_layout`.
- `model.position.partial_rotary_factor` (e.g. `0.25`): rotate only the first fraction of each
  head (Black et al. 2022, GPT-NeoX), for NeoX / Pythia.
- `model.position.scaling.kind`: a context extension (family `rope_scaling`).
"""


class PositionEncoding(nn.Module):
    """Base class: every hook leaves its input unchanged.

    Precomputed tables (RoPE inverse frequencies, ALiBi slopes) are float32 buffers whatever the
    model's dtype: :meth:`float32_tables` names them, and a cast of the model (``model.to(
    torch.bfloat16)``, ``.half()``, ``.double()``) moves them to the new device but recomputes
    them in float32 instead of rounding them (a bf16 inverse frequency is off by up to 2^-9,
    which over a 4000-token distance turns the angle by radians). Only the cos/sin or bias from
    them is cast to the activations' dtype.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.max_seq_len = cfg.max_seq_len

    def float32_tables(self) -> dict[str, torch.Tensor]:
        """Buffer name -> its float32 value (CPU), recomputed from the config; none by default."""
        return {}

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        super()._apply(fn, recurse)
        for name, table in self.float32_tables().items():  # keep the tables float32
            setattr(self, name, table.to(getattr(self, name).device))
        return self

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (B, T, D), positions (T,) or (B, T) int64 -> (B, T, D)."""
        return x

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, H, T, hd), k (B, K, T, hd) at ``positions`` (T,) or (B, T) -> rotated (q, k)."""
        return q, k

    def score_bias(self, positions: torch.Tensor, s: int) -> torch.Tensor | None:
        """Additive (H, T, S) score bias for queries at ``positions`` over keys 0..S-1, or None."""
        return None


@POSITION.register("none")
class NoPosition(PositionEncoding):
    """No positional information (NoPE): causal attention still infers order (Haviv et al. 2022)."""


def sinusoidal_table(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """(T,) or (B, T) positions -> (T, dim) or (B, T, dim) float32: sin on even, cos on odd
    channels (Vaswani et al. 2017).

    Channel pair i uses frequency 1 / 10000^(2i/dim).
    """
    half = torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device)
    inv_freq = torch.exp(-math.log(10000.0) * half / dim)
    angles = positions.float().unsqueeze(-1) * inv_freq  # (..., T, dim/2)
    table = torch.zeros(*positions.shape, dim, device=positions.device)
    table[..., 0::2] = torch.sin(angles)
    table[..., 1::2] = torch.cos(angles[..., : dim // 2])
    return table


@POSITION.register("sinusoidal")
class SinusoidalPosition(PositionEncoding):
    """Fixed sine/cosine table added to the embeddings (Vaswani et al. 2017)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.d_model = cfg.d_model

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x + sinusoidal_table(positions, self.d_model).to(x.dtype)


@POSITION.register("learned")
class LearnedPosition(PositionEncoding):
    """A trained (max_seq_len, D) table added to the embeddings (GPT-2, Radford et al. 2019)."""

    options = ("offset",)
    table_limit = True  # no row past max_seq_len: generation cannot stream past it

    @staticmethod
    def check(m: ModelConfig) -> None:
        positive(m.position.offset, "model.position.offset", allow_zero=True)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        # BART keeps ``offset`` = 2 unused rows before position 0: row p + offset is position p
        self.offset = cfg.position.offset
        self.weight = nn.Parameter(torch.zeros(cfg.max_seq_len + self.offset, cfg.d_model))
        nn.init.normal_(self.weight, std=cfg.init_std)

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Raises LmlabError if a position is >= max_seq_len (the table has no row for it)."""
        if positions.numel() and int(positions.max()) >= self.max_seq_len:
            raise LmlabError(
                f"position {int(positions.max())} is past model.max_seq_len={self.max_seq_len}: "
                "learned positions have no embedding there"
            )
        return x + self.weight[positions + self.offset].to(x.dtype)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """(H,) float32 ALiBi slopes (Press et al. 2022, "Train Short, Test Long").

    For H a power of two: 2^(-8i/H), i = 1..H. Otherwise the slopes of the closest lower power of
    two c, followed by the first H - c odd-indexed slopes of 2c, 2^(-4j/c) for j = 1, 3, 5, ...
    (the paper's and BLOOM's procedure). Computed in float64, returned as float32.
    """
    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = (2.0 ** (-8.0 / closest)) ** torch.arange(1, closest + 1, dtype=torch.float64)
    if closest < n_heads:
        odd = torch.arange(1, 2 * (n_heads - closest), 2, dtype=torch.float64)
        slopes = torch.cat([slopes, (2.0 ** (-8.0 / (2 * closest))) ** odd])
    return slopes.float()


@POSITION.register("alibi")
class ALiBiPosition(PositionEncoding):
    """Attention with linear biases: score - slope_h * |i - j| (Press et al. 2022; BLOOM).

    A fixed penalty growing with the query-key distance; no embedding, no rotation, so it
    extrapolates past the training length. Under a causal mask only j <= i is seen, so the bias is
    -slope_h * (i - j); the absolute value makes a bidirectional mask symmetric.
    """

    examples: tuple[dict, ...] = (
        {},
        {"attention": {"n_heads": 6, "head_dim": 8}},  # not a power of two
        {"attention": {"backend": "math"}},
        {"attention": {"mask": "sliding_window", "window": 4}},
    )

    slopes: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.n_heads = cfg.attention.n_heads
        self.register_buffer("slopes", alibi_slopes(self.n_heads), persistent=False)

    def float32_tables(self) -> dict[str, torch.Tensor]:
        return {"slopes": alibi_slopes(self.n_heads)}

    def score_bias(self, positions: torch.Tensor, s: int) -> torch.Tensor:
        """Queries at ``positions`` (T,) or (B, T), the last T of S keys -> (H, T, S) float32.

        The distance is counted in key slots (query t sits at slot S - T + t), so the bias is
        right whatever the keys hold: a full cache, a sliding-window cache that dropped old
        tokens, or a left-padded row (padding slots are masked; real tokens are contiguous).
        """
        t = positions.shape[-1]
        queries = torch.arange(s - t, s, device=positions.device)
        keys = torch.arange(s, device=positions.device)
        distance = (queries[:, None] - keys[None, :]).abs().float()  # (T, S)
        return -self.slopes[:, None, None] * distance  # (H, T, S)


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """Key position minus query position (int64, any shape) -> bucket ids in [0, num_buckets)
    (Raffel et al. 2020, T5, section 2.1; the Mesh TensorFlow bucketing).

    Bidirectional: half the buckets for keys after the query (positive distances), half for keys
    at or before it. Causal: only keys at or before the query (positive distances clamp to 0).
    Within one direction's n buckets, distances below n/2 get a bucket each; larger ones share
    n/2 logarithmically wider buckets up to ``max_distance``, beyond which all share the last.
    """
    n = num_buckets
    bucket = torch.zeros_like(relative_position)
    if bidirectional:
        n //= 2
        bucket = bucket + (relative_position > 0).long() * n
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp_min(0)  # how far back the key lies
    exact = n // 2
    # log-spaced: exact + log(d / exact) / log(max_distance / exact) * (n - exact), in float32
    log_ratio = torch.log(distance.float() / exact) / math.log(max_distance / exact)
    far = (exact + (log_ratio * (n - exact)).long()).clamp_max(n - 1)
    return bucket + torch.where(distance < exact, distance, far)


@POSITION.register("t5_relative")
class T5RelativePosition(PositionEncoding):
    """A learned per-head scalar added to each score, chosen by the bucketed key - query
    distance (Raffel et al. 2020, T5). One (num_buckets, H) table serves every layer.

    Buckets are bidirectional when ``model.attention.mask`` is bidirectional (an encoder) and
    causal otherwise (a decoder). Distances count key slots, as ALiBi does, so the bias is right
    for a cache and for a left-padded row. T5 adds no embedding and no 1/sqrt(d_k) scaling
    (``model.attention.scaled: false``).
    """

    options = ("num_buckets", "max_distance")

    @staticmethod
    def check(m: ModelConfig) -> None:
        p = m.position
        if p.num_buckets < 4 or p.num_buckets % 2:
            raise ConfigError(
                f"model.position.num_buckets must be even and >= 4, got {p.num_buckets}"
            )
        if p.max_distance <= p.num_buckets // 2:
            raise ConfigError(
                f"model.position.max_distance ({p.max_distance}) must exceed num_buckets / 2 "
                f"({p.num_buckets // 2}): half the buckets hold exact distances below it"
            )
        if m.attention.kind != "softmax":
            raise ConfigError(
                "model.position.kind=t5_relative adds a bias to attention scores: it needs "
                f"model.attention.kind=softmax, not {m.attention.kind}"
            )

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        p = cfg.position
        self.bidirectional = cfg.attention.mask == "bidirectional"
        self.num_buckets, self.max_distance = p.num_buckets, p.max_distance
        self.relative_attention_bias = nn.Embedding(p.num_buckets, cfg.attention.n_heads)

    def score_bias(self, positions: torch.Tensor, s: int) -> torch.Tensor:
        """Queries in the last T of S key slots -> (H, T, S) bias, the table's dtype."""
        t = positions.shape[-1]
        device = self.relative_attention_bias.weight.device
        queries = torch.arange(s - t, s, device=device)
        keys = torch.arange(s, device=device)
        buckets = relative_position_bucket(
            keys[None, :] - queries[:, None],
            self.bidirectional,
            self.num_buckets,
            self.max_distance,
        )  # (T, S)
        return self.relative_attention_bias(buckets).permute(2, 0, 1)  # (H, T, S)


def rotary_dim(head_dim: int, partial_rotary_factor: float) -> int:
    """Rotated channels r = int(hd * partial_rotary_factor), as GPT-NeoX and HF truncate it."""
    return int(head_dim * partial_rotary_factor)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] on the last dim: the half-split ("GPT-NeoX / Llama") RoPE layout,
    which pairs channel i with channel i + r/2."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    """[x0, x1, x2, x3, ...] -> [-x1, x0, -x3, x2, ...]: the interleaved layout of RoFormer and
    GPT-J, which pairs channels (2i, 2i + 1)."""
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x_odd, x_even), dim=-1).flatten(-2)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotate x (..., T, hd) by angles given as cos/sin (T, r), r <= hd, laid out as
    :meth:`RotaryPosition.cos_sin` returns them. The first r channels rotate; the other hd - r
    pass through unchanged (partial rotary, GPT-NeoX)."""
    rotate = rotate_interleaved if interleaved else rotate_half
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate(x) * sin
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat((x_rot * cos + rotate(x_rot) * sin, x_pass), dim=-1)


# Training in bf16/fp16: RoPE through _RotateHalf; False keeps the rolled formula (A/B benchmarks).
TRAIN_ROTATE_HALF = True
# Training in float32/bf16 on a CPU: RoPE through lmlab's C++ kernel (lmlab.nn.rope_kernel),
# bit-equal to the rolled formula; False keeps torch ops (A/B benchmarks).
TRAIN_ROPE_KERNEL = True


def _rope_kernel_applies(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether :meth:`RotaryPosition.rotate_heads` takes lmlab's RoPE kernel
    (:mod:`lmlab.nn.rope_kernel`): training (x records gradients), float32 or bfloat16 on a CPU,
    positions shared by the batch, not under torch.compile, the kernel compiled. Its values and
    gradients are the rolled formula's, bit for bit; only training takes it (a forward without
    gradients, decoding, stays on torch ops)."""
    if not (TRAIN_ROPE_KERNEL and torch.is_grad_enabled() and x.requires_grad):
        return False
    if torch.compiler.is_compiling():
        return False
    from lmlab.nn import rope_kernel

    return rope_kernel.applies(x, cos)


def _rope_train_applies(x: torch.Tensor) -> bool:
    """Whether :meth:`RotaryPosition.rotate_heads` takes :class:`_RotateHalf`: training (x
    records gradients) in bf16 or fp16 (autocast's q and k), head_dim >= 64 (its in-place
    products run over hd/2-element pieces: slower than the rolled formula below 32, 1.4-2x
    faster at 64, bf16, 1 thread), not under torch.compile. A float32 forward keeps the
    reference bits whether or not it records gradients."""
    return (
        TRAIN_ROTATE_HALF
        and x.shape[-1] >= 64
        and x.dtype in (torch.bfloat16, torch.float16)
        and torch.is_grad_enabled()
        and x.requires_grad
        and not torch.compiler.is_compiling()
    )


class _RotateHalf(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin in the half-split layout with sin given sign-folded
    (``signed`` = [-sin1, sin2]), written out for training: y = x * cos, then each half of y
    gets the other half of x times its half of ``signed`` added in place (addcmul_): no rolled
    copy of x (a concatenation of hd/2-element pieces, slow), no autograd graph of five ops.
    Backward: dx = g * cos, dx1 += g2 * signed2, dx2 += g1 * signed1. Each sum rounds once
    (addcmul) where the reference rounds the product first: equal to rounding
    (tests/unit/test_train_fast_paths.py). x (..., T, hd), cos and signed (T, hd) or
    (B, 1, T, hd)."""

    @staticmethod
    def forward(ctx, x, cos, signed):
        h = x.shape[-1] // 2
        y = x * cos
        y[..., :h].addcmul_(x[..., h:], signed[..., :h])
        y[..., h:].addcmul_(x[..., :h], signed[..., h:])
        ctx.save_for_backward(cos, signed)
        return y

    @staticmethod
    def backward(ctx, g):
        cos, signed = ctx.saved_tensors
        h = g.shape[-1] // 2
        dx = g * cos
        dx[..., :h].addcmul_(g[..., h:], signed[..., h:])
        dx[..., h:].addcmul_(g[..., :h], signed[..., :h])
        return dx, None, None


@POSITION.register("rope")
class RotaryPosition(PositionEncoding):
    """Rotary position embedding: q_m . k_n depends on m - n only (Su et al. 2021, RoFormer).

    Rotates each channel pair of q and k by position * inv_freq[i]. ``model.position``:
    ``rope_theta`` (base), ``interleaved`` (pairs (2i, 2i+1) as RoFormer/GPT-J; default pairs
    (i, i + r/2) as GPT-NeoX/Llama), ``partial_rotary_factor`` (rotate only the first
    r = int(hd * factor) channels, GPT-NeoX) and ``scaling`` (context extension, a
    :data:`~lmlab.nn.rope_scaling.ROPE_SCALING` function: linear, ntk, dynamic_ntk, yarn).
    """

    examples: tuple[dict, ...] = (
        {},
        {"position": {"interleaved": True}},
        {"position": {"partial_rotary_factor": 0.5}},
        {"position": {"interleaved": True, "partial_rotary_factor": 0.5}},
    )

    inv_freq: torch.Tensor
    options = ("rope_theta", "interleaved", "partial_rotary_factor", "scaling")

    @staticmethod
    def check(m: ModelConfig) -> None:
        """theta > 0, factor in (0, 1], an even number (>= 2) of rotated channels."""
        p = m.position
        positive(p.rope_theta, "model.position.rope_theta")
        if not 0.0 < p.partial_rotary_factor <= 1.0:
            raise ConfigError(
                "model.position.partial_rotary_factor must be in (0, 1], got "
                f"{p.partial_rotary_factor}"
            )
        r = rotary_dim(m.head_dim, p.partial_rotary_factor)
        if r < 2 or r % 2:
            raise ConfigError(
                f"model.position.kind=rope needs an even number (>= 2) of rotated channels, "
                f"int(head_dim * partial_rotary_factor) = int({m.head_dim} * "
                f"{p.partial_rotary_factor}) = {r}"
            )

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        p = cfg.position
        self.head_dim = cfg.head_dim
        self.rotary_dim = rotary_dim(cfg.head_dim, p.partial_rotary_factor)
        self.interleaved = p.interleaved
        self.theta = p.rope_theta
        self.scaling = dataclasses.replace(
            p.scaling, original_max_seq_len=p.scaling.original_max_seq_len or cfg.max_seq_len
        )
        self.scale_fn = ROPE_SCALING.get(p.scaling.kind, "model.position.scaling.kind")
        self.length_dependent = is_length_dependent(self.scale_fn)
        inv_freq, self.attention_factor = self.scale_fn(
            self.rotary_dim, self.theta, self.scaling, None
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def float32_tables(self) -> dict[str, torch.Tensor]:
        return {"inv_freq": self.scale_fn(self.rotary_dim, self.theta, self.scaling, None)[0]}

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T,) or (B, T) positions -> cos, sin each (T, r) or (B, T, r) float32 in this layout,
        times the scaling's attention factor (any position, no table limit). Computed in float32
        whatever the model's dtype (the caller casts the result)."""
        inv_freq, factor = self.inv_freq, self.attention_factor
        if self.length_dependent and positions.numel():
            inv_freq, factor = self.scale_fn(
                self.rotary_dim, self.theta, self.scaling, positions.max() + 1
            )
        freqs = positions.float().unsqueeze(-1) * inv_freq  # (..., T, r/2)
        if self.interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)  # (..., T, r): f0 f0 f1 f1 ...
        else:
            emb = torch.cat((freqs, freqs), dim=-1)  # (..., T, r): f0 f1 ... f0 f1 ...
        return emb.cos() * factor, emb.sin() * factor

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate_heads(q, positions), self.rotate_heads(k, positions)

    def rotate_heads(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (B, N, T, hd), any number N of q or k heads, rotated to ``positions`` (T,) or
        (B, T): what :meth:`rotate` does to q and to k (every head turns by the same angles,
        so q and k concatenated on the head dim rotate as one tensor, the same bits)."""
        cos, sin, signed = self._rotation(positions, x.dtype)
        r = cos.shape[-1]
        if signed is not None and x.shape[-1] == r and _rope_kernel_applies(x, cos):
            from lmlab.nn.rope_kernel import rope

            return rope(x, cos, signed)  # the rolled formula below, in one pass each way
        if signed is not None and x.shape[-1] == r and _rope_train_applies(x):
            return _RotateHalf.apply(x, cos, signed)
        if signed is not None and x.shape[-1] == r:
            # rotate_half(x) * sin == roll(x, r/2) * [-sin1, sin2] exactly (a sign flip is
            # exact): 4 ops per tensor instead of 6, the same bits
            return x * cos + x.roll(r // 2, -1) * signed
        return apply_rope(x, cos, sin, self.interleaved)

    def split_kernel_ready(self) -> bool:
        """Whether :meth:`rotate_split` may take lmlab's RoPE kernel, as far as can be told
        before the projection runs: :data:`TRAIN_ROPE_KERNEL` on, gradients recorded, not
        under torch.compile, the kernel compiled, the half-split layout (not interleaved) over
        every channel (no partial rotary). :meth:`rotate_split` checks the rest (dtype, shared
        positions, head_dim) and may still return None."""
        if not (TRAIN_ROPE_KERNEL and torch.is_grad_enabled()) or torch.compiler.is_compiling():
            return False
        if self.interleaved or self.rotary_dim != self.head_dim:
            return False
        from lmlab.nn import rope_kernel

        return rope_kernel.available()

    def rotate_split(
        self,
        qkv: torch.Tensor,
        h: int,
        kv: int,
        positions: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """qkv (B, T, H + 2 K, hd), a fused projection's output (bias-free when ``bias``
        ((H + 2 K) hd,) is given: it is added first, each sum rounded to qkv's dtype), ->
        (q (B, H, T, hd) and k (B, K, T, hd) rotated to ``positions``, v (B, K, T, hd)), each
        contiguous, through lmlab's RoPE kernel in one call each way
        (:func:`lmlab.nn.rope_kernel.rope_split`): without a bias, the values and gradients of
        splitting, transposing and :meth:`rotate_heads`, bit for bit. None where the kernel does
        not apply (see :func:`_rope_kernel_applies`; the half-split layout over every channel
        only): the caller adds the bias, splits and rotates."""
        cos, _, signed = self._rotation(positions, qkv.dtype)
        if signed is None or qkv.shape[-1] != cos.shape[-1] or qkv.stride(-1) != 1:
            return None
        if not _rope_kernel_applies(qkv.transpose(1, 2), cos):
            return None
        if bias is not None and bias.dtype not in (torch.float32, qkv.dtype):
            return None
        from lmlab.nn.rope_kernel import rope_split_op

        # rope_split's checks hold here (_rope_kernel_applies: a CPU float32 or bfloat16 qkv
        # with a unit last stride, 2-d tables of its dtype and shape that record no gradient,
        # an even head_dim; the bias dtype above; qkv is (B, T, H + 2 K, hd) by construction)
        return rope_split_op(qkv, cos, signed, h, kv, bias)

    def shared_tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, signed), each (T, hd) in ``dtype`` (signed: sin with its first half negated),
        the tables a kernel that rotates q and k itself reads
        (torch.ops.lmlab.rope_causal_attention_bf16, :meth:`lmlab.nn.attention.SoftmaxAttention.
        fused_rope_attention`): positions (T,) shared by the batch, the half-split layout over
        every channel, tables that record no gradient; None otherwise. Kept as
        :meth:`rotation` keeps them."""
        if self.interleaved or self.rotary_dim != self.head_dim or positions.dim() != 1:
            return None
        cos, _, signed = self._rotation(positions, dtype)
        if signed is None or cos.requires_grad or cos.dim() != 2:
            return None
        return cos, signed

    def rotation(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`cos_sin` of ``positions`` cast to ``dtype``, each (T, r) or (B, 1, T, r) (per-row
        positions broadcast over heads). Every layer of one forward rotates by the same
        ``positions`` tensor, so the last result is kept and reused while the tensor (the same
        object, unmodified: its version counter), the frequencies, the dtype and the grad /
        inference mode are those it was computed for: computed once, not per layer (and, as a
        decoder passes the same positions tensor while the length is unchanged, not per
        training step); tables that record gradients are recomputed each call."""
        return self._rotation(positions, dtype)[:2]

    def _rotation(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:meth:`rotation` and, in the half-split layout, sin with its first half negated
        ([-sin1, sin2], for :meth:`rotate`), else None. Under ``torch.compile`` nothing is kept
        (the compiler traces the computation once per graph anyway)."""
        if (
            torch.compiler.is_compiling()
            or positions.is_inference()
            or self.inv_freq.is_inference()
        ):
            # inference tensors (made under torch.inference_mode) have no version counter
            return self._compute_rotation(positions, dtype)
        key = (
            positions._version,
            dtype,
            self.inv_freq._version,
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
        )
        memo = self.__dict__.get("_rotation_memo")
        fresh = memo is not None and memo[0] is positions and memo[1] is self.inv_freq
        if fresh and memo[2] == key:  # type: ignore[index]
            return memo[3]  # type: ignore[index]
        out = self._compute_rotation(positions, dtype)
        if not out[0].requires_grad:
            # tables that record a graph (a frequency table made trainable) are not kept: the
            # positions tensor may be the same object in the next forward
            # (DecoderLM.arange_positions), whose backward would meet this one's freed graph
            self.__dict__["_rotation_memo"] = (positions, self.inv_freq, key, out)
        return out

    def _compute_rotation(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        cos, sin = self.cos_sin(positions)
        cos, sin = cos.to(dtype), sin.to(dtype)  # (T, r) or (B, T, r)
        if cos.dim() == 3:  # per-row positions: broadcast over heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, r)
        signed = None
        if not self.interleaved:
            half = sin.shape[-1] // 2
            signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos, sin, signed
