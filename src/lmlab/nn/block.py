"""Transformer layers: how norm, attention and FFN are wired around the residual stream.

Legend: B batch, T tokens, D d_model. A block maps (B, T, D) -> (B, T, D).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from lmlab.nn.attention import ATTENTION
from lmlab.nn.cross_attention import CrossAttention
from lmlab.nn.ffn import MLP, GatedActivationMLP, GeGLU, SwiGLU, build_ffn, residual_parts
from lmlab.nn.fused import global_hooks, torch_hooks
from lmlab.nn.hooks import HookPoint
from lmlab.nn.kv_cache import CrossAttentionCache, LayerCache
from lmlab.nn.norm import build_norm, norm_for_matmuls
from lmlab.registry import Registry

if TYPE_CHECKING:
    from lmlab.config import ModelConfig
    from lmlab.nn.position import PositionEncoding

BLOCK: Registry[type[Block]] = Registry("block", "model.block.kind")
BLOCK.notes = """
When to use: `pre` is the default and trains deep stacks without warmup tricks; `post` is the
original Transformer and BERT, and needs warmup when deep; `hybrid` gives Pre-Norm's stability
with Post-Norm's final quality.

Block options:

- `model.block.parallel: true`: x + attn(norm1(x)) + ffn(norm2(x)) (Wang & Komatsuzaki 2021,
  GPT-J; Black et al. 2022, NeoX); faster on hardware that overlaps the two branches.
- `model.block.residual: false`: x = f(x) instead of x + f(x) in every block, no skip
  connection (He et al. 2016 is what it removes); an ablation only, showing why residuals matter
  (experiments/ablations.yaml).
