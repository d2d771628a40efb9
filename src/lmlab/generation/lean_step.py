"""The lean decode step: one new token per row through a decoder-only model, with the same
operations as the model's forward but none of its generality.

Legend: B rows, S cached tokens (before this step), D d_model, H heads, K kv heads, hd
head_dim, V vocab. A decode step of a model's ``forward`` walks every module's call machinery,
its hook points, mask and cache bookkeeping and its options; at batch 1 those cost more than the
matrix-vector products on a CPU. :class:`LeanStep` runs what that forward computes for the one
model shape most decoders have (pre-norm blocks, softmax attention with the plain causal mask
and the ``sdpa`` backend, any position encoding without a score bias, a (gated) MLP, plain or
quantized linear layers, no hooks) as one flat loop of tensor operations, calling the very
functions the modules call (the norms' formula, :func:`~lmlab.nn.fused.fused_weights`, the
position's ``rotate``, ``scaled_dot_product_attention``), so on one thread its Python loop's
logits equal the forward's bit for bit (tests/unit/test_lean_step.py); on several threads the
matmul library may split a product differently and the last bits can differ (SmolLM2-135M, 2
threads: 1.2e-3).

:func:`lean_refusal` says why a model does not qualify (the decode loop then keeps using the
model's forward, which is always correct). Only one-token steps of unpadded rows take it
(prefill, a rebuilt cache and a left-padded batch run the forward).

Where it applies, the whole step is one C++ call instead (:mod:`lmlab.nn.decode_kernel`: every
layer's norms, products, RoPE, cache write, attention and MLP, the final norm and the head):
float32 CPU models with full half-split RoPE (or a position encoding that rotates nothing), no
q/k/v head norms, RMSNorm / LayerNorm / no norm, a silu / gelu / gelu_tanh / relu / relu2 (gated)
MLP, plain float32 or C++-kernel quantized linears, 1..8 rows, the cache's reserved buffers with
room. :attr:`LeanStep.cpp_refusal` says why not otherwise, and the Python loop runs. Its logits
are NOT bit-equal to the forward's (its own summation order): within 1e-4 of them on unit-gain
tiny models, ~1e-6 typical (tests/unit/test_decode_kernel.py). ``decode_kernel.ENABLED =
False``, :func:`lmlab.nn.decode_kernel.disabled` or ``LMLAB_NO_CPP_KERNELS=1`` keep the Python
loop (A/B runs).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

from lmlab.nn import decode_kernel, quant_kernel
from lmlab.nn.attention import SoftmaxAttention
from lmlab.nn.attention_core import SDPA_GQA, repeat_kv
from lmlab.nn.block import PreNormBlock
from lmlab.nn.ffn import MLP, GatedMLP, gelu_tanh, relu, relu2
from lmlab.nn.fused import dense, fused_weights, plain_linear, torch_hooks
from lmlab.nn.fused import generation as fused_generation
from lmlab.nn.hooks import HookPoint
from lmlab.nn.kv_cache import KVCache, LayerKVCache
from lmlab.nn.masks import causal_mask
from lmlab.nn.norm import LayerNorm, RMSNorm
from lmlab.nn.position import PositionEncoding, RotaryPosition
from lmlab.nn.quant import QuantLinear

# The decode loop (lmlab.generation.generate) takes the lean step wherever it applies; False
# makes every step run the model's forward (A/B benchmarks, tests).
ENABLED = True


def _linear_ok(m: nn.Module) -> bool:
    return plain_linear(m) or (type(m) is QuantLinear and not torch_hooks(m))


def lean_refusal(model: nn.Module, cache: object) -> str | None:
    """None when :class:`LeanStep` computes exactly what ``model(ids, cache=cache,
    last_only=True)`` computes for one new token per row; else why not (one short phrase)."""
    from lmlab.models.decoder import DecoderLM  # no import cycle at module load

    if type(model) is not DecoderLM:
        return f"{type(model).__name__} is not a plain DecoderLM"
    if model.training:
        return "the model is in training mode (dropout)"
    if model.has_moe:
        return "a mixture-of-experts layer"
    if type(model.embed) is not nn.Embedding or model.embed.max_norm is not None:
        return "the token embedding is not a plain nn.Embedding"
    if any(t.is_inference() for t in [*model.parameters(), *model.buffers()]):
        return "a parameter or buffer made under torch.inference_mode (no version counter)"
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return "a global module hook is registered"
    if not isinstance(cache, KVCache) or not all(type(c) is LayerKVCache for c in cache.layers):
        return "a cache other than the dynamic KV cache (sliding window, streaming, linear)"
    dtype = model.embed.weight.dtype
    if any(c.k is not None and c.k.dtype != dtype for c in cache.layers):
        return "the cache holds another dtype than the model (converted since its prefill)"
    if type(model.position).score_bias is not PositionEncoding.score_bias:
        return "the position encoding adds a score bias (ALiBi, T5)"
    for m in model.modules():
        if isinstance(m, HookPoint) and m.fns:
            return f"hook point {m.name!r} has a function registered"
        if torch_hooks(m):
            return f"a torch hook on {type(m).__name__}"
    if not _linear_ok(model.lm_head):
        return "the LM head is not a plain or quantized linear layer"
    for i, layer in enumerate(model.layers):
        if type(layer) is not PreNormBlock or layer.parallel or not layer.residual:
            return f"layer {i} is not a sequential pre-norm block with a residual"
        a = layer.attn
        if type(a) is not SoftmaxAttention:
            return f"layer {i}'s attention is not softmax attention"
        if a.mask_fn is not causal_mask or not getattr(a.backend_fn, "causal_fast_path", False):
            return f"layer {i}'s attention is not the plain causal mask on the sdpa backend"
        ffn = layer.ffn
        if not isinstance(ffn, (GatedMLP, MLP)) or type(ffn).forward not in (
            GatedMLP.forward,
            MLP.forward,
        ):
            return f"layer {i}'s FFN is not an MLP or a gated MLP"
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        linears = [getattr(a, n) for n in names] + [ffn.up_proj, ffn.down_proj]
        if isinstance(ffn, GatedMLP):
            linears.append(ffn.gate_proj)
        if not all(_linear_ok(m) for m in linears):
            return f"layer {i} has a linear layer that is neither plain nor quantized"
    return None


def _norm_op(norm: nn.Module) -> tuple[torch.Tensor | None, float, nn.Module]:
    """(weight, eps, norm): weight set for an RMSNorm whose float32 cast-free branch the step
    runs inline (x * rsqrt(mean(x^2) + eps) * weight, the same operations); else None and the
    step calls ``norm.forward`` (nn.Identity included). (``F.rms_norm`` computes the same
    bits, 3 us faster a call in isolation, but no faster inside a SmolLM2 step: not used.)"""
    if type(norm) is RMSNorm:
        w = norm._parameters["weight"]
        if w is not None and w.dtype == torch.float32:
            return w, norm.eps, norm
    return None, 0.0, norm


def _norm(op: tuple[torch.Tensor | None, float, nn.Module], x: torch.Tensor) -> torch.Tensor:
    w, eps, norm = op
    if w is not None and x.dtype == torch.float32:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    return norm.forward(x)


# A linear layer's operands, taken once per snapshot: (weight, bias, None) for a float one
# (a fused q/k/v or gate/up weight from lmlab.nn.fused included; the weight itself, so in-place
# writes to it are seen), (None, buffers, module) for a quantized
# one (:func:`_quant`; its buffers read once, as module attributes cost ~1.5 us each a call).
Op = tuple


def _op(m: nn.Module) -> Op:
    if type(m) is nn.Linear:
        return (m.weight, m._parameters["bias"], None)
    return (None, _quant_buffers(m), m)


def _quant_buffers(m: Any) -> tuple | None:
    """(qweight, scales, zeros, bias) of a QuantLinear or :class:`_QuantCat` whose codes span
    exactly its in_features (no padding columns: the C++ kernel's case), else None. Replaced or
    in-place-changed buffers make the step take a new snapshot (their version counters)."""
    if m.scales.shape[1] * m.group_size != m.in_features:
        return None
    return (m.qweight, m.scales, m.zeros, m.bias)


def _lin(op: Op, x: torch.Tensor) -> torch.Tensor:
    """x (B, K) -> (B, N) through ``op``: for a float layer the very product the model's
    forward makes (:func:`lmlab.nn.fused.dense`: oneDNN for float32 on the CPU, else
    F.linear)."""
    w, bias, m = op
    if m is not None:
        return _quant(m, x, bias)  # bias: the quantized layer's buffers here
    return dense(x, w, bias)


def _quant(m: Any, x: torch.Tensor, bufs: tuple | None) -> torch.Tensor:
    """x (B, K) -> (B, N) for ``m`` a QuantLinear or :class:`_QuantCat` with its
    :func:`_quant_buffers` ``bufs``: QuantLinear.forward's C++ kernel branch without its
    reshapes and checks where it applies, else the forward."""
    if (
        bufs is not None
        and m._cpp_ok
        and x.shape[0] <= quant_kernel.MAX_ROWS
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and quant_kernel.available()
    ):
        qweight, scales, zeros, bias = bufs
        y = quant_kernel.run(
            x.contiguous(), qweight, scales, zeros, m.group_size, m.bits, m.act_bits
        )
        return y if bias is None else y + bias.to(y.dtype)
    return m.forward(x)


class _QuantCat:
    """Quantized linears reading the same input, as one: their codes, scales, zeros (and
    biases) concatenated along the output rows, which the C++ kernel computes row by row, so
    y equals the concatenation of their outputs exactly; ``forward`` (the fallback) is that
    concatenation. Made per snapshot (a copy of those layers' codes, while a generation runs)."""

    def __init__(self, parts: list[QuantLinear]) -> None:
        self.parts = parts
        p0 = parts[0]
        self.bits, self.group_size, self.in_features = p0.bits, p0.group_size, p0.in_features
        self.act_bits = p0.act_bits
        self.qweight = torch.cat([m.qweight for m in parts])
        self.scales = torch.cat([m.scales for m in parts])
        self.zeros = torch.cat([m.zeros for m in parts])
        biases = [m.bias for m in parts]
        self.bias = None if biases[0] is None else torch.cat(biases)  # type: ignore[arg-type]
        self.out_features = int(self.qweight.shape[0])
        self._cpp_ok = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m.forward(x) for m in self.parts], dim=-1)


