"""Peak training memory, estimated from the config before anything is allocated.

Legend: P parameters, B train.batch_size (one micro-batch), T train.seq_len, L n_layers,
D d_model, H heads, K kv heads, hd head_dim, F d_ff, V vocab, E experts, k experts per token
(top_k, +1 with a shared expert; 1 without MoE), a bytes per activation (2 under bf16 autocast,
4 in fp32). In bytes:

    weights      4 P    fp32 master weights
    gradients    4 P    fp32
    optimizer    8 P    AdamW's exp_avg and exp_avg_sq, fp32 (train.optimizer: muon: 4 per
                        parameter Muon holds, its momentum buffer, and 8 for the rest)
    autocast     2 P    the bf16 weight copies autocast keeps for backward (bf16 only)
    activations  B T [L (8 D + a (2 D + (3 H + 2 K) hd + n + c k F + s) + 4 E) + (4 + a) D
                 + (a + 8) V]

Activations are what autograd keeps for the backward pass, per token: in each layer the two norm
inputs (the residual stream, float32 even under autocast: 8 D) and, at a bytes each, the two norm
outputs (2 D), q, k and v (after RoPE), the attention output and its reshaped copy that o_proj
reads ((3 H + 2 K) hd), the outputs of the head norms where there are any (n: H hd for QK-norm's
q, K hd each for its k and V-norm's v; HybridNorm has all three), the FFN's hidden activations
(c F per expert used: c = 2 for mlp, the up projection and its activation, c = 1 with relu,
whose backward reads only its output; c = 4 for swiglu/geglu, gate, up, act(gate) and the
product, 3 with relu, and 3 for swiglu in bf16 CPU training, whose one-pass silu(gate) * up
keeps gate and up only), the attention scores and probabilities where they are materialised
(s = 2 H T for ``attention.backend: math``; 0 for sdpa, whose fused kernels keep one log-sum-exp
per row, except H T, the bf16 probabilities, where bf16 training on a CPU takes its batched-matmul
path, T <= 256: ``_bmm_causal_elements``; linear attention's parallel form keeps its
similarities, their normalised weights and the feature maps phi(q), phi(k): 2 H T + (H + K) hd),
and the float32 router logits of an MoE layer (4 E); then the final norm's input and output
((4 + a) D) and the logits with their float32 log-probabilities and gradient at the start of
backward ((a + 8) V). This is the count of Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", sec. 4.1) for lmlab's components;
tests/unit/test_memory.py checks it against the tensors autograd actually saves.

Measured on CPU (the default Mini-GPT: batch 16 and 64, fp32 and bf16, sdpa and math), the
process's peak resident memory grew 1.5-1.65x this estimate: backward's temporaries and the C
allocator's fragmentation come on top. The check therefore refuses only runs that cannot fit
even at the estimate; a run estimated at more than about 60% of the free memory may still run
out.

P is exact: the model is built on PyTorch's ``meta`` device, which records shapes but allocates
nothing, so even a configuration far too large for the machine is measured without harm (a few
milliseconds once torch._dynamo is imported, which meta tensors and AdamW both do).
Gradient accumulation does not raise the peak (micro-batches run one after another).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmlab.config import RunConfig, TrainConfig
from lmlab.errors import LmlabError


@dataclass
class MemoryEstimate:
    """Estimated peak bytes of one training process, by term (see the module docstring)."""

    parameters: int  # P, the parameter count (tied weights once)
    weights: int
    gradients: int
    optimizer: int
    autocast: int
    activations: int
    muon_parameters: int = 0  # of P, those Muon holds (train.optimizer: muon), 4 bytes of state

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.autocast + self.activations


def count_parameters(cfg: RunConfig) -> int:
    """Exact parameter count of ``cfg.model`` (vocab_size set), built on the meta device."""
    from lmlab.models.counting import meta_model, num_params

    return num_params(meta_model(cfg.model))


def _first(model: torch.nn.Module, family: Any) -> torch.nn.Module | None:
    """The first module of ``model`` (in module order) that is a variant of ``family``."""
    from lmlab.models.counting import variant_types

    types = variant_types(family)
    return next((m for m in model.modules() if isinstance(m, types)), None)


def _cpu_kernels(t: TrainConfig, a: int) -> bool:
    """Whether lmlab's bf16 CPU training operators will run for ``t`` (bf16, not compiled, on
    the CPU): what an FFN's declaration may count fewer tensors for (``cpu_kernels``)."""
    from lmlab.training.hardware import resolve_device

    if a != 2 or t.compile:
        return False
    try:
        return resolve_device(t.device).type == "cpu"
    except LmlabError:  # a device this machine lacks (a CUDA run planned here): not the CPU's
        return False


