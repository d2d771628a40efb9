"""Mixture-of-Experts feed-forward layer: a router sends each token to top_k of n_experts FFNs.

Legend: B batch, T tokens, N = B*T tokens routed, D d_model, F d_ff (per expert), E n_experts,
k top_k. The layer maps (B, T, D) -> (B, T, D) like every FFN.

y = sum_{e in top-k(x)} g_e(x) * expert_e(x)  [+ shared(x)]
(Shazeer et al. 2017 "Outrageously Large Neural Networks"; Fedus et al. 2021 "Switch
Transformers"; Jiang et al. 2024 "Mixtral of Experts"; a shared expert applied to every token as in
Dai et al. 2024 "DeepSeekMoE").

The router is a bias-free linear D -> E computed in float32 (float64 in a float64 model) even
under autocast (the Switch Transformer's "selective precision"). How its logits become the gates g
is a registered router (``model.ffn.router``): ``topk_softmax`` or ``softmax_topk``. Training adds
two auxiliary losses, weighted by ``aux_loss_coef`` and ``z_loss_coef`` and returned by the model
as ``aux_loss``: the load-balancing loss (:func:`load_balancing_loss`) and the router z-loss
(:func:`router_z_loss`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.checks import choice, positive
from lmlab.errors import ConfigError
from lmlab.nn.ffn import FFN, refuse_fixed_activation, saved_ffn_bytes
from lmlab.nn.hooks import HookPoint
from lmlab.registry import Registry

if TYPE_CHECKING:
    from lmlab.config import ModelConfig

RouterFn = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
ROUTERS: Registry[RouterFn] = Registry("router", "model.ffn.router")
ROUTERS.notes = """
Selected by `model.ffn.router` (for `ffn.kind: moe`). When to use: `topk_softmax` (= Mixtral's
softmax, top-k, renormalise) for Mixtral and top_k >= 2; `softmax_topk` for top-1 (Switch)
routing, where the LM loss must still train the router.
"""


@ROUTERS.register("topk_softmax", examples=({"ffn": {"kind": "moe"}},))
def topk_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax after top-k: the k largest logits, softmax over those k (Mixtral, Jiang et al. 2024).

    Identical to Hugging Face's Mixtral router (softmax over all E, take top-k, renormalise to sum
    1). The gates sum to 1, so with top_k 1 the gate is always 1 and the router learns only from
    the auxiliary losses. logits (N, E) float -> (gates (N, k) float, expert ids (N, k) int64).
    """
    top, idx = logits.topk(k, dim=-1)
    return torch.softmax(top, dim=-1), idx


@ROUTERS.register(
    "softmax_topk", examples=({"ffn": {"kind": "moe", "top_k": 1, "shared_expert": True}},)
)
def softmax_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax before top-k: softmax over all E, keep the k largest probabilities as gates,
    not renormalised (Switch Transformer, Fedus et al. 2021; DeepSeekMoE, Dai et al. 2024).

    The gates sum to less than 1, so even with top_k 1 the LM loss trains the router.
    logits (N, E) float -> (gates (N, k) float, expert ids (N, k) int64).
    """
    return torch.softmax(logits, dim=-1).topk(k, dim=-1)


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor], top_k: int, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Switch Transformer's load-balancing loss (Fedus et al. 2021, eqs. 4-6) generalised to top-k
    as Mixtral does; the same number as Hugging Face's Mixtral ``load_balancing_loss_func``.

    router_logits: one (N, E) tensor per MoE layer; all layers are pooled into L*N rows.
    mask: optional (N,) bool/float, 1 for tokens that count (padding 0), shared by every layer.

        p = softmax(logits)                          (rows, E)
        f_e = #(row, slot) with expert e among the top-k of p, / rows   (sum_e f_e = top_k)
        P_e = mean over rows of p_e                                      (sum_e P_e = 1)
        loss = E * sum_e f_e * P_e

    Value under uniform routing: exactly ``top_k``, both when the router probabilities are uniform
    (P_e = 1/E) and when the assignments are balanced (f_e = top_k/E). So it is 1 for top-1 routing
    (the Switch Transformer's normalisation, where f sums to 1) and top_k in general: this
    formula does not divide f by top_k. Scalar float32 tensor, differentiable through P only.
    """
    n_experts = router_logits[0].shape[-1]
    probs = [torch.softmax(x.float(), dim=-1) for x in router_logits]
    w = None if mask is None else mask.reshape(-1, 1).float()  # (N, 1)
    counts = torch.zeros(n_experts, device=probs[0].device)
    prob_sum = torch.zeros(n_experts, device=probs[0].device)
    rows = torch.zeros((), device=probs[0].device)
    for p in probs:
        chosen = F.one_hot(p.topk(top_k, dim=-1).indices, n_experts).sum(1).float()  # (N, E)
        if w is not None:
            chosen, p, n = chosen * w, p * w, w.sum()
        else:
            n = torch.tensor(float(p.shape[0]), device=p.device)
        counts, prob_sum, rows = counts + chosen.sum(0), prob_sum + p.sum(0), rows + n
    return n_experts * torch.sum((counts / rows) * (prob_sum / rows))


