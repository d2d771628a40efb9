"""Position-wise feed-forward networks. Legend: D d_model, F d_ff; (B, T, D) -> (B, T, D)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.errors import ConfigError
from lmlab.nn.fused import fused_linear, global_hooks, linear, plain_linear, torch_hooks
from lmlab.nn.hooks import HookPoint
from lmlab.registry import Registry

if TYPE_CHECKING:
    from lmlab.config import ModelConfig

FFN: Registry[type[nn.Module]] = Registry("ffn", "model.ffn.kind")
FFN.notes = """
When to use: `mlp` for GPT-2, NeoX and BERT, with `model.ffn.activation` gelu (Hendrycks &
Gimpel 2016), gelu_tanh, relu or silu; relu2 (squared ReLU, So et al. 2021) for speedruns;
`swiglu` for Llama and Mistral, better loss per parameter (`model.ffn.two_thirds: true` keeps
the MLP's parameter count); `geglu` for Gemma and T5 v1.1;
`moe` for more parameters at the same FLOPs per token.

MoE conventions: each expert is a `model.ffn.expert` FFN (default swiglu), optionally with a
`shared_expert`; `model.ffn.router` picks the router (family `router`); the model returns
`aux_loss` and `expert_counts`. Two router losses:

- `model.ffn.aux_loss_coef` (default 0.01): load balancing E * sum_e f_e P_e pooled over layers,
  equal to Hugging Face's `load_balancing_loss_func` (= top_k under uniform routing) (Fedus et al.
  2021); always when training an MoE.
- `model.ffn.z_loss_coef` (default 0.001): the router z-loss mean(logsumexp(logits)^2) (Zoph et
  al. 2022, ST-MoE); router stability, especially in bf16.
"""

ActivationFn = Callable[[torch.Tensor], torch.Tensor]
# Elementwise activations by name (``model.ffn.activation``); a user may register another.
ACTIVATIONS: Registry[ActivationFn] = Registry("activation", "model.ffn.activation")


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (GPT-2's ``gelu_new``)."""
    return F.gelu(x, approximate="tanh")


ACTIVATIONS.register("gelu", "GELU, exact erf form (Hendrycks & Gimpel 2016).")(F.gelu)
ACTIVATIONS.register("gelu_tanh", "GELU, tanh approximation (GPT-2).")(gelu_tanh)
# the activations lmlab's bias + GELU operator computes (MLP._gelu_up)
_GELUS = (F.gelu, gelu_tanh)


def relu(x: torch.Tensor) -> torch.Tensor:
    """max(x, 0); its backward needs only its output (``saves_input = False``)."""
    return F.relu(x)


# An activation whose backward reads only its output saves no copy of its input: the training-
# memory declarations below count one F-wide tensor less for it (default: True).
relu.saves_input = False  # type: ignore[attr-defined]

