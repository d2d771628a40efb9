"""Weight-only int8 / int4 quantization of a model's linear layers, group-wise along the input.

Legend: N out_features, K in_features, G group size (K/G groups per output row), M rows of input
(batch x tokens). Activations stay float; only the (N, K) weights are stored as integers, with one
float32 scale (and for asymmetric int4 one float32 zero) per (row, group):

    w_hat[n, k] = (q[n, k] - c) * s[n, k // G] + z[n, k // G]

- int8, symmetric: q in [-127, 127] (int8), c = 0, s = max|w| / 127 over the group, z = 0.
- int4, symmetric: q in [0, 15], c = 8, s = max|w| / 7, z = 0 (q - 8 in [-7, 7]).
- int4, asymmetric (default, like llama.cpp's Q4_1): q in [0, 15], c = 8, s = (max - min) / 15,
  z = min + 8 s, so w_hat = q s + min.

Rounding to nearest makes |w - w_hat| <= s / 2 for every element (exactly, up to float32 rounding).

The LM head is int8 (group-wise with the layers' group size) unless ``+h4`` asks for the
layers' 4 bits (:class:`QuantSpec` ``head_bits``): like llama.cpp's 4-bit files, which keep the
output matrix at 8 bits or more, since every logit comes straight out of it.

Activations (``act_bits``): float32 by default. ``act_bits=8`` (``--quantize int4+a8``) also
rounds each layer's input, per row and block of 32 columns (:func:`act_block`), to
x_hat = q d with d = max|x| / 127 and q = round(x / d) in [-127, 127] (llama.cpp's Q8_0
activations), so every layer computes x_hat @ w_hat.T, and decode's C++ kernels use integer dot
products (VNNI where the CPU has it). This changes the numbers (|x - x_hat| <= d / 2), so it is
an explicit choice; docs/quantization.md has its measured speed and perplexity cost.

Kernels. CPU float32 inputs of 1..8 rows (decode) go to lmlab's own C++ kernels
(:mod:`lmlab.nn.quant_kernel`, ``quant_kernels.cpp``: the stored codes dequantized 16 at a time
with AVX-512 or 8 with AVX2 + FMA and multiply-added in float32, or integer dot products for
``+a8``, output rows over threads), compiled on first use;
where they cannot be built (or ``LMLAB_NO_CPP_KERNELS=1``) the reason is warned once and the
layer uses PyTorch's kernels as before (PyTorch 2.13 CPU, semantics checked by experiment and by
tests/unit/test_quant.py):

- ``aten._weight_int8pack_mm(x (M, K) float, w (N, K) int8, scales (N,)) -> (M, N)``:
  x @ (w * scales[:, None]).T; one scale per output row only (a group-wise scales tensor is
  refused), so int8 with ``group_size=None`` (one group = the whole row) uses it and int8 with
  smaller groups falls back to dequantize + matmul.
- ``aten._convert_weight_to_int4pack_for_cpu(q (N, K) int32 in [0, 15], inner_k_tiles) ->
  packed uint8`` and ``aten._weight_int4pack_mm_for_cpu(x (M, K), packed, G, sz (K/G, N, 2))``:
  x @ w_hat.T with w_hat = (q - 8) * sz[..., 0] + sz[..., 1] per group; needs G in
  {32, 64, 128, 256}, K % G == 0, N % 16 == 0, and sz in x's dtype. Other shapes fall back.

Everything else (more than :data:`KERNEL_MAX_ROWS` rows, CUDA, non-float32 activations, shapes
the kernels refuse) computes
x @ dequantize().T, which gives the same numbers up to float32 rounding. On an AVX2 CPU torch's
kernels are *slower* than float32 ``F.linear`` at batch 1, lmlab's are faster where the weight
comes from memory rather than cache (docs/quantization.md).

Papers: group-wise weight-only quantization as in GPTQ / AWQ deployments (Frantar et al. 2023;
Lin et al. 2024) and llama.cpp's Q4_0 / Q4_1 / Q8_0 block formats (here without GPTQ's error
correction: plain round-to-nearest).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.errors import LmlabError
from lmlab.nn import quant_kernel
from lmlab.nn.fused import dense

BITS = (4, 8)
ACT_BITS = (None, 8)  # float32 activations, or int8 per block of ACT_BLOCK (act_block())
ACT_BLOCK = 32
INT4_KERNEL_GROUPS = (32, 64, 128, 256)
DEFAULT_GROUP = {8: None, 4: 32}  # int8: per row; int4: llama.cpp's 32
# The kernels serve at most this many rows (decode); more rows (prefill, scoring) dequantize the
# weight once and run one float matmul. Measured here (AVX2, one thread): a kernel's time grows
# about linearly with the rows while a dequantization costs about 5 kernel rows; at 256 rows the
# kernels took 17-25x as long as dequantize + matmul.
KERNEL_MAX_ROWS = 4


@dataclass(frozen=True)
class QuantSpec:
    """What :func:`quantize_model` does: ``bits`` 8 or 4; ``group_size`` weights per scale along
    the input (None: one group per output row); ``symmetric`` (int8 is always symmetric);
    ``head``: quantize the LM head too (a tied head gets its own quantized copy, the embedding
    stays float); ``pad``: pad in_features up to a multiple of ``group_size`` rather than
    refuse; ``act_bits``: None keeps activations float32, 8 quantizes each linear layer's input
    to int8 per block (:func:`quantize_activations`) and uses integer dot products;
    ``head_bits``: the LM head's weights, int8 by default whatever ``bits`` is (with the layers'
    group size: int4 g32 layers get a Q8_0-like head, as llama.cpp keeps the output matrix of
    its 4-bit files at 8 bits or more). The head is the one matrix every token's logits come
    from directly: SmolLM2-135M's head at int4 g32 costs +5.2% WikiText-2 perplexity, at int8
    g32 +0.00%, while its 30 layers at int4 g32 cost +0.00% (they hold the GGUF's own Q4_1
    grid), for 11% more bytes read per token (benchmarks/quantized_quality.py); 4 rounds the head
    as the layers (``int4+h4``)."""

    bits: int = 8
    group_size: int | None = None
    symmetric: bool = False
    head: bool = True
    pad: bool = False
    act_bits: int | None = None
    head_bits: int = 8

    def check(self) -> None:
        """Raise LmlabError for bits outside {4, 8}, a group size < 2 (or odd for int4), or
        act_bits other than None / 8."""
        if self.bits not in BITS:
            raise LmlabError(f"quantization bits must be 4 or 8, got {self.bits}")
        if self.head_bits not in BITS:
            raise LmlabError(f"quantization head_bits must be 4 or 8, got {self.head_bits!r}")
        if self.act_bits not in ACT_BITS:
            raise LmlabError(
                f"quantization act_bits must be None (float activations) or 8, got "
                f"{self.act_bits!r}"
            )
        g = self.group_size
        if g is not None and (g < 2 or (self.bits == 4 and g % 2)):
            raise LmlabError(
                f"quantization group_size must be >= 2{' and even for int4' * (self.bits == 4)}, "
                f"got {g}"
            )

    @property
    def name(self) -> str:
        """``int8``, ``int4-g32``, ``int4-g64-sym``, ``int4-g32-h4-a8``: how results are
        labelled (``-h4``: a head rounded to 4 bits, not the default 8)."""
        g = "" if self.group_size is None else f"-g{self.group_size}"
        a = "" if self.act_bits is None else f"-a{self.act_bits}"
        h = "" if self.head_bits == 8 or not self.head else f"-h{self.head_bits}"
        return f"int{self.bits}{g}{'-sym' if self.symmetric and self.bits == 4 else ''}{h}{a}"


def parse_spec(text: str) -> QuantSpec:
    """``int8``, ``int4``, ``int4:64`` or ``int8:128`` (bits, optional group size), optionally
    followed by ``+h4`` (the LM head at 4 bits too; default 8: :class:`QuantSpec`) and/or
    ``+a8`` (int8 activations: ``int4+a8``, ``int4:64+h4+a8``) -> QuantSpec with the default
    group of :data:`DEFAULT_GROUP`. Raises LmlabError for anything else."""
    weights, *extras = text.split("+")
    kind, colon, group = weights.partition(":")
    bits = {"int8": 8, "int4": 4}.get(kind)
    # ASCII digits only: str.isdigit() also takes '²' (which int() refuses) and other scripts'
    # digits; "int4:" (a colon, no group) is a typo, not the default
    if (
        bits is None
        or (colon and re.fullmatch("[0-9]{1,9}", group, flags=re.ASCII) is None)
        or not set(extras) <= {"h4", "a8"}
        or len(set(extras)) != len(extras)
    ):
        raise LmlabError(
            f"the quantization spec (--quantize, quantize=) must be int8 or int4, optionally "
            f":GROUP_SIZE (e.g. int4:64), +h4 (a 4-bit LM head) and +a8, got {text!r}"
        )
    group_size = int(group) if group else DEFAULT_GROUP[bits]
    a8, h4 = "a8" in extras, "h4" in extras
    spec = QuantSpec(bits, group_size, act_bits=8 if a8 else None, head_bits=4 if h4 else 8)
    spec.check()
    return spec


def act_block(group_size: int) -> int:
    """Columns per activation scale for ``act_bits=8``: 32 (llama.cpp's Q8_0 block) where it
    divides the weight group, else the whole group, so that no block straddles two groups."""
    return ACT_BLOCK if group_size % ACT_BLOCK == 0 else group_size


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) float, K % block == 0 -> (q (..., K) float32 integers in [-127, 127],
    d (..., K/block) float32) with d = max|x| / 127 over each block of ``block`` columns and
    q = round-half-to-even(x / d) (0 where d == 0), all in float32: x_hat = q d per block, the
    activations the ``act_bits=8`` kernels multiply (the C++ kernel computes the same q and d
    bit for bit). |x - x_hat| <= d / 2."""
    k = x.shape[-1]
    xb = x.float().reshape(*x.shape[:-1], k // block, block)
    d = xb.abs().amax(-1) / 127
    q = torch.where(d[..., None] > 0, torch.round(xb / d[..., None]), 0.0).clamp(-127, 127)
    return q.reshape(x.shape), d


def fake_quantize_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x_hat = q d of :func:`quantize_activations`, (..., K) in x's dtype."""
    q, d = quantize_activations(x, block)
    k = x.shape[-1]
    xb = q.reshape(*x.shape[:-1], k // block, block) * d[..., None]
    return xb.reshape(x.shape).to(x.dtype)


def quantize_weight(
    w: torch.Tensor, bits: int, group_size: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w (N, K) float, K % group_size == 0 -> (q (N, K) int8 for 8 bits / uint8 in [0, 15] for 4,
    scales (N, K/G) float32, zeros (N, K/G) float32) with w_hat = (q - c) s + z (module
    docstring; c = 0 for int8, 8 for int4). Computed in float32."""
    n, k = w.shape
    wg = w.detach().float().reshape(n, k // group_size, group_size)  # (N, K/G, G)
    if bits == 8 or symmetric:
        qmax = 127 if bits == 8 else 7
        s = wg.abs().amax(-1) / qmax  # (N, K/G)
        s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero group: any scale is exact
        q = torch.round(wg / s[..., None]).clamp(-qmax, qmax)
        z = torch.zeros_like(s)
        if bits == 4:
            q = q + 8
    else:
        lo, hi = wg.amin(-1), wg.amax(-1)
        s = (hi - lo) / 15
        s = torch.where(s > 0, s, torch.ones_like(s))  # a constant group: q = 0, w_hat = lo
        q = torch.round((wg - lo[..., None]) / s[..., None]).clamp(0, 15)
        z = lo + 8 * s
    dtype = torch.int8 if bits == 8 else torch.uint8
    return q.reshape(n, k).to(dtype), s.contiguous(), z.contiguous()


def dequantize_weight(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int
) -> torch.Tensor:
    """The inverse of :func:`quantize_weight`: (N, K) in the scales' dtype."""
    n, k = q.shape
    g = k // scales.shape[1]
    c = 0 if bits == 8 else 8
    qg = (q.to(scales.dtype) - c).view(n, -1, g)  # (N, K/G, G)
    return (qg * scales[..., None] + zeros[..., None]).view(n, k)


def dequantize_stored(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int
) -> torch.Tensor:
    """:func:`dequantize_weight` of a layer's stored buffers: qweight (N, Kp) int8, or (N, Kp/2)
    uint8 packed int4 codes (:func:`pack_int4`) -> (N, Kp) in the scales' dtype."""
    q = qweight if bits == 8 else unpack_int4(qweight)
    return dequantize_weight(q, scales, zeros, bits)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q (N, K) uint8 in [0, 15], K even -> (N, K/2) uint8: column 2j in the low nibble, 2j+1 in
    the high nibble (the stored form; the kernel's own layout is derived from it at load)."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: (N, K/2) uint8 -> (N, K) uint8 in [0, 15]."""
    return torch.stack([p & 15, p >> 4], dim=-1).view(p.shape[0], -1)


# int8-activation layers run more rows than the C++ kernels take (a prompt) through them, 8 rows
# a call; False: fake-quantized activations times the dequantized weight, the path before
# (A/B: benchmarks/quantized_prefill.py).
PROMPT_A8_KERNELS = True


class QuantLinear(nn.Module):
    """A weight-only quantized ``nn.Linear``: x (..., K) float -> (..., N) in x's dtype.

    Buffers (the state dict): ``qweight`` (N, Kp) int8 (8 bits) or (N, Kp/2) uint8 holding two
    int4 codes per byte (:func:`pack_int4`), ``scales`` and ``zeros`` (N, Kp/G) float32, ``bias``
    (N,) if the layer had one; Kp is K padded up to a multiple of G (Kp == K unless built with
    ``pad``). The CPU kernel's packed copy is rebuilt from them after every load.

    ``act_bits=8`` (not a buffer: a setting of the layer, like ``group_size``): the input is
    quantized to int8 per block of :func:`act_block` columns before the product on every path
    (the C++ kernels' integer dot products, else x_hat = :func:`fake_quantize_activations` times
    the float weight), so y = x_hat @ w_hat.T whatever the rows or device.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self, linear: nn.Linear, bits: int, group_size: int | None, symmetric: bool, pad: bool,
        name: str = "linear", act_bits: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        if act_bits not in ACT_BITS:
            raise LmlabError(f"cannot quantize {name}: act_bits must be None or 8, got {act_bits}")
        n, k = linear.out_features, linear.in_features
        g = k if group_size is None else group_size
        if k % g and not pad:
            raise LmlabError(
                f"cannot quantize {name}: group_size {g} does not divide its in_features {k}; "
                f"use a group size dividing {k} (e.g. {_divisor_hint(k, bits)}) or pad=True "
                "(Python API)"
            )
        kp = math.ceil(k / g) * g
        if bits == 4 and kp % 2:
            raise LmlabError(f"cannot quantize {name} to int4: in_features {k} is odd")
        self.in_features, self.out_features, self.bits, self.group_size = k, n, bits, g
        self.act_bits = act_bits
        w = F.pad(linear.weight.detach().float(), (0, kp - k))  # (N, Kp), zero columns
        q, s, z = quantize_weight(w, bits, g, symmetric)
        self.register_buffer("qweight", q if bits == 8 else pack_int4(q))
        self.register_buffer("scales", s)
        self.register_buffer("zeros", z)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.kernel = self._kernel_name(kp, n)
        self.register_load_state_dict_post_hook(lambda module, _: module._prepare())
        self._prepare()

    def _kernel_name(self, kp: int, n: int) -> str | None:
        """``int8pack`` / ``int4pack`` where that CPU kernel takes this layer's shape, else None."""
        if self.bits == 8:
            return "int8pack" if self.group_size == kp else None
        if self.group_size in INT4_KERNEL_GROUPS and n % 16 == 0:
            return "int4pack"
        return None

    def _prepare(self) -> None:
        """Derive the kernel's operands from the stored buffers (not saved)."""
        self._packed: torch.Tensor | None = None
        self._sz: torch.Tensor | None = None
        bufs = (self.qweight, self.scales, self.zeros)
        self._cpp_ok = (  # lmlab's C++ kernel reads the stored buffers as they are
            all(b.device.type == "cpu" and b.is_contiguous() for b in bufs)
            and self.scales.dtype == self.zeros.dtype == torch.float32
            and (self.bits == 8 or self.group_size % 2 == 0)  # int4 groups start on a byte
        )
        if self.kernel == "int4pack" and self.qweight.device.type == "cpu":
            q = unpack_int4(self.qweight).to(torch.int32)  # (N, Kp)
            self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            self._sz = torch.stack([self.scales.T, self.zeros.T], -1).contiguous()  # (Kp/G, N, 2)

    def dequantize(self) -> torch.Tensor:
        """The weight the layer applies, (N, K) float32."""
        w = dequantize_stored(self.qweight, self.scales, self.zeros, self.bits)
        return w[:, : self.in_features]

    def weight_bytes(self) -> int:
        """Bytes of codes, scales (and int4 zeros) one pass reads; the bias is not counted."""
        extra = self.zeros.nbytes if self.bits == 4 else 0
        return self.qweight.nbytes + self.scales.nbytes + extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., N), x's dtype."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        kp = self.scales.shape[1] * self.group_size
        if kp != self.in_features:
            x2 = F.pad(x2, (0, kp - self.in_features))  # zeros meet the padding columns
        on_cpu = x2.device.type == "cpu" and x2.dtype == torch.float32 and not x2.requires_grad
        m = x2.shape[0]
        few = 1 <= m <= quant_kernel.MAX_ROWS  # an MoE expert may get 0 rows
        # int8 activations: any number of rows through the integer kernels, MAX_ROWS at a time
        # (a prompt then computes what each of its decode steps would; measured faster than
        # fake-quantized activations times the dequantized weight, benchmarks/README.md)
        chunks = PROMPT_A8_KERNELS and self.act_bits == 8 and m > quant_kernel.MAX_ROWS
        cpp = on_cpu and (few or chunks) and self._cpp_ok and quant_kernel.available()
        if self.act_bits == 8 and not cpp:  # the C++ kernels round the activations themselves
            x2 = fake_quantize_activations(x2, act_block(self.group_size))
        if cpp and few:
            y = quant_kernel.run(x2.contiguous(), self.qweight, self.scales, self.zeros,
                                 self.group_size, self.bits, self.act_bits)  # fmt: skip
        elif cpp:
            xc, r = x2.contiguous(), quant_kernel.MAX_ROWS
            y = torch.cat([
                quant_kernel.run(xc[i : i + r], self.qweight, self.scales, self.zeros,
                                 self.group_size, self.bits, self.act_bits)
                for i in range(0, m, r)
            ])  # fmt: skip
        elif on_cpu and x2.shape[0] <= KERNEL_MAX_ROWS and self.kernel == "int8pack":
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.qweight, self.scales[:, 0])
        elif on_cpu and x2.shape[0] <= KERNEL_MAX_ROWS and self._packed is not None:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.contiguous(), self._packed, self.group_size, self._sz
            )
        else:  # more rows (a prompt), another dtype or device: the float weight, one matmul
            if self._cpp_ok and quant_kernel.available():  # one C++ pass
                w = quant_kernel.dequantize(
                    self.qweight, self.scales, self.zeros, self.group_size, self.bits
                )
            else:
                w = dequantize_stored(self.qweight, self.scales, self.zeros, self.bits)  # (N, Kp)
            y = dense(x2, w.to(x2.dtype), None)  # float32 CPU inference: oneDNN
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*lead, self.out_features)

    def _apply(self, fn: Any, recurse: bool = True) -> QuantLinear:
        """``.to(device)`` etc. moves the buffers; the kernel operands are then rebuilt."""
        super()._apply(fn, recurse)
        self._prepare()
        return self

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, group_size={self.group_size}, kernel={self.kernel}"
            + ("" if self.act_bits is None else f", act_bits={self.act_bits}")
        )


