"""Inference costs from a config alone: KV-cache bytes."""

from __future__ import annotations

from lmlab.config import ModelConfig


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 4) -> int:
    """Bytes the KV cache holds per token: K and V, summed over all layers.

    2 * n_layers * n_kv_heads * head_dim * dtype_bytes (dtype_bytes 4 for float32, 2 for bf16).
    """
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype_bytes