def router_z_loss(
    router_logits: Sequence[torch.Tensor], mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Router z-loss (Zoph et al. 2022 "ST-MoE", eq. 5): mean over all routed rows of every layer
    of (log sum_e exp(logit_e))^2. Keeps router logits small for numerical stability.
    router_logits: one (N, E) tensor per layer; mask: optional (N,) bool/float, 1 for tokens that
    count (padding 0), shared by every layer: the mean is over those rows only. -> scalar float32
    tensor (>= 0; (log E)^2 when all logits are 0)."""
    z2 = torch.stack([torch.logsumexp(x.float(), dim=-1) for x in router_logits]).pow(2)  # (L, N)
    if mask is None:
        return z2.mean()
    w = mask.reshape(1, -1).float()  # (1, N)
    return (z2 * w).sum() / (w.sum() * z2.shape[0])


@FFN.register("moe")
class MoE(nn.Module):
    """Mixture of Experts: top_k of n_experts FFNs per token, optional shared expert
    (Shazeer et al. 2017; Fedus et al. 2021; Jiang et al. 2024 "Mixtral"; Dai et al. 2024).

    Each expert (and the shared expert) is the FFN named by ``model.ffn.expert`` with ``d_ff``
    hidden units. After each forward the layer holds its router logits (N, E) float32 and its
    per-expert token counts (E,) int64 until :func:`moe_losses` takes them.
    """

    keep_float = ("router",)  # lmlab.nn.quant leaves it float (its weight is read directly)

    options = (
        "n_experts",
        "top_k",
        "router",
        "expert",
        "shared_expert",
        "aux_loss_coef",
        "z_loss_coef",
    )

    @staticmethod
    def check(m: ModelConfig) -> None:
        """An expert kind other than moe; 1 <= top_k <= n_experts; loss weights >= 0;
        ``model.ffn.activation`` at its default when the expert kind fixes its activation."""
        f = m.ffn
        choice(f.expert, [k for k in FFN.names() if k != "moe"], "model.ffn.expert")
        refuse_fixed_activation(m, "model.ffn.expert")
        positive(f.n_experts, "model.ffn.n_experts")
        positive(f.top_k, "model.ffn.top_k")
        if f.top_k > f.n_experts:
            raise ConfigError(
                f"model.ffn.top_k ({f.top_k}) must not exceed model.ffn.n_experts ({f.n_experts})"
            )
        positive(f.aux_loss_coef, "model.ffn.aux_loss_coef", allow_zero=True)
        positive(f.z_loss_coef, "model.ffn.z_loss_coef", allow_zero=True)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        f = cfg.ffn
        self.n_experts, self.top_k = f.n_experts, f.top_k
        self.aux_loss_coef, self.z_loss_coef = f.aux_loss_coef, f.z_loss_coef
        self.route = ROUTERS.get(f.router, "model.ffn.router")
        expert_cfg = dataclasses.replace(cfg, ffn=dataclasses.replace(f, kind=f.expert))
        expert_cls = FFN.get(f.expert, "model.ffn.expert")
        self.router = nn.Linear(cfg.d_model, f.n_experts, bias=False)
        self.experts = nn.ModuleList(expert_cls(expert_cfg) for _ in range(f.n_experts))
        self.shared_expert = expert_cls(expert_cfg) if f.shared_expert else None
        self.router_logits: torch.Tensor | None = None
        self.expert_counts: torch.Tensor | None = None
        self.hook_router_logits = HookPoint()  # (N, E) float32, N = B T
        self.hook_choices = HookPoint()  # (N, top_k) int64 expert indices
        self.hook_gates = HookPoint()  # (N, top_k) the chosen experts' weights
        self.hook_out = HookPoint()  # (B, T, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, D) -> (B, T, D), same dtype."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, D)
        dtype = torch.promote_types(self.router.weight.dtype, torch.float32)  # at least float32
        with torch.autocast(flat.device.type, enabled=False):
            logits = F.linear(flat.to(dtype), self.router.weight.to(dtype))  # (N, E)
        logits = self.hook_router_logits(logits)
        gates, idx = self.route(logits, self.top_k)  # (N, k), (N, k)
        gates, idx = self.hook_gates(gates), self.hook_choices(idx)
        # Each (token, slot) pair belongs to one expert: writing into (N, k, D) slots and summing
        # is deterministic (no atomic scatter-add) and runs every expert, even on 0 tokens.
        slots = flat.new_zeros(flat.shape[0], self.top_k, flat.shape[-1])  # (N, k, D)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(idx == e)
            y = expert(flat[token]) * gates[token, slot, None]
            slots[token, slot] = y.to(slots.dtype)
        out = slots.sum(1)  # (N, D)
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        self.router_logits = logits
        with torch.no_grad():
            experts = torch.arange(self.n_experts, device=idx.device)
            self.expert_counts = (idx[..., None] == experts).sum((0, 1))  # (E,) int64
        return self.hook_out(out.reshape(shape).to(x.dtype))

    # ------------------------------------------------------------------ what a token uses
    # Only the layer knows its routing: these answer for it in the parameter and FLOP counts
    # (lmlab.models.counting) and the memory estimate (lmlab.training.memory).

    def active_params(self) -> int:
        """Parameters one token uses: the router, top_k routed experts and the shared expert
        (all parameters less the n_experts - top_k idle experts)."""
        per_expert = sum(p.numel() for p in self.experts[0].parameters())
        total = sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
        return total - (self.n_experts - self.top_k) * per_expert

    def matmul_params_per_token(self) -> int:
        """Matmul weights one token is multiplied by: the router (D x E), top_k routed experts
        and the shared expert (biases left out)."""

        def linear(module: nn.Module) -> int:
            return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))

        shared = linear(self.shared_expert) if self.shared_expert is not None else 0
        return self.router.weight.numel() + self.top_k * linear(self.experts[0]) + shared

    def saved_activation_bytes(self, act_bytes: int, cpu_kernels: bool = False) -> int:
        """Bytes per token autograd keeps for backward: the hidden activations of the top_k
        (+ shared) experts it visits and the float32 router logits (4 E)."""
        used = self.top_k + int(self.shared_expert is not None)
        expert = saved_ffn_bytes(self.experts[0], act_bytes, cpu_kernels)
        if expert is None:  # an expert kind that declares nothing: up(x) and act(up(x)), 2 F
            widths = [m.out_features for m in self.experts[0].modules() if isinstance(m, nn.Linear)]
            expert = 2 * max(widths, default=0) * act_bytes
        return used * expert + 4 * self.n_experts


def moe_losses(
    module: nn.Module, token_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """Take the routing of every MoE layer in ``module`` after a forward pass.

    token_mask: optional (B, T) (or (N,)) bool/int, 1 = real token, 0 = padding, for the tokens
    of that forward pass: padding is left out of the load-balancing fractions and the z-loss mean
    (it is still routed and counted in expert_counts).

    Returns (aux_loss, expert_counts): aux_loss = aux_loss_coef * load_balancing_loss +
    z_loss_coef * router_z_loss over all MoE layers pooled (scalar float32 tensor), and one (E,)
    int64 tensor of token counts per MoE layer (summing to N * top_k). (None, []) when the module
    has no MoE layer. The layers' held logits are released.
    """
    layers = [m for m in module.modules() if isinstance(m, MoE) and m.router_logits is not None]
    if not layers:
        return None, []
    logits = [m.router_logits for m in layers if m.router_logits is not None]
    counts = [m.expert_counts for m in layers if m.expert_counts is not None]
    for m in layers:
        m.router_logits = m.expert_counts = None
    first = layers[0]
    mask = None if token_mask is None else token_mask.reshape(-1)  # (N,)
    aux = first.aux_loss_coef * load_balancing_loss(logits, first.top_k, mask)
    aux = aux + first.z_loss_coef * router_z_loss(logits, mask)
    return aux, counts