def _divisor_hint(k: int, bits: int) -> str:
    """Group sizes dividing k, the kernel's first."""
    sizes = [str(g) for g in (*INT4_KERNEL_GROUPS, 16, 8) if k % g == 0][:3] or ["2"]
    if bits == 8:  # int8's default: one scale per output row, no group (--quantize int8)
        sizes.append("none for an int8 spec (int8 without :GROUP: one scale per row)")
    return ", ".join(sizes)


def quantize_model(
    model: nn.Module,
    bits: int = 8,
    group_size: int | None = None,
    symmetric: bool = False,
    head: bool = True,
    pad: bool = False,
    act_bits: int | None = None,
    head_bits: int = 8,
) -> nn.Module:
    """Replace, in place, every ``nn.Linear`` of ``model`` (attention q/k/v/o, FFN, the LM head
    unless ``head=False``) by a :class:`QuantLinear`; embeddings and norms stay float. The LM
    head gets ``head_bits`` (8 by default, with ``group_size``: :class:`QuantSpec`). A module
    listing child names in ``keep_float`` (an MoE router, MLA's absorbed ``kv_b_proj``) keeps
    those float. A head tied to the embedding gets its own quantized copy and the model is no
    longer tied (the embedding is still float). Returns ``model`` (eval mode; for inference).

    ``act_bits=8``: every quantized layer also quantizes its input to int8 (QuantLinear).

    Raises LmlabError for bits outside {4, 8}, act_bits other than None / 8, or a group size
    that does not divide a layer's in_features (naming the layer) unless ``pad``.
    """
    spec = QuantSpec(bits, group_size, symmetric, head, pad, act_bits, head_bits)
    spec.check()
    targets: list[tuple[nn.Module, str, str, nn.Linear]] = []
    for parent_name, parent in model.named_modules():
        keep = getattr(parent, "keep_float", ())
        for child_name, child in parent.named_children():
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is not nn.Linear or child_name in keep:
                continue
            if not head and parent is model and child_name == "lm_head":
                continue
            targets.append((parent, child_name, full, child))
    # every layer is quantized (and any refusal raised) before the model changes
    new = {full: QuantLinear(lin, head_bits if parent is model and child_name == "lm_head"
                             else bits, group_size, symmetric, pad, full, act_bits)
           for parent, child_name, full, lin in targets}  # fmt: skip
    tied = getattr(model, "tied", None)
    for parent, child_name, full, _ in targets:
        setattr(parent, child_name, new[full])
    if tied is not None and tied[0] in new:  # the head is its own (quantized) matrix now
        model.tied = None  # type: ignore[assignment]
    model.quantization = spec  # type: ignore[assignment]
    return model.eval()


def quantized_weight_bytes(model: nn.Module) -> int:
    """Bytes of linear-layer weights one token's forward pass reads: QuantLinear codes + scales,
    float nn.Linear weights (a tied head counted: it is read as the head)."""
    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            total += m.weight_bytes()
        elif isinstance(m, nn.Linear):
            total += m.weight.nbytes
    return total


def apply_quantization(model: nn.Module, spec: str | QuantSpec) -> nn.Module:
    """:func:`quantize_model` with ``spec`` a :class:`QuantSpec` or its text form (``int8``,
    ``int4``, ``int4:64``, ``int4+a8``: :func:`parse_spec`). Raises LmlabError for anything
    else (a number, bytes, None)."""
    if not isinstance(spec, str | QuantSpec):
        raise LmlabError(
            f"quantize must be a string like 'int4' or 'int4+a8' (or a QuantSpec), got "
            f"{type(spec).__name__} {spec!r:.40}"
        )
    s = parse_spec(spec) if isinstance(spec, str) else spec
    s.check()
    return quantize_model(
        model, s.bits, s.group_size, s.symmetric, s.head, s.pad, s.act_bits, s.head_bits
    )
