"""FLOPs per token (the convention of Kaplan et al. 2020 and PaLM, Chowdhery et al. 2022).

forward  = 2 N + 4 L T d_attn      (N: parameters taking part in matmuls, i.e. all but the
                                     token-embedding lookup, the LM head counted even when tied,
                                     of MoE experts only the top_k a token is routed to;
                                     T: the training sequence length; d_attn = n_heads * head_dim;
                                     the QK^T and AV products over the full T, causal mask ignored)
training = 3 x forward              (backward costs twice the forward)
"""

from __future__ import annotations

from torch import nn

from lmlab.config import ModelConfig
from lmlab.nn.moe import MoE


def matmul_params(model: nn.Module) -> int:
    """Parameters of every nn.Linear a token passes through (LM head included, counted even when
    tied): of an MoE layer's n_experts routed experts, only top_k count."""
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        n -= (moe.n_experts - moe.top_k) * matmul_params(moe.experts[0])
    return n


def flops_per_token(
    model: nn.Module, cfg: ModelConfig, seq_len: int, train: bool = True, mask_prob: float = 0.15
) -> float:
    """FLOPs per token of one forward (``train=False``) or forward + backward pass.

    An encoder (BERT) is counted by :func:`lmlab.analysis.costs.flops_per_token`: its pooler
    runs once per sequence (left out) and in training its MLM head runs on the ``mask_prob``
    share of masked positions only (lmlab.models.encoder). An encoder-decoder too: per source +
    target token (what the seq2seq objectives count as tokens), of a pair with S = T = seq_len."""
    if cfg.kind in ("encoder", "encoder_decoder"):
        from lmlab.analysis.costs import flops_per_token as closed_form

        return float(closed_form(cfg, seq_len, train, mask_prob))
    d_attn = cfg.attention.n_heads * cfg.head_dim
    fwd = 2 * matmul_params(model) + 4 * cfg.n_layers * seq_len * d_attn
    return 3.0 * fwd if train else float(fwd)
