"""Sigmoid attention: sigmoid(q k^T / sqrt(d_k) + b) v with b = -log(n) in place of the softmax
(Ramapuram et al. 2024, "Theory, Analysis, and Best Practices for Sigmoid Self-Attention"), as
one lmlab plugin file built on SoftmaxAttention's pieces (projections, mask, cache, merge).

Each weight is sigmoid of its own score, so rows need not sum to 1; the paper's bias b = -log(n)
keeps the initial row sum near 1. n is fixed at model.max_seq_len here, not the current length,
so a score does not change as the cache grows (cached decoding == the full pass).

    lmlab verify --plugin examples/plugins/sigmoid_attention.py \
        --config examples/plugins/sigmoid_attention.yaml
"""

import math

import torch

from lmlab.nn.attention import ATTENTION, AttentionOutput, SoftmaxAttention, repeat_kv
from lmlab.nn.masks import combine_masks


@ATTENTION.register("sigmoid_example")
class SigmoidAttention(SoftmaxAttention):
    """Sigmoid attention, w = sigmoid(q.k / sqrt(d_k) - log(max_seq_len)) (Ramapuram et al.
    2024); MHA, GQA or MQA, any mask, ALiBi/T5 biases added to the scores."""

    examples = (
        {},
        {"attention": {"n_kv_heads": 2}},
        {"attention": {"mask": "sliding_window", "window": 4}},
    )

    def __init__(self, cfg, layer_idx: int = 0) -> None:
        super().__init__(cfg, layer_idx)
        self.score_offset = -math.log(cfg.max_seq_len)  # b = -log(n)

    def forward(self, x, position, positions, key_mask=None, cache=None):
        """x (B, T, D) -> AttentionOutput(out (B, T, D)); arguments as
        :meth:`SoftmaxAttention.forward`. The weights (B, H, T, S) pass through ``hook_pattern``:
        that is what ``need_weights=True`` and ``run_with_cache`` return as its map."""
        t = x.shape[1]
        q, k, v = self.project(x, position, positions)  # (B, H, T, hd), (B, K, T, hd) x 2
        if cache is not None:
            k, v = cache.update(k, v)  # (B, K, S, hd)
        s = k.shape[2]
        rep = self.n_heads // self.n_kv_heads
        k, v = repeat_kv(k, rep), repeat_kv(v, rep)  # (B, H, S, hd)
        if key_mask is not None:
            key_mask = key_mask[:, -s:]  # a sliding cache keeps only the last keys
        mask, empty = combine_masks(self.mask_fn(t, s, x.device, self.window), key_mask)
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale + self.score_offset
        bias = position.score_bias(positions, s)  # (H, T, S) or None
        if bias is not None:
            scores = scores + bias.to(scores.dtype)
        # sigmoid(-inf) = 0: masked keys weigh 0, and backward keeps one (B, H, T, S) tensor
        w = torch.sigmoid(scores.masked_fill(~mask, float("-inf")))  # (B, H, T, S)
        if empty is not None:  # a query with no visible key (padding) outputs 0
            w = w.masked_fill(empty, 0.0)
        w = self.hook_pattern(w)  # the attention map; a hook may read or replace it
        if self.training and self.dropout > 0.0:
            w = torch.nn.functional.dropout(w, p=self.dropout)
        y = torch.matmul(w, v)  # (B, H, T, hd)
        return AttentionOutput(self.merge_heads(y))
