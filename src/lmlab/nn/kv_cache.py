"""Key/value cache for incremental decoding.

Legend: B batch, K kv heads, S cached tokens, hd head_dim. Keys are stored *after* the positional
rotation (RoPE), so cached decoding reproduces the full forward pass exactly.
"""

from __future__ import annotations

import torch


class LayerKVCache:
    """The keys and values one attention layer has seen so far, each (B, K, S, hd)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new keys/values (B, K, T, hd); return all of them, (B, K, S + T, hd)."""
        if self.k is None or self.v is None:
            self.k, self.v = k, v
        else:
            self.k = torch.cat([self.k, k], dim=2)
            self.v = torch.cat([self.v, v], dim=2)
        return self.k, self.v

    @property
    def seq_len(self) -> int:
        return 0 if self.k is None else int(self.k.shape[2])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)


class KVCache:
    """A dynamic cache: one :class:`LayerKVCache` per layer, growing by concatenation."""

    def __init__(self, n_layers: int) -> None:
        self.layers = [LayerKVCache() for _ in range(n_layers)]

    @property
    def seq_len(self) -> int:
        """Tokens cached so far (the absolute position of the next token)."""
        return self.layers[0].seq_len if self.layers else 0

    def nbytes(self) -> int:
        """Memory held by all cached keys and values, in bytes."""
        return sum(layer.nbytes() for layer in self.layers)
