"""Transformer components: one family per module, each family a :class:`Registry`."""

import lmlab.nn.local_global  # noqa: F401  (registers mask local_global)
import lmlab.nn.sigmoid_attention  # noqa: F401  (registers attention sigmoid)
from lmlab.nn.attention import ATTENTION, ATTENTION_BACKENDS, attention_math, attention_sdpa
from lmlab.nn.block import BLOCK
from lmlab.nn.differential import DifferentialAttention  # noqa: F401  (registers "differential")
from lmlab.nn.ffn import ACTIVATIONS, FFN
from lmlab.nn.hyper_connections import HyperConnectionBlock  # noqa: F401  (block.kind=hyper)
from lmlab.nn.kv_cache import KVCache, LayerKVCache, LinearAttentionState, SlidingWindowKVCache
from lmlab.nn.masks import MASKS, causal_mask
from lmlab.nn.mla import MultiHeadLatentAttention  # noqa: F401  (registers attention kind mla)
from lmlab.nn.moba import MoBAAttention  # noqa: F401  (registers attention kind moba)
from lmlab.nn.moe import ROUTERS, MoE, moe_losses
from lmlab.nn.norm import NORM
from lmlab.nn.nsa import NativeSparseAttention  # noqa: F401  (registers attention kind nsa)
from lmlab.nn.position import POSITION, PositionEncoding
from lmlab.nn.sinks import SinkAttention  # noqa: F401  (registers attention sink, mask streaming)

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
