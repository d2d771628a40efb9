"""Transformer components: one family per module, each family a :class:`Registry`."""

from lmlab.nn.attention import ATTENTION, ATTENTION_BACKENDS, attention_math, attention_sdpa
from lmlab.nn.block import BLOCK
from lmlab.nn.differential import DifferentialAttention  # noqa: F401  (registers "differential")
from lmlab.nn.ffn import ACTIVATIONS, FFN
from lmlab.nn.kv_cache import KVCache, LayerKVCache, LinearAttentionState, SlidingWindowKVCache
from lmlab.nn.masks import MASKS, causal_mask
from lmlab.nn.moe import ROUTERS, MoE, moe_losses
from lmlab.nn.norm import NORM
from lmlab.nn.position import POSITION, PositionEncoding

__all__ = [
    "ACTIVATIONS",
    "ATTENTION",
    "ATTENTION_BACKENDS",
    "BLOCK",
    "FFN",
    "MASKS",
    "NORM",
    "POSITION",
    "ROUTERS",
    "KVCache",
    "LayerKVCache",
    "LinearAttentionState",
    "MoE",
    "PositionEncoding",
    "SlidingWindowKVCache",
    "attention_math",
    "attention_sdpa",
    "causal_mask",
    "moe_losses",
]