def estimate_training_memory(cfg: RunConfig) -> MemoryEstimate:
    """Peak bytes of training ``cfg`` (model.vocab_size must be set); nothing is allocated.

    The FFN's hidden activations (c k F a, and an MoE layer's router logits) are what the FFN
    module declares (``saved_activation_bytes``; 2 F a for an FFN that declares nothing), the
    attention's score tensors (s) what its class declares (``saved_score_elements``; 0 when
    it declares nothing), a block's extra residual-stream tensors what the block declares
    (``saved_stream_bytes``, hyper-connections' n streams; 0 when it declares nothing)."""
    from lmlab.models.counting import meta_model, num_params
    from lmlab.nn.attention import ATTENTION, Attention
    from lmlab.nn.block import BLOCK
    from lmlab.nn.ffn import FFN, saved_ffn_bytes

    m, t = cfg.model, cfg.train
    model = meta_model(m)
    p = num_params(model)
    from lmlab.training.hardware import planned_precision

    a = 2 if planned_precision(t) == "bf16" else 4
    seq = t.seq_len or m.max_seq_len
    hd, h, kv = m.head_dim, m.attention.n_heads, m.n_kv_heads
    ffn, attn = _first(model, FFN), _first(model, ATTENTION)
    declared = None if ffn is None else saved_ffn_bytes(ffn, a, _cpu_kernels(t, a))
    hidden = declared if declared is not None else 2 * m.d_ff * a
    saved_scores = getattr(type(attn), "saved_score_elements", None)
    s = saved_scores(m, seq) if saved_scores is not None else 0
    d = m.d_model
    n = attn.saved_norm_elements() if isinstance(attn, Attention) else 0  # QK/V-norm outputs
    qkv = getattr(attn, "saved_projection_elements", None)  # declared (MLA) or q, k, v, y, o
    p_ = qkv() if callable(qkv) else (3 * h + 2 * kv) * hd
    saved_stream = getattr(_first(model, BLOCK), "saved_stream_bytes", None)  # a wider stream
    stream = saved_stream(a) if callable(saved_stream) else 0
    per_layer = 8 * d + a * (2 * d + p_ + n + s) + hidden + stream
    per_token = m.n_layers * per_layer + (4 + a) * d + (a + 8) * (m.vocab_size or 0)
    per_token += a * _bmm_causal_elements(model, t, seq, a)
    activations = t.batch_size * seq * per_token
    p_muon = _muon_parameters(model, t)
    optimizer = 4 * p_muon + 8 * (p - p_muon)
    return MemoryEstimate(p, 4 * p, 4 * p, optimizer, 2 * p if a == 2 else 0, activations, p_muon)


def _bmm_causal_elements(model: torch.nn.Module, t: Any, seq: int, a: int) -> int:
    """Per token: the probabilities (H T elements, at ``a`` bytes) that the bf16 CPU causal
    attention path keeps for backward (:func:`lmlab.nn.attention_core.causal_attention_train`:
    the fused kernel keeps them in row pairs, ceil(T / 2) x T rounded up to 16 words of two
    bf16, the same bytes where 16 divides T; the batched matmuls as (T, T) bf16) in every
    attention module that takes it; the ``sdpa`` backend's fused kernels keep none, so
    its ``saved_score_elements`` says 0. The path is taken (``attend``'s causal fast path, then
    :func:`~lmlab.nn.attention_core.bmm_causal_applies`) under bf16 on a CPU without
    ``train.compile``, for the ``sdpa`` backend with no attention dropout, a plain causal mask,
    no score bias from the position encoding, no kv-head sharing by the kernel (GQA on
    torch >= 2.5) and 1 < T <= ``BMM_CAUSAL_MAX_T``, in the self-attention of the kinds softmax,
    differential and mla (tests/unit/test_memory.py counts the calls of every kind), GQA too
    where the fused kernel runs (it shares kv heads itself). 0 when the run would not take it."""
    from lmlab.nn import attention_core as core
    from lmlab.nn.attention import SoftmaxAttention
    from lmlab.nn.differential import DifferentialAttention
    from lmlab.nn.masks import causal_mask
    from lmlab.nn.mla import MultiHeadLatentAttention
    from lmlab.nn.position import PositionEncoding
    from lmlab.training.hardware import resolve_device

    if a != 2 or t.compile or not 1 < seq <= core.BMM_CAUSAL_MAX_T:
        return 0
    try:
        device = resolve_device(t.device)
    except LmlabError:
        device = torch.device("cpu")
    if device.type != "cpu":
        return 0
    biased = any(
        isinstance(p, PositionEncoding) and type(p).score_bias is not PositionEncoding.score_bias
        for p in model.modules()
    )
    if biased:
        return 0
    total = 0
    for mod in model.modules():
        if (
            # the kinds whose training forward reaches attend's causal fast path (sink, sigmoid,
            # MoBA, NSA, linear and cross-attention compute theirs otherwise): a test spies on
            # the calls of every registered kind
            type(mod) in (SoftmaxAttention, DifferentialAttention, MultiHeadLatentAttention)
            and getattr(mod, "backend_fn", None) is core.attention_sdpa
            and getattr(mod, "mask_fn", None) is causal_mask
            and getattr(mod, "dropout", 1.0) == 0.0
        ):
            total += sum(
                _p_elements(h, hd, hdv, gqa, seq) for h, hd, hdv, gqa in _attend_calls(mod)
            )
    return total


