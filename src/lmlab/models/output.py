"""What a model's forward pass returns."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmlab.nn.kv_cache import KVCache


@dataclass
class ModelOutput:
    """logits (B, T, V) float (float32 when computed under autocast for the loss; an encoder
    given targets: (M, V), its M masked positions only, see EncoderLM.forward); loss: mean
    cross-entropy in nats/token (scalar) when targets were given; cache: the updated KV cache;
    hidden_states: the residual stream entering each layer plus the final output, each (B, T, D);
    attentions: per layer (B, H, T, S) weights when requested; aux_loss: the weighted sum of the MoE
    layers' auxiliary losses (load balancing + router z-loss, scalar float32; None without MoE),
    not included in ``loss``; expert_counts: per MoE layer, (E,) int64 tokens routed to each
    expert (summing to B*T*top_k)."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    cache: KVCache | None = None
    hidden_states: list[torch.Tensor] = field(default_factory=list)
    attentions: list[torch.Tensor | None] = field(default_factory=list)
    aux_loss: torch.Tensor | None = None
    expert_counts: list[torch.Tensor] = field(default_factory=list)
