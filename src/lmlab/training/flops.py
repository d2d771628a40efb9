"""FLOPs per token (the convention of Kaplan et al. 2020 and PaLM, Chowdhery et al. 2022).

forward  = 2 N + 4 L T d_attn      (N: parameters taking part in matmuls, i.e. all but the
                                     token-embedding lookup, the LM head counted even when tied,
                                     of MoE experts only the top_k a token is routed to;
                                     T: the training sequence length; d_attn = n_heads * head_dim;
                                     the QK^T and AV products over the full T, causal mask ignored)
training = 3 x forward              (backward costs twice the forward)

The count is the model kind's own (``flops_per_token`` on lmlab's model classes, built from
:mod:`lmlab.models.counting`), so the trainer's MFU and :func:`lmlab.analysis.costs.flops_per_token`
(``lmlab inspect``) are one number.
"""

from __future__ import annotations

from torch import nn

from lmlab.config import ModelConfig
from lmlab.models import counting


def matmul_params(model: nn.Module) -> int:
    """Parameters of every nn.Linear a token passes through (LM head included, counted even when
    tied): of an MoE layer's n_experts routed experts, only top_k count."""
    return counting.matmul_params(model)


def flops_per_token(
    model: nn.Module, cfg: ModelConfig, seq_len: int, train: bool = True, mask_prob: float = 0.15
) -> float:
    """FLOPs per token of one forward (``train=False``) or forward + backward pass, as the model
    kind counts them (its ``flops_per_token``): a decoder 2 N + 4 L T d_attn; an encoder (BERT)
    leaves out its pooler (once per sequence) and in training runs its MLM head on the
    ``mask_prob`` share of masked positions only (lmlab.models.encoder); an encoder-decoder
    counts per source + target token, of a pair with S = T = seq_len. ``cfg`` is the model's
    config (kept for the signature; the model carries its own). Raises LmlabError for a model
    class that declares no ``flops_per_token``."""
    method = counting.declared(model, "flops_per_token")
    return float(method(model, seq_len, train, mask_prob))
