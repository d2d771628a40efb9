"""DELIBERATELY WRONG: softmax attention whose KV cache silently drops its oldest key once it
holds 8 tokens, while still counting every token seen (so positions stay right).

The full forward pass is correct; only cached decoding past 8 tokens is wrong, which is what
``lmlab verify --plugin`` must catch (its kv_cache and cache_bytes checks fail).
"""

import torch

from lmlab.nn.attention import ATTENTION, SoftmaxAttention
from lmlab.nn.kv_cache import LayerKVCache

CAPACITY = 8  # keys kept: the bug (a full cache keeps every key)


class ForgetfulKVCache(LayerKVCache):
    """A dynamic cache that keeps only the last CAPACITY keys/values but reports all seen."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen += k.shape[2]
        k, v = super().update(k, v)  # this step reads every key it was given ...
        self.k, self.v = k[:, :, -CAPACITY:], v[:, :, -CAPACITY:]  # ... the next: the last 8
        return k, v

    @property
    def seq_len(self) -> int:
        return self.seen


@ATTENTION.register("forgetful")
class ForgetfulAttention(SoftmaxAttention):
    """Softmax attention with a cache that drops keys past CAPACITY tokens."""

    def new_cache(self) -> ForgetfulKVCache:
        return ForgetfulKVCache()
