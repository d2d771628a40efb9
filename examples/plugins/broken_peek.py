"""DELIBERATELY WRONG: softmax attention whose mask lets each query see the next token too.

Training loss drops fast (the model copies the next token), and generation is garbage: this is
the bug ``lmlab verify --plugin`` must catch (its causality and kv_cache checks fail).
"""

import torch

from lmlab.nn.attention import ATTENTION, SoftmaxAttention


def peek_mask(t: int, s: int, device=None, window=None) -> torch.Tensor:
    """(T, S) bool: query i sees keys 0 .. i + 1 (one too many). Queries are the last T keys."""
    q = torch.arange(s - t, s, device=device).unsqueeze(1)
    k = torch.arange(s, device=device).unsqueeze(0)
    return k <= q + 1  # the bug: causal is k <= q


@ATTENTION.register("peek")
class PeekAttention(SoftmaxAttention):
    """Softmax attention with an off-by-one causal mask (a query sees the next token)."""

    def __init__(self, cfg, layer_idx: int = 0) -> None:
        super().__init__(cfg, layer_idx)
        self.mask_fn = peek_mask