ACTIVATIONS.register("relu", "max(x, 0) (Nair & Hinton 2010).")(relu)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU, max(x, 0)^2 (So et al. 2021, "Primer: Searching for Efficient Transformers
    for Language Modeling"; modded-nanogpt's MLP). Any shape and floating dtype, elementwise;
    its gradient 2 max(x, 0) is continuous at 0. Autograd keeps max(x, 0), one F-wide tensor
    like the input a GELU keeps, so the memory declarations count it as saving its input."""
    return torch.square(F.relu(x))


ACTIVATIONS.register("relu2", "max(x, 0)^2, squared ReLU (So et al. 2021, Primer).")(relu2)
ACTIVATIONS.register("silu", "x * sigmoid(x), a.k.a. swish (Elfwing et al. 2018).")(F.silu)


def refuse_fixed_activation(m: ModelConfig, field: str = "model.ffn.kind") -> None:
    """Refuse ``model.ffn.activation`` set (off its default) where nothing reads it: on an FFN
    kind whose gate activation is fixed (swiglu: silu, geglu: gelu), named by ``field``
    (``model.ffn.kind``, or ``model.ffn.expert`` for an MoE's experts). An encoder with its MLM
    head reads the field there, so it is accepted. Raises ConfigError naming the field."""
    f = m.ffn
    kind = f.kind if field == "model.ffn.kind" else f.expert
    fixed = getattr(FFN.get(kind, field), "fixed_activation", None)
    default = next(x.default for x in dataclasses.fields(f) if x.name == "activation")
    if fixed is None or f.activation == default or (m.kind == "encoder" and m.mlm_head):
        return
    key = field.rsplit(".", 1)[1]
    raise ConfigError(
        f"model.ffn.activation applies to {key}s mlp, gated only, not {kind} "
        f"(activation={f.activation} has no effect with {field}={kind}, whose gate activation "
        f"is {fixed}); drop it from the config (default {default}), or use {field}=gated for a "
        f"gated FFN with {f.activation}"
    )


def saved_ffn_bytes(ffn: nn.Module, act_bytes: int, cpu_kernels: bool = False) -> int | None:
    """``ffn.saved_activation_bytes(act_bytes, cpu_kernels=...)``: the bytes per token an FFN
    declares autograd keeps (:mod:`lmlab.training.memory`); ``cpu_kernels`` (lmlab's bf16 CPU
    training operators will run) is passed only to a declaration that takes it (an FFN
    registered elsewhere may declare ``act_bytes`` alone); None when it declares nothing."""
    declared = getattr(ffn, "saved_activation_bytes", None)
    if not callable(declared):
        return None
    if "cpu_kernels" in inspect.signature(declared).parameters:
        return int(declared(act_bytes, cpu_kernels=cpu_kernels))
    return int(declared(act_bytes))


def residual_parts(
    ffn: MLP | GatedMLP, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``ffn(x)`` as (its down projection without the bias, that bias) for a residual add that
    adds the bias itself (:func:`lmlab.nn.train_kernel.residual_add`: x + (y + bias) in one pass,
    the bias gradient summed in its backward's pass), or None where this does not apply (the
    caller calls the module): in bf16 autocast CPU training
    (:func:`lmlab.nn.train_kernel.residual_bias_applies`) when down_proj is a plain linear with
    a float32 bias and neither the module itself nor its ``hook_out`` is hooked (``hook_hidden``
    and the other projections' hooks still run). x (B, T, D) float32 or bfloat16 -> ((B, T, D)
    bfloat16, (D,) float32). Against ``ffn(x)`` (autocast's addmm, the bias rounded to bfloat16
    and added into the rounded output) y + bias is not rounded: the sum agrees to bf16 rounding,
    not bit for bit."""
    from lmlab.nn.train_kernel import residual_bias_applies

    down = ffn.down_proj
    if ffn.hook_out.fns or torch_hooks(ffn) or not plain_linear(down):
        return None
    weight, bias = down._parameters["weight"], down._parameters["bias"]
    if weight is None or bias is None or not residual_bias_applies(weight, bias):
        return None
    y = F.linear(ffn._hidden(x), weight)  # autocast: bf16 (B, T, D)
    return y, bias


@FFN.register("mlp")
class MLP(nn.Module):
    """down(act(up(x))) with d_ff hidden units (Vaswani et al. 2017)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        f = cfg.ffn
        self.act = ACTIVATIONS.get(f.activation, "model.ffn.activation")
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=f.bias)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=f.bias)
        self.down_proj.is_residual_proj = True  # type: ignore[assignment]
        self.hook_hidden = HookPoint()  # (B, T, F) act(up(x)), what down_proj reads
        self.hook_out = HookPoint()  # (B, T, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hook_out(linear(self.down_proj, self._hidden(x)))

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        """act(up_proj(x)) through ``hook_hidden``: (B, T, D) -> (B, T, F)."""
        hidden = self._gelu_up(x) if self.act in _GELUS else None
        if hidden is None:
            hidden = self.act(linear(self.up_proj, x))
        return self.hook_hidden(hidden)  # (B, T, F)

    def _gelu_up(self, x: torch.Tensor) -> torch.Tensor | None:
        """gelu(up_proj(x)) (exact, or gelu_tanh) through lmlab's one-pass bias + GELU operator
        in bf16 autocast CPU training (:func:`lmlab.nn.train_kernel.gelu_up`) when up_proj is a
        plain linear (no torch hooks, no global module hooks), else None."""
        up = self.up_proj
        if not torch.is_grad_enabled() or not plain_linear(up) or global_hooks():
            return None
        from lmlab.nn.train_kernel import gelu_up

        return gelu_up(x, up, tanh=self.act is gelu_tanh)

    def saved_activation_bytes(self, act_bytes: int, cpu_kernels: bool = False) -> int:
        """Bytes per token autograd keeps of the hidden activations for backward: up(x) and
        act(up(x)), 2 F elements of ``act_bytes`` each (:mod:`lmlab.training.memory`); 1 F
        when the activation's backward reads only its output (relu). ``cpu_kernels`` changes
        nothing here (the bias + GELU operator keeps what torch's path keeps)."""
        saved = 1 + int(getattr(self.act, "saves_input", True))
        return saved * self.up_proj.out_features * act_bytes


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): a gated linear unit (Shazeer 2020, "GLU Variants Improve
    Transformer"); subclasses fix the gate activation (``fixed_activation``, with which a
    non-default ``model.ffn.activation`` is refused) or read it (``gated``)."""

    activation = "silu"
    fixed_activation: ClassVar[str | None] = None  # the gate activation when it is not read

    @classmethod
    def check(cls, m: ModelConfig) -> None:
        """``model.ffn.activation`` left at its default when the kind fixes its activation."""
        refuse_fixed_activation(m)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        f = cfg.ffn
        self.act = ACTIVATIONS.get(self.activation, "model.ffn.activation")
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=f.bias)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=f.bias)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=f.bias)
        self.down_proj.is_residual_proj = True  # type: ignore[assignment]
        self.hook_hidden = HookPoint()  # (B, T, F) act(gate(x)) * up(x), what down_proj reads
        self.hook_out = HookPoint()  # (B, T, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hook_out(linear(self.down_proj, self._hidden(x)))

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate_proj(x)) * up_proj(x) through ``hook_hidden``: (B, T, D) -> (B, T, F)."""
        both = fused_linear(self, "gate_up", ("gate_proj", "up_proj"), x)
        if both is not None:  # inference: one matmul (lmlab.nn.fused)
            gate, up = both.chunk(2, dim=-1)  # (B, T, F) each
        else:
            gate, up = linear(self.gate_proj, x), linear(self.up_proj, x)
        hidden = self._silu_mul(gate, up) if self.act is F.silu else None
        if hidden is None:
            hidden = self.act(gate) * up
        return self.hook_hidden(hidden)

    @staticmethod
    def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up through lmlab's one-pass operator in bf16 autocast CPU training
        (:func:`lmlab.nn.train_kernel.silu_mul`), else None."""
        if not torch.is_grad_enabled():
            return None
        from lmlab.nn.train_kernel import silu_mul

        return silu_mul(gate, up)

    def saved_activation_bytes(self, act_bytes: int, cpu_kernels: bool = False) -> int:
        """Bytes per token autograd keeps for backward: gate(x), up(x), act(gate(x)) and the
        product, 4 F elements of ``act_bytes`` each (:mod:`lmlab.training.memory`); 3 F when
        the activation's backward reads only its output (ReGLU), or where silu(gate) * up is
        one operator that keeps gate and up only: ``cpu_kernels`` (bf16 CPU training without
        torch.compile, the estimate's caller decides), :func:`lmlab.nn.train_kernel.
        silu_mul_expected`, and this class's own forward (a subclass that overrides ``forward``
        or ``_hidden`` counts 4 F)."""
        saved = 3 + int(getattr(self.act, "saves_input", True))
        kind = type(self)  # a subclass with its own forward or _hidden may not take the operator
        ours = kind.forward is GatedMLP.forward and kind._hidden is GatedMLP._hidden
        if cpu_kernels and act_bytes == 2 and self.act is F.silu and ours:
            from lmlab.nn.train_kernel import silu_mul_expected

            saved -= int(silu_mul_expected())
        return saved * self.up_proj.out_features * act_bytes


@FFN.register("swiglu")
class SwiGLU(GatedMLP):
    """down(silu(gate(x)) * up(x)) (Shazeer 2020; Llama, Mistral)."""

    activation = fixed_activation = "silu"


@FFN.register("geglu")
class GeGLU(GatedMLP):
    """down(gelu(gate(x)) * up(x)) (Shazeer 2020; Gemma)."""

    activation = fixed_activation = "gelu"


@FFN.register("gated")
class GatedActivationMLP(GatedMLP):
    """down(act(gate(x)) * up(x)) with act = ``model.ffn.activation`` (Shazeer 2020): ReGLU with
    relu, T5 v1.1's gated-gelu with gelu_tanh (Raffel et al. 2020)."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.activation = cfg.ffn.activation
        super().__init__(cfg)


def build_ffn(cfg: ModelConfig) -> nn.Module:
    """The FFN named by ``cfg.ffn.kind``."""
    return FFN.get(cfg.ffn.kind, "model.ffn.kind")(cfg)