def _attend_calls(mod: Any) -> list[tuple[int, int, int, bool]]:
    """The causal attention calls of one training forward of an attention module of the kinds
    softmax, differential and mla: (query heads, q's head dim, v's head dim, whether k and v
    have fewer heads than q)."""
    from lmlab.nn.differential import DifferentialAttention
    from lmlab.nn.mla import MultiHeadLatentAttention

    h, kv, hd = mod.n_heads, mod.n_kv_heads, mod.head_dim
    if isinstance(mod, DifferentialAttention):  # two maps of H/2 heads, v of 2 hd
        return [(h // 2, hd, 2 * hd, h // 2 != kv // 2)] * 2
    if isinstance(mod, MultiHeadLatentAttention):
        d = mod.dims  # absorbed: one shared latent "kv head" of c + r channels, v the latent
        if d.absorb:
            return [(h, d.kv_lora_rank + d.rope, d.kv_lora_rank, h != 1)]
        return [(h, d.nope + d.rope, d.v, False)]
    return [(h, hd, hd, h != kv)]


def _p_elements(h: int, hd: int, hdv: int, gqa: bool, seq: int) -> int:
    """Per query token, the bf16 elements of P that a causal call of h query heads with these
    head dims keeps (given that ``bmm_causal_applies``). The fused kernel, where it will run
    (:func:`lmlab.nn.train_kernel.attention_bf16_expected`, head dims multiples of 16, GQA
    included): ceil(T / 2) row pairs of T rounded up to 16 per head, H (T + 15) // 16 * 16
    when T is even (rounded up per token). Else the batched matmuls, H T, unless torch's kernel
    shares the kv heads (GQA on torch >= 2.5), which keeps none."""
    from lmlab.nn import attention_core as core
    from lmlab.nn import train_kernel

    if core.fused_attention_takes(hd, hdv) and train_kernel.attention_bf16_expected():
        per_sequence = h * 2 * ((seq + 1) // 2) * ((seq + 15) // 16 * 16)
        return -(-per_sequence // seq)
    return 0 if gqa and core.SDPA_GQA else h * seq


def _muon_parameters(model: torch.nn.Module, t: Any) -> int:
    """How many parameters Muon holds under ``train.optimizer: muon``
    (:func:`lmlab.training.optim.muon_param_names`), 0 under AdamW. Optimizer state: Muon's one
    fp32 momentum buffer (4 bytes) for these, AdamW's two fp32 moments (8) for the rest."""
    from lmlab.training.optim import muon_param_names

    if t.optimizer != "muon":
        return 0
    params = dict(model.named_parameters())
    return sum(params[n].numel() for n in muon_param_names(model))


MEMINFO = Path("/proc/meminfo")
PROC_CGROUP = Path("/proc/self/cgroup")  # which cgroup this process is in
CGROUP_ROOT = Path("/sys/fs/cgroup")  # where cgroup v2 (unified) or v1 is mounted
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def _read_int(path: Path) -> int | None:
    """The integer in a small /proc or /sys file ("max" or unreadable: None)."""
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def _cgroup_dirs() -> list[tuple[Path, str]]:
    """(folder, "v2" or "v1") of the memory cgroup(s) of this process, innermost first, from
    /proc/self/cgroup; the mount root as a fallback."""
    out: list[tuple[Path, str]] = []
    try:
        lines = PROC_CGROUP.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        lines = []
    for line in lines:
        parts = line.split(":", 2)  # hierarchy-id:controllers:path
        if len(parts) != 3:
            continue
        rel = parts[2].lstrip("/")
        if parts[0] == "0" and parts[1] == "":
            out.append((CGROUP_ROOT / rel, "v2"))
        elif "memory" in parts[1].split(","):
            out.append((CGROUP_ROOT / "memory" / rel, "v1"))
    out += [(CGROUP_ROOT, "v2"), (CGROUP_ROOT / "memory", "v1")]
    return out


def cgroup_memory_free() -> tuple[int, str] | None:
    """(bytes the container's memory limit still allows, where it comes from), or None where no
    limit applies: cgroup v2 ``memory.max`` - ``memory.current``, cgroup v1
    ``memory.limit_in_bytes`` - ``memory.usage_in_bytes``, of this process's cgroup (or the
    mount root when /proc/self/cgroup names none)."""
    for folder, version in _cgroup_dirs():
        names = (
            ("memory.max", "memory.current")
            if version == "v2"
            else ("memory.limit_in_bytes", "memory.usage_in_bytes")
        )
        limit_file = folder / names[0]
        if not limit_file.is_file():
            continue
        limit = _read_int(limit_file)
        if limit is None or limit >= _UNLIMITED:
            continue  # "max": no limit at this level
        used = _read_int(folder / names[1]) or 0
        return max(limit - used, 0), f"the cgroup memory limit in {limit_file}"
    return None


def available_memory(device: torch.device) -> tuple[int, str] | None:
    """(bytes free for this process, where the number comes from), or None where unknown.

    cuda: ``torch.cuda.mem_get_info`` (free device memory); cpu: the smaller of ``MemAvailable``
    in /proc/meminfo and what the container's cgroup memory limit leaves
    (:func:`cgroup_memory_free`) (Linux); other devices and systems: None (no check).
    """
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free), f"free memory on {torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        found: list[tuple[int, str]] = []
        try:
            text = MEMINFO.read_text()
        except OSError:
            text = ""
        match = re.search(r"^MemAvailable:\s+(\d+)\s*kB", text, re.MULTILINE)
        if match:
            found.append((int(match.group(1)) * 1024, "MemAvailable in /proc/meminfo"))
        cgroup = cgroup_memory_free()
        if cgroup is not None:
            found.append(cgroup)
        return min(found) if found else None
    return None


def check_load_memory(nbytes: int, device: torch.device, what: str) -> None:
    """Refuse to load a model whose tensors need ``nbytes`` (estimated from the file's config and
    headers, before any is allocated) when that exceeds the memory available on ``device``
    (:func:`available_memory`, the cgroup limit included). Raises LmlabError naming ``what``."""
    free = available_memory(device)
    if free is not None and nbytes > free[0]:
        raise LmlabError(
            f"{what} needs about {format_bytes(nbytes)} of memory to load, more than the "
            f"{format_bytes(free[0])} available on {device.type} ({free[1]})"
        )


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def check_training_memory(cfg: RunConfig, device: torch.device) -> MemoryEstimate:
    """Refuse to train a config whose estimated peak exceeds the memory available on ``device``.

    Returns the estimate. Raises LmlabError naming the estimate by term, the available memory,
    and what to reduce (the batch and sequence when activations dominate, the model otherwise).
    """
    est = estimate_training_memory(cfg)
    free = available_memory(device)
    if free is None or est.total <= free[0]:
        return est
    t = cfg.train
    seq = t.seq_len or cfg.model.max_seq_len
    if est.activations >= est.total - est.activations:
        advice = (
            f"reduce train.batch_size (raise train.grad_accum_steps to keep the batch) or "
            f"train.seq_len; activations for {t.batch_size} x {seq} tokens are the largest term"
        )
    else:
        if t.optimizer == "muon":  # one momentum buffer per Muon matrix, two moments for the rest
            need = (
                f"its {est.parameters:,} parameters need 8 bytes each for weights and gradients, "
                f"plus 4 of Muon state for the {est.muon_parameters:,} Muon holds and 8 of AdamW "
                f"state for the other {est.parameters - est.muon_parameters:,}"
            )
        else:
            need = (
                f"its {est.parameters:,} parameters need 16 bytes each for weights, gradients "
                "and AdamW state"
            )
        advice = (
            "reduce the model (model.d_model, model.n_layers, model.ffn.d_ff, the vocabulary); "
            + need
        )
    parts = ", ".join(
        f"{name} {format_bytes(value)}"
        for name, value in (
            ("weights", est.weights),
            ("gradients", est.gradients),
            ("AdamW state" if t.optimizer != "muon" else "Muon + AdamW state", est.optimizer),
            ("autocast copies", est.autocast),
            (f"activations for batch {t.batch_size} x {seq} tokens", est.activations),
        )
        if value
    )
    raise LmlabError(
        f"this run needs about {format_bytes(est.total)} of memory at its peak ({parts}), more "
        f"than the {format_bytes(free[0])} available on {device.type} ({free[1]}); {advice}"
    )