def _fused_op(owner: nn.Module, key: str, names: tuple[str, ...]) -> Op | None:
    """One op for ``owner``'s linears ``names``: the fused weight lmlab.nn.fused keeps (built
    if needed, with its own staleness checks) for plain linears, a :class:`_QuantCat` for
    quantized ones the C++ kernel serves alike; None when neither applies."""
    mods = [owner._modules[n] for n in names]
    if all(type(m) is QuantLinear for m in mods):
        q: list[QuantLinear] = mods  # type: ignore[assignment]
        p0 = q[0]
        alike = all(
            m.bits == p0.bits and m.group_size == p0.group_size and m.in_features == p0.in_features
            and m.act_bits == p0.act_bits
            and m.scales.shape[1] * m.group_size == m.in_features and m._cpp_ok
            and (m.bias is None) == (p0.bias is None)
            for m in q
        )  # fmt: skip
        ok = alike and quant_kernel.available()
        cat = _QuantCat(q)
        return (None, _quant_buffers(cat), cat) if ok else None
    fused = fused_weights(owner, key, names)
    return None if fused is None else (fused[0], fused[1], None)


class LeanStep:
    """One-token decode steps of a model that :func:`lean_refusal` accepts into ``cache`` (its
    :class:`~lmlab.nn.kv_cache.LayerKVCache` s, filled by the model's own prefill), with key and
    value buffers reserved up front for ``capacity`` tokens (static: no doubling; a step past
    it grows them as the cache does).

    The layers' operands (weights, a fused q/k/v or gate/up weight when
    :data:`lmlab.nn.fused.ENABLED`) are taken once and used while no parameter or buffer of the
    model is replaced or changed in place (their version counters are compared on every step)
    and lmlab.nn.fused's copies are current (no optimizer step or training forward since); else
    a new snapshot is taken. Plain weights are the parameters themselves, so any in-place write
    to them is seen; writes through ``param.data`` that :mod:`lmlab.nn.fused` does not see are
    not seen in its copies either (call :func:`~lmlab.nn.fused.drop_fused`).
    """

    def __init__(self, model: nn.Module, cache: KVCache, capacity: int) -> None:
        self.model: Any = model  # a DecoderLM (lean_refusal checked it)
        self.cache = cache
        self.device_type = str(next(model.parameters()).device.type)
        for c in cache.layers:
            c.reserve(capacity)
        self.checked = False  # declines() compared the snapshot since the last __call__
        self._snapshot()

    @torch.no_grad()
    def _snapshot(self) -> None:
        self.generation = fused_generation()  # read before the fused copies are (re)built
        model = self.model
        mods = list(model.modules())
        # what stale() compares on every step: each parameter, buffer and child module in its
        # slot (replaced?), each tensor's version counter (changed in place?) and storage
        # (swapped through ``.data``, as Module.double() / .to() do?)
        slots = [
            (d, name, t)
            for m in mods
            for d in (m._parameters, m._buffers, m._modules)
            for name, t in d.items()
            if t is not None
        ]
        self.slots = [(d, name) for d, name, _ in slots]
        self.held = [t for _, _, t in slots]
        self.tensors = [t for t in self.held if isinstance(t, torch.Tensor)]
        self.versions = [t._version for t in self.tensors]
        self.storages = [t.data_ptr() for t in self.tensors]
        self.hook_lists = [m.fns for m in mods if isinstance(m, HookPoint)]
        self.hook_dicts = [
            d for m in mods for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks,
                                      m._backward_pre_hooks)
        ]  # fmt: skip
        self.plan: decode_kernel.Plan | None = None  # built on the first step that may use it
        self.plan_tried = False
        self.plan_quant = False  # whether the plan calls the quantized kernels
        self.cpp_refusal: str | None = "not tried yet"
        self.layers: list[tuple] = []
        # a module swapped in since the last snapshot may be one this loop does not follow
        self.refusal = lean_refusal(model, self.cache)
        if self.refusal is not None:
            return
        pos = model.position
        self.rope_fast = (
            type(pos) is RotaryPosition and not pos.interleaved and pos.rotary_dim == pos.head_dim
        )
        self.layers = []
        for layer in model.layers:
            a, ffn = layer.attn, layer.ffn
            plain_heads = all(type(n) is nn.Identity for n in (a.q_norm, a.k_norm, a.v_norm))
            qkv = _fused_op(a, "qkv", ("q_proj", "k_proj", "v_proj"))
            qkv_ops = (_op(a.q_proj), _op(a.k_proj), _op(a.v_proj)) if qkv is None else ()
            gated = isinstance(ffn, GatedMLP)
            gu = _fused_op(ffn, "gate_up", ("gate_proj", "up_proj")) if gated else None
            gu_ops = (_op(ffn.gate_proj), _op(ffn.up_proj)) if gated and gu is None else ()
            self.layers.append((
                _norm_op(layer.attn_norm), a, a.n_heads, a.n_kv_heads, a.head_dim, a.scale,
                plain_heads, qkv, qkv_ops, _op(a.o_proj), _norm_op(layer.ffn_norm), ffn.act,
                gated, gu, gu_ops, _op(ffn.up_proj), _op(ffn.down_proj),
            ))  # fmt: skip
        self.head = _op(model.lm_head)
        self.final_norm = _norm_op(model.final_norm)

    def declines(self) -> bool:
        """Whether this step must run the model's forward instead: the model is in training
        mode, a module was swapped in that :func:`lean_refusal` refuses (checked at the new
        snapshot a change makes: see :meth:`stale`), a hook was registered since the snapshot
        (a hook point's function, a torch module hook, a global one), or autocast is on (it
        casts inside the layers in ways this loop does not follow)."""
        if self.model.training:
            return True
        if self.stale():
            self._snapshot()
        self.checked = True  # the next __call__ need not compare again
        return (
            self.refusal is not None
            or torch.is_autocast_enabled(self.device_type)
            or any(self.hook_lists)
            or any(self.hook_dicts)
            or bool(_module._global_forward_hooks or _module._global_forward_pre_hooks)
        )

    def stale(self) -> bool:
        """Whether a parameter, buffer or child module was replaced since the snapshot, a
        tensor changed in place (version counter) or given other storage (``.data = ...``,
        ``model.double()``, ``.to()``), or lmlab.nn.fused's copies went stale (any optimizer
        step, a training forward: fused optimizer kernels bump no version counter), which the
        fused ops here are. About 0.1 ms for SmolLM2-135M's ~1,100 slots."""
        return (
            self.generation != fused_generation()
            or [t._version for t in self.tensors] != self.versions
            or [t.data_ptr() for t in self.tensors] != self.storages
            or any(map(operator.is_not, [d.get(n) for d, n in self.slots], self.held))
        )

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, 1) int64, the next token of every row (no padding anywhere) -> logits
        (B, 1, V) of ``model(ids, cache=cache, last_only=True)``; the cache is extended.
        Callers ask :meth:`declines` first (the decode loop does); a model it refuses runs
        its forward here."""
        if not self.checked and self.stale():
            self._snapshot()
        self.checked = False
        if self.refusal is not None or self.model.training:
            return self.model(ids, cache=self.cache, last_only=True).logits
        if decode_kernel.available():
            if not self.plan_tried:
                self.plan_tried = True
                self.plan, self.cpp_refusal = _plan(self)
            if self.plan is not None and (not self.plan_quant or quant_kernel.available()):
                logits = self._cpp_step(ids, self.plan)
                if logits is not None:
                    return logits
        model, cache = self.model, self.cache
        b = ids.shape[0]
        past = cache.seq_len
        positions = torch.arange(past, past + 1, device=ids.device)  # (1,)
        x = F.embedding(ids, model.embed.weight)  # (B, 1, D)
        if model.embed_scale != 1.0:
            x = x * model.embed_scale
        position = model.position
        x = position.embed(x, positions).view(b, -1)  # (B, D): one token per row from here
        rot = position.rotation(positions, x.dtype) if self.rope_fast else None
        if rot is not None:  # rotate_half(x) * sin == roll(x, hd/2) * [-sin1, sin2] exactly
            cos, sin = rot  # (1, hd)
            half = sin.shape[-1] // 2
            signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        for (
            n1, a, hh, kv, hd, scale, plain_heads, qkv, qkv_ops, o_op, n2, act, gated, gu, gu_ops,
            up_op, down_op,
        ), c in zip(self.layers, cache.layers, strict=True):  # fmt: skip
            # attention: (B, D) -> q (B, H, 1, hd), k and v (B, K, 1, hd)
            w, eps, norm = n1
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w if w is not None \
                else norm.forward(x)  # fmt: skip
            if qkv is not None:
                heads = _lin(qkv, h)
            else:
                heads = torch.cat([_lin(o, h) for o in qkv_ops], dim=-1)
            heads = heads.view(b, hh + 2 * kv, hd)
            if rot is not None and plain_heads:  # q and k rotated as one tensor
                qk = heads[:, : hh + kv]
                qk = (qk * cos + qk.roll(hd // 2, -1) * signed).unsqueeze(2)  # (B, H+K, 1, hd)
                q, k = qk[:, :hh], qk[:, hh:]
                v = heads[:, hh + kv :].unsqueeze(2)
            else:
                q, k, v = heads.unsqueeze(1).split([hh, kv, kv], dim=2)  # (B, 1, *, hd)
                q = a.q_norm(q).transpose(1, 2)  # (B, H, 1, hd)
                k = a.k_norm(k).transpose(1, 2)  # (B, K, 1, hd)
                v = a.v_norm(v).transpose(1, 2)
                q, k = position.rotate(q, k, positions)
            k, v = _append(c, k, v)  # (B, K, S + 1, hd)
            if hh != kv and SDPA_GQA:
                y = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
            else:
                rep = hh // kv
                y = F.scaled_dot_product_attention(
                    q, repeat_kv(k, rep), repeat_kv(v, rep), scale=scale
                )
            x.add_(_lin(o_op, y.view(b, hh * hd)))  # (B, H, 1, hd) -> (B, H hd) -> (B, D)
            # FFN
            w, eps, norm = n2
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w if w is not None \
                else norm.forward(x)  # fmt: skip
            if gated:
                if gu is not None:
                    gate, up = _lin(gu, h).chunk(2, dim=-1)
                else:
                    gate, up = (_lin(o, h) for o in gu_ops)
                # act(gate) * up; silu's output is a new tensor, so the product goes in place
                hidden = F.silu(gate).mul_(up) if act is F.silu else act(gate) * up
            else:
                hidden = act(_lin(up_op, h))
            x.add_(_lin(down_op, hidden))
        x = _norm(self.final_norm, x)
        return _lin(self.head, x).view(b, 1, -1)

    def _cpp_step(self, ids: torch.Tensor, plan: decode_kernel.Plan) -> torch.Tensor | None:
        """The step as one C++ call (:mod:`lmlab.nn.decode_kernel`), or None (nothing done)
        where the cache is not what it writes into: a layer's reserved buffers full, replaced,
        or of another batch (the Python loop below then grows them as :func:`_append` does)."""
        model, cache = self.model, self.cache
        b = ids.shape[0]
        if b > decode_kernel.MAX_ROWS:  # the C++ step serves 1..8 rows
            return None
        s = cache.seq_len
        layers = cache.layers
        for i, c in enumerate(layers):
            if not _room(c, b) or c.seq_len != s:
                return None
            kb, vb = c._kbuf, c._vbuf
            held = plan.bufs[i]
            if held is None or held[0] is not kb or held[1] is not vb:
                lay = plan.layers[i]
                want = (b, lay.kv_heads, lay.head_dim)
                if any(
                    t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1
                    or (t.shape[0], t.shape[1], t.shape[3]) != want
                    for t in (kb, vb)
                ):  # fmt: skip
                    return None
                plan.set_cache(i, kb, vb)
        position = model.position
        table = plan.rope_table
        positions = None
        x = F.embedding(ids, model.embed.weight)  # (B, 1, D)
        if model.embed_scale != 1.0:
            x = x * model.embed_scale
        if type(position).embed is not PositionEncoding.embed:  # learned, sinusoidal
            positions = torch.arange(s, s + 1, device=ids.device)  # (1,)
            x = position.embed(x, positions)
        x = x.reshape(b, -1)
        if x.dtype != torch.float32 or not x.is_contiguous():
            return None
        cos = sin = None
        if table is not None and s < table[0].shape[0]:
            cos, sin = table[0][s], table[1][s]  # (hd,) each
        elif plan.rope:
            if positions is None:
                positions = torch.arange(s, s + 1, device=ids.device)
            cos, sin = position.rotation(positions, torch.float32)  # (1, hd) each
            cos, sin = cos[0].contiguous(), sin[0].contiguous()
        logits = plan.run(x, s, cos, sin)
        for c in layers:  # what _append leaves: the views of the first S + 1 slots
            c.k, c.v = c._kbuf[:, :, : s + 1], c._vbuf[:, :, : s + 1]
        return logits.view(b, 1, -1)


_ACTS = {F.silu: 0, F.gelu: 1, gelu_tanh: 2, relu: 3, relu2: 4}  # decode_kernel.ACTS


def _cpp_norm(bld: decode_kernel.Builder, op: tuple) -> decode_kernel.Norm | None:
    w, eps, norm = op
    if w is not None:  # an RMSNorm with a float32 weight
        return bld.norm(decode_kernel.NORM_RMS, w, None, eps)
    if type(norm) is nn.Identity:
        return bld.norm(decode_kernel.NORM_NONE, None, None, 0.0)
    if type(norm) in (nn.LayerNorm, LayerNorm) and len(norm.normalized_shape) == 1:
        ts = [t for t in (norm.weight, norm.bias) if t is not None]
        if all(t.dtype == torch.float32 and t.is_contiguous() for t in ts):
            return bld.norm(decode_kernel.NORM_LAYER, norm.weight, norm.bias, norm.eps)
    return None


def _cpp_lin(bld: decode_kernel.Builder, op: Op | None) -> decode_kernel.Lin | None:
    if op is None:
        return None
    w, bias, m = op
    if m is None:
        return bld.float_lin(w, bias)
    if bias is None or not m._cpp_ok:  # bias: the quantized layer's buffers (_quant_buffers)
        return None
    q, sc, z, b = bias
    return bld.quant_lin(q, sc, z, b, m.bits, m.group_size, m.act_bits, m.in_features)


def _plan(step: LeanStep) -> tuple[decode_kernel.Plan | None, str | None]:
    """(the C++ step's plan of ``step``'s snapshot, None) or (None, why it does not apply)."""
    model = step.model
    pos = model.position
    if model.embed.weight.dtype != torch.float32 or model.embed.weight.device.type != "cpu":
        return None, "not a float32 CPU model"
    rope = step.rope_fast
    if not rope and type(pos).rotate is not PositionEncoding.rotate:
        return None, "a rotation other than full half-split RoPE"
    bld = decode_kernel.Builder()
    layers = []
    quantized = False
    d = int(model.embed.weight.shape[1])
    for i, (
        n1, _a, hh, kv, hd, scale, plain_heads, qkv, qkv_ops, o_op, n2, act, gated, gu, gu_ops,
        up_op, down_op,
    ) in enumerate(step.layers):  # fmt: skip
        if not plain_heads:
            return None, f"layer {i} normalizes its q, k or v heads"
        if kv < 1 or hh % kv:
            return None, f"layer {i}'s heads are not a multiple of its kv heads"
        norms = (_cpp_norm(bld, n1), _cpp_norm(bld, n2))
        if None in norms:
            return None, f"layer {i} has a norm other than RMSNorm, LayerNorm or none (float32)"
        qkv_l = [_cpp_lin(bld, o) for o in ((qkv,) if qkv is not None else qkv_ops)]
        gu_src = ((gu,) if gu is not None else gu_ops) if gated else (up_op,)
        gu_l = [_cpp_lin(bld, o) for o in gu_src]
        o_l, down_l = _cpp_lin(bld, o_op), _cpp_lin(bld, down_op)
        lins = [*qkv_l, *gu_l, o_l, down_l]
        if any(lin is None for lin in lins):
            return None, f"layer {i} has a linear layer the C++ step does not read"
        quantized = quantized or any(lin.kind for lin in lins)  # type: ignore[union-attr]
        f = sum(lin.n for lin in gu_l)  # type: ignore[union-attr]
        f = f // 2 if gated else f
        shapes_ok = (
            all(lin.k == d for lin in (*qkv_l, *gu_l))  # type: ignore[union-attr]
            and sum(lin.n for lin in qkv_l) == (hh + 2 * kv) * hd  # type: ignore[union-attr]
            and (o_l.k, o_l.n, down_l.k, down_l.n) == (hh * hd, d, f, d)  # type: ignore[union-attr]
            and (not gated or len(gu_l) == 1 or gu_l[0].n == gu_l[1].n)  # type: ignore[union-attr]
        )
        if not shapes_ok:
            return None, f"layer {i}'s linear shapes are not those of its attention and FFN"
        code = next((c for f, c in _ACTS.items() if f is act), None)
        if code is None:
            return None, f"layer {i}'s activation is not silu, gelu, gelu_tanh, relu or relu2"
        lay = decode_kernel.Layer()
        lay.n1, lay.n2 = norms
        for j, lin in enumerate(qkv_l):
            lay.qkv[j] = lin
        lay.n_qkv = len(qkv_l)
        for j, lin in enumerate(gu_l):
            lay.gu[j] = lin
        lay.n_gu, lay.gated, lay.act = len(gu_l), int(gated), code
        lay.o, lay.down = o_l, down_l
        lay.heads, lay.kv_heads, lay.head_dim = hh, kv, hd
        lay.scale = 1.0 / hd**0.5 if scale is None else float(scale)
        layers.append(lay)
    fn = _cpp_norm(bld, step.final_norm)
    head = _cpp_lin(bld, step.head)
    if fn is None or head is None:
        return None, "the final norm or the LM head is not one the C++ step reads"
    quantized = quantized or bool(head.kind)
    if head.k != d:
        return None, "the LM head does not read d_model features"
    plan = decode_kernel.Plan(layers, fn, head, d, rope, bld)
    kb = step.cache.layers[0]._kbuf if step.cache.layers else None
    if rope and not pos.length_dependent and kb is not None:
        # cos / sin of every reserved slot at once: each row is what rotation() gives for that
        # position alone (elementwise ops); ~0.3 ms a token less (SmolLM2 int4+a8, 1 thread). A
        # length-dependent scaling (frequencies set by the longest position) computes per step
        cos, sin = pos.rotation(torch.arange(kb.shape[2]), torch.float32)
        plan.rope_table = (cos.contiguous(), sin.contiguous())
    step.plan_quant = quantized
    return plan, None


def _append(c: LayerKVCache, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write k, v (B, K, 1, hd) into the next free slot of ``c``'s reserved buffers and return
    every cached key and value (B, K, S + 1, hd); :meth:`LayerKVCache.update` (same result)
    when the buffers are full or were replaced."""
    if not _room(c, k.shape[0]):
        return c.update(k, v)
    kb, vb, s = c._kbuf, c._vbuf, c.seq_len
    assert kb is not None and vb is not None  # _room checked them
    kb[:, :, s : s + 1] = k
    vb[:, :, s : s + 1] = v
    c.k, c.v = kb[:, :, : s + 1], vb[:, :, : s + 1]
    return c.k, c.v


def _room(c: LayerKVCache, b: int) -> bool:
    """Whether ``c``'s keys and values are views of its reserved buffers for ``b`` rows with a
    free slot after them (what :func:`_append` and the C++ step write into)."""
    kb, vb, ck, cv = c._kbuf, c._vbuf, c.k, c.v
    if kb is None or vb is None or ck is None or cv is None or ck._base is not kb \
            or cv._base is not vb:  # fmt: skip
        return False
    s = ck.shape[2]
    return s < kb.shape[2] and s < vb.shape[2] and ck.shape[0] == b