"""


class Block(nn.Module):
    """Holds attn_norm, attn, ffn_norm, ffn and residual dropout; subclasses define the wiring."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = build_norm(cfg)
        self.attn = ATTENTION.get(cfg.attention.kind, "model.attention.kind")(cfg, layer_idx)
        self.ffn_norm = build_norm(cfg)
        self.ffn = build_ffn(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.parallel = cfg.block.parallel
        self.residual = cfg.block.residual
        # the residual stream's hook points (lmlab.hooks); LayerStack runs pre and post
        self.hook_resid_pre = HookPoint()  # (B, T, D) entering the layer
        if not self.parallel:  # a parallel block has no stream between its sublayers
            self.hook_resid_mid = HookPoint()  # (B, T, D) after the attention sublayer
        self.hook_resid_post = HookPoint()  # (B, T, D) leaving the layer

    def add(self, x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        """The residual connection x + branch (He et al. 2016); only branch with
        ``block.residual: false``, the ablation that removes the skip path."""
        if not self.residual:
            return branch
        if branch.dtype is torch.bfloat16 and x.dtype is torch.float32:  # bf16 training
            from lmlab.nn.train_kernel import residual_add

            return residual_add(x, branch)
        return x + branch

    def dropped(self, x: torch.Tensor) -> torch.Tensor:
        """Residual dropout of a branch: ``self.drop(x)``; x itself (what Dropout returns) in eval
        mode or at p = 0 (with no hooks on the module), without the module call."""
        if self.drop_idle():
            return x  # p = 0: what Dropout returns, without the module call
        return self.drop(x)

    def drop_idle(self) -> bool:
        """Whether residual dropout is the identity without its module call: eval mode, or
        p = 0 with no hooks on the module."""
        d = self.drop
        return not d.training or (d.p == 0.0 and not torch_hooks(d) and not global_hooks())

    def expand_stream(self, x: torch.Tensor) -> torch.Tensor:
        """The embedding x (B, T, D) -> the residual stream the first layer reads: x itself (a
        block kind with a wider stream, hyper-connections, overrides it and reduce_stream)."""
        return x

    def reduce_stream(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream -> (B, T, D), what the final norm reads: x itself."""
        return x

    def forward(
        self,
        x: torch.Tensor,
        position: PositionEncoding,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """x (B, T, D) -> x (B, T, D).

        ``key_mask`` (B, S) bool, True = real token (None: no padding); ``cache``: this layer's
        decoding state. Both go to the attention unchanged."""
        raise NotImplementedError


def _matmul_input_kinds() -> frozenset[type]:
    """The attention and FFN classes whose forward uses its input only as matmul input."""
    from lmlab.nn.attention import SoftmaxAttention
    from lmlab.nn.ffn import MLP, GatedActivationMLP, GeGLU, SwiGLU

    return frozenset({SoftmaxAttention, MLP, SwiGLU, GeGLU, GatedActivationMLP})


_MATMUL_INPUT = _matmul_input_kinds()
# the FFN classes whose down projection's bias the residual add may add (ffn.residual_parts)
_RESIDUAL_PARTS = frozenset({MLP, SwiGLU, GeGLU, GatedActivationMLP})


@BLOCK.register("pre")
class PreNormBlock(Block):
    """x + attn(norm(x)), then x + ffn(norm(x)): trains deep stacks stably (Xiong et al. 2020).

    With ``block.parallel`` both branches read the same x: x + attn(norm1(x)) + ffn(norm2(x))
    (GPT-J, Wang & Komatsuzaki 2021; GPT-NeoX, Black et al. 2022)."""

    examples: tuple[dict, ...] = ({}, {"block": {"parallel": True}})

    def forward(self, x, position, positions, key_mask=None, cache=None):
        a = self.attn(
            self.norm_in(self.attn_norm, x, self.attn), position, positions, key_mask, cache
        )
        if self.parallel:
            h = self.norm_in(self.ffn_norm, x, self.ffn)
            return self.add(x, self.dropped(a.out) + self.dropped(self.ffn(h)))
        x = self.hook_resid_mid(self.add(x, self.dropped(a.out)))
        return self.add_ffn(x, self.norm_in(self.ffn_norm, x, self.ffn))

    def add_ffn(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``self.add(x, self.dropped(self.ffn(h)))``: x (B, T, D) float32 stream, h the FFN's
        input. In bf16 CPU training with an MLP or gated FFN whose down projection has a bias
        (:func:`lmlab.nn.ffn.residual_parts`), residual dropout idle and no hooks on the FFN or
        its output, the projection runs bias-free and the residual add adds the bias (one pass
        each way, :func:`lmlab.nn.train_kernel.residual_add`)."""
        ffn = self.ffn
        stream_ok = self.residual and x.dtype is torch.float32
        if stream_ok and type(ffn) in _RESIDUAL_PARTS and self.drop_idle():
            parts = residual_parts(ffn, h)  # type: ignore[arg-type]
            if parts is not None:
                from lmlab.nn.train_kernel import residual_add

                return residual_add(x, *parts)
        return self.add(x, self.dropped(ffn(h)))

    @staticmethod
    def norm_in(norm: nn.Module, x: torch.Tensor, consumer: nn.Module) -> torch.Tensor:
        """``norm(x)`` as ``consumer``'s input: through :func:`~lmlab.nn.norm.norm_for_matmuls`
        (bf16 straight from the norm in bf16 CPU training) when ``consumer`` is a module that
        only feeds its input to matmuls (softmax attention's projections, an MLP's up or gate
        projections) and neither it nor a module inside it has torch hooks, else ``norm(x)``."""
        if type(consumer) in _MATMUL_INPUT:
            return norm_for_matmuls(norm, x, consumer)
        return norm(x)


@BLOCK.register("post")
class PostNormBlock(Block):
    """norm(x + attn(x)), then norm(x + ffn(x)): the original Transformer (Vaswani et al. 2017)."""

    def forward(self, x, position, positions, key_mask=None, cache=None):
        a = self.attn(x, position, positions, key_mask, cache)
        x = self.hook_resid_mid(self.attn_norm(self.add(x, self.drop(a.out))))
        return self.ffn_norm(self.add(x, self.drop(self.ffn(x))))


@BLOCK.register("hybrid")
class HybridNormBlock(Block):
    """x + attn(x) with QKV-norm (RMSNorm on each q, k and v head), then norm(x + ffn(x)):
    Pre-Norm-like attention, Post-Norm FFN (Zhuo et al. 2025, "HybridNorm")."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        qkv = dataclasses.replace(cfg.attention, qk_norm=True, v_norm=True)
        super().__init__(dataclasses.replace(cfg, attention=qkv), layer_idx)
        self.attn_norm = nn.Identity()  # the attention input is not normalised

    def forward(self, x, position, positions, key_mask=None, cache=None):
        a = self.attn(x, position, positions, key_mask, cache)
        x = self.hook_resid_mid(self.add(x, self.drop(a.out)))
        return self.ffn_norm(self.add(x, self.drop(self.ffn(x))))


# ----------------------------------------------------------------------------- decoder layers
# An encoder-decoder's decoder layer has three sublayers: causal self-attention, cross-attention
# over the encoder output, FFN (Vaswani et al. 2017, Fig. 1). Its encoder layer is a Block above
# with a bidirectional mask. S_src: source tokens; memory (B, S_src, D) is the encoder output.

DECODER_BLOCK: Registry[type[DecoderBlock]] = Registry("decoder_block", "model.block.kind")


class DecoderBlock(nn.Module):
    """attn_norm, attn (causal self-attention), cross_norm, cross_attn, ffn_norm, ffn."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = build_norm(cfg)
        self.attn = ATTENTION.get(cfg.attention.kind, "model.attention.kind")(cfg, layer_idx)
        self.cross_norm = build_norm(cfg)
        self.cross_attn = CrossAttention(cfg, layer_idx)
        self.ffn_norm = build_norm(cfg)
        self.ffn = build_ffn(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.hook_resid_pre = HookPoint()  # (B, T, D) entering the layer
        self.hook_resid_mid = HookPoint()  # (B, T, D) after self-attention
        self.hook_resid_cross = HookPoint()  # (B, T, D) after cross-attention
        self.hook_resid_post = HookPoint()  # (B, T, D) leaving the layer

    expand_stream = Block.expand_stream  # the residual stream is x itself
    reduce_stream = Block.reduce_stream

    def forward(
        self,
        x: torch.Tensor,
        position: PositionEncoding,
        positions: torch.Tensor,
        memory: torch.Tensor | None,
        memory_mask: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        cross_cache: CrossAttentionCache | None = None,
    ) -> torch.Tensor:
        """x (B, T, D) -> x (B, T, D).

        ``memory_mask`` (B, S_src) bool, True = real source token; ``key_mask`` (B, S) the
        decoder's own padding mask; ``cache`` / ``cross_cache``: this layer's decoding state."""
        raise NotImplementedError


@DECODER_BLOCK.register("pre")
class PreNormDecoderBlock(DecoderBlock):
    """x + self_attn(norm(x)), x + cross_attn(norm(x), memory), x + ffn(norm(x)) (T5)."""

    def forward(
        self,
        x,
        position,
        positions,
        memory,
        memory_mask=None,
        key_mask=None,
        cache=None,
        cross_cache=None,
    ):
        a = self.attn(self.attn_norm(x), position, positions, key_mask, cache)
        x = self.hook_resid_mid(x + self.drop(a.out))
        c = self.cross_attn(self.cross_norm(x), memory, memory_mask, cross_cache)
        x = self.hook_resid_cross(x + self.drop(c.out))
        return x + self.drop(self.ffn(self.ffn_norm(x)))


@DECODER_BLOCK.register("post")
class PostNormDecoderBlock(DecoderBlock):
    """norm(x + self_attn(x)), norm(x + cross_attn(x, memory)), norm(x + ffn(x)) (Vaswani et
    al. 2017; BART)."""

    def forward(
        self,
        x,
        position,
        positions,
        memory,
        memory_mask=None,
        key_mask=None,
        cache=None,
        cross_cache=None,
    ):
        a = self.attn(x, position, positions, key_mask, cache)
        x = self.hook_resid_mid(self.attn_norm(x + self.drop(a.out)))
        c = self.cross_attn(x, memory, memory_mask, cross_cache)
        x = self.hook_resid_cross(self.cross_norm(x + self.drop(c.out)))
        return self.ffn_norm(x + self.drop(self.ffn(x)))
