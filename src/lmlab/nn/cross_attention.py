"""Cross-attention: decoder queries attend over the encoder output (Vaswani et al. 2017, sec. 3.2.3
"encoder-decoder attention"; T5's EncDecAttention, BART's encoder_attn).

Legend: B batch, T decoder (query) tokens, S source (key) tokens, D d_model, H heads, K kv heads,
hd head_dim. Queries come from the decoder stream x (B, T, D); keys and values from the encoder
output ``memory`` (B, S, D), projected once per source batch and kept in a
:class:`~lmlab.nn.kv_cache.CrossAttentionCache`. There is no structural mask (every query sees
every source token) and no position encoding; the source padding mask (B, S) hides padding keys.
The projections, QK-norm, backends and GQA are those of :mod:`lmlab.nn.attention`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lmlab.errors import LmlabError
from lmlab.nn.attention import Attention, AttentionOutput
from lmlab.nn.fused import linear
from lmlab.nn.kv_cache import CrossAttentionCache

if TYPE_CHECKING:
    from lmlab.config import ModelConfig


class CrossAttention(Attention):
    """softmax(Q K^T * scale) V with Q = x W_q (decoder) and K, V = memory W_k, memory W_v
    (encoder output); scale 1/sqrt(hd), or 1 with ``model.attention.scaled: false`` (T5)."""

    def memory_kv(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder output (B, S, D) -> k, v (B, K, S, hd), k normalised (QK-norm) and v too
        (V-norm) when configured."""
        b, s, _ = memory.shape
        k = self.k_norm(linear(self.k_proj, memory).view(b, s, self.n_kv_heads, self.head_dim))
        v = self.v_norm(linear(self.v_proj, memory).view(b, s, self.n_kv_heads, self.head_dim))
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor | None,
        memory_mask: torch.Tensor | None = None,
        cache: CrossAttentionCache | None = None,
    ) -> AttentionOutput:
        """x (B, T, D), memory (B, S, D) -> AttentionOutput(out (B, T, D)); the weights
        (B, H, T, S) go through ``hook_pattern``.

        ``memory_mask`` (B, S) bool, True = real source token; a row without any real source
        token outputs 0. ``cache``: read when filled (``memory`` may then be None), else filled
        from ``memory``. Raises LmlabError when neither a filled cache nor ``memory`` is given.
        """
        b, t, _ = x.shape
        q = self.q_norm(linear(self.q_proj, x).view(b, t, self.n_heads, self.head_dim)).transpose(
            1, 2
        )
        q = self.hook_q(q)  # (B, H, T, hd)
        if cache is not None and cache.filled:
            assert cache.k is not None and cache.v is not None
            k, v = cache.k, cache.v
        elif memory is None:
            raise LmlabError("cross-attention needs the encoder output or a filled cache")
        else:
            k, v = self.memory_kv(memory)  # (B, K, S, hd)
            if cache is not None:
                cache.set(k, v)
        k, v = self.hook_k(k), self.hook_v(v)  # (B, K, S, hd) over the source, cached or not
        s = k.shape[2]
        if memory_mask is not None and memory_mask.shape != (b, s):
            raise ValueError(
                f"the source mask must be (B, S) = {(b, s)}, got {tuple(memory_mask.shape)}"
            )
        key_mask = None if memory_mask is None else memory_mask.bool()
        y, _ = self.attend(q, k, v, None, key_mask, None)  # no structural mask
        return AttentionOutput(self.merge_heads(y))

    # ------------------------------------------------------------------ declared costs
    # Per decoder layer (lmlab.analysis.costs); kv_cache_bytes_per_token (2 K hd bytes, here per
    # *source* token) and score_flops_per_token (4 S H hd against S source keys) are inherited.

    @classmethod
    def kv_cache_bytes(
        cls, cfg: ModelConfig, batch: int, context: int, dtype_bytes: int = 4
    ) -> int:
        """Bytes this layer's cross cache holds for ``batch`` sources of ``context`` tokens: the
        key and value of the encoder output, computed once before decoding."""
        return batch * context * cls.kv_cache_bytes_per_token(cfg, dtype_bytes)

    def memory_matmul_params(self) -> int:
        """Weights applied once per source token rather than per decoder token: k_proj and
        v_proj on the encoder output (their result is cached)."""
        return self.k_proj.weight.numel() + self.v_proj.weight.numel()
