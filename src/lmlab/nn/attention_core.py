"""The attention core every softmax attention kind calls: masks, backend dispatch, GQA, padding.

Legend: B batch, T query tokens, S key tokens (cache + T), H heads, K kv heads, hd head_dim.
Masks are bool with True = may attend.

:func:`attend` computes ``softmax(Q K^T * scale + bias) V`` (Vaswani et al. 2017) for q (B, H, T,
hd) and k, v (B, K, S, hd): it builds the structural mask (a :data:`~lmlab.nn.masks.MASKS`
function, or none) intersected with the key padding mask, shares each kv head among H/K query
heads (grouped-query attention, Ainslie et al. 2023), calls the selected backend and zeroes the
output of queries that see no key. Self-attention (:class:`~lmlab.nn.attention.SoftmaxAttention`),
cross-attention and any new softmax kind call it instead of repeating that bookkeeping.

A backend is a function ``fn(q, k, v, mask, scale, dropout_p) -> (out (B, H, T, hd), weights
(B, H, T, S) or None)`` registered in :data:`ATTENTION_BACKENDS` under the name
``model.attention.backend`` selects; k and v arrive with H heads, ``mask`` is None, a bool mask
broadcastable to (B, H, T, S) (True = may attend) or an additive float mask (0 or -inf plus any
score bias). Three optional attributes, set with :func:`backend_traits`, say what more it can do:
``returns_weights`` (it returns the weights; otherwise a hooked call, below, uses ``math``),
``takes_bias`` (it takes the score bias as ``bias=`` with a bool mask; otherwise the bias is
folded into an additive mask) and ``causal_fast_path`` (it takes ``mask=None`` with
``is_causal=``/``enable_gqa=`` keywords, so plain causal attention builds no mask at all);
``softmax`` marks a backend computing the softmax formula, the one a mask's sparse path computes.

A mask may offer a sparse path: a ``sparse_attend(q, k, v, *, scale, window, key_mask,
dropout_p) -> (B, H, T, hdv) or None`` attribute that computes the same softmax over only the
keys it allows (local_global: :mod:`lmlab.nn.local_global`). :func:`attend` calls it for a
softmax backend without a score bias or a scores/pattern hook; None (or any other call) runs the
dense masked formula, which is its oracle.

Attention maps (``need_weights=True`` of a model's forward, ``run_with_cache`` of
``hook_pattern``) are what the pattern :class:`~lmlab.nn.hooks.HookPoint` of the call sees: the
core takes no flag for them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from lmlab.errors import LmlabError
from lmlab.nn.hooks import HookPoint
from lmlab.nn.masks import MaskFn, causal_mask, combine_masks
from lmlab.registry import Registry

AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]

ATTENTION_BACKENDS: Registry[AttentionFn] = Registry("attention_backend", "model.attention.backend")


def backend_traits(
    fn: AttentionFn,
    *,
    returns_weights: bool = False,
    takes_bias: bool = False,
    causal_fast_path: bool = False,
    softmax: bool = False,
) -> AttentionFn:
    """Declare what a backend function can do beyond the plain call (module docstring); returns
    ``fn`` itself, with the four flags set as attributes."""
    fn.returns_weights = returns_weights  # type: ignore[attr-defined]
    fn.takes_bias = takes_bias  # type: ignore[attr-defined]
    fn.causal_fast_path = causal_fast_path  # type: ignore[attr-defined]
    fn.softmax = softmax  # type: ignore[attr-defined]
    return fn


def attention_math(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    dropout_p: float = 0.0,
    bias: torch.Tensor | None = None,
    scores_hook: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit attention. q (B, H, T, hd), k and v (B, H, S, hd); mask bool (T, S) or
    broadcastable (True = may attend); bias: additive float scores broadcastable to (B, H, T, S).

    Returns (out (B, H, T, hd), weights (B, H, T, S), rows summing to 1). A row whose keys are all
    masked gets weights of 0 (and so an output of 0) instead of NaN. The softmax runs in the
    scores' dtype promoted to at least float32 (bf16/fp16 up to float32, float64 stays float64),
    so a float64 model is a float64 reference. ``scores_hook``: called on the masked scores
    (B, H, T, S) (-inf where masked) before the softmax; what it returns is used.
    """
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, T, S)
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if scores_hook is not None:
        scores = scores_hook(scores)
    softmax_dtype = torch.promote_types(scores.dtype, torch.float32)  # promote, never demote
    weights = torch.softmax(scores, dim=-1, dtype=softmax_dtype).nan_to_num(0.0).to(q.dtype)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return torch.matmul(weights, v), weights


def attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> tuple[torch.Tensor, None]:
    """The same function through PyTorch's fused kernel; shapes as :func:`attention_math`, except
    that with ``enable_gqa`` k and v may have K heads dividing H (torch >= 2.5).

    Returns (out, None): the fused kernel never materialises the weights. A causal bf16 CPU
    call that records gradients (training under bf16 autocast) runs lmlab's own instead
    (:func:`causal_attention_train`, where :func:`bmm_causal_applies`): faster there, the same
    function to bf16 rounding.
    """
    if (
        is_causal
        and mask is None
        and bmm_causal_applies(q, k, dropout_p)
        and (not enable_gqa or fused_attention_applies(q, v))  # the fused kernel shares kv heads
    ):
        return causal_attention_train(q, k, v, scale), None
    gqa = {"enable_gqa": True} if enable_gqa else {}
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **gqa
    )
    return out, None


# The bf16 training path of the sdpa backend on a CPU (attention_sdpa): up to this many tokens,
# three bf16 batched matmuls and a softmax train faster than the fused CPU kernel, whose bf16
# backward is slow (`benchmarks/train_step_ab.py --attention`, benchmarks/README.md: 3-14x at
# T 64 hd 32, 1.0-1.9x at T 256 hd 64, 0.8-1.1x at T 512, 0.5-0.7x at T 1024, 1 thread).
BMM_CAUSAL_MAX_T = 256
# In that path, the causal softmax (and its backward) through lmlab's C++ kernel
# (lmlab.nn.train_kernel.causal_softmax_: the lower triangle only, in place); False keeps
# masked_fill + torch.softmax (A/B benchmarks).
TRAIN_SOFTMAX_KERNEL = True
# In that path, lmlab's fused causal attention where it is built and preferred (AVX512-BF16
# CPUs without AMX, head dims that are multiples of 16: torch.ops.lmlab.causal_attention_bf16,
# attention_kernels.cpp): one (batch, head) at a time in cache, the blocks above the diagonal
# never multiplied; False keeps the batched matmuls (A/B benchmarks:
# `benchmarks/train_step_ab.py --attention-kernel`).
TRAIN_FUSED_ATTENTION = True
_CAUSAL_ABOVE: dict[tuple[int, torch.device], torch.Tensor] = {}


def bmm_causal_applies(q: torch.Tensor, k: torch.Tensor, dropout_p: float) -> bool:
    """Whether :func:`attention_sdpa`'s causal call takes :func:`causal_attention_train`: a
    bfloat16 CPU call that records gradients (training: the fused kernel's bf16 backward is the
    slow part; its forward alone is faster), no dropout, 1 < T = S <= BMM_CAUSAL_MAX_T, not
    under torch.compile (which fuses attention itself)."""
    t = q.shape[-2]
    return (
        q.dtype == torch.bfloat16
        and q.device.type == "cpu"
        and dropout_p == 0.0
        and 1 < t <= BMM_CAUSAL_MAX_T
        and k.shape[-2] == t
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad)
        and not torch.compiler.is_compiling()
    )


def causal_above(t: int, device: torch.device) -> torch.Tensor:
    """(T, T) bool, True above the diagonal: the keys a causal query may not see (a constant,
    kept per size and device)."""
    key = (t, device)
    above = _CAUSAL_ABOVE.get(key)
    if above is None:
        above = _CAUSAL_ABOVE[key] = torch.ones(t, t, dtype=torch.bool, device=device).triu(1)
    return above


NO_DOUBLE_BACKWARD = (
    "lmlab's batched-matmul causal attention (bf16 CPU training, the sdpa backend) has no "
    "second-order gradients (create_graph=True, e.g. a gradient penalty); use "
    "model.attention.backend: math for them (torch's fused CPU attention has none either)"
)


class _CausalAttentionBmm(torch.autograd.Function):
    """The forward and backward of :func:`causal_attention_bmm` written out (no autograd graph
    of its six ops, no pass that autograd would add over the (B H, T, T) scores): forward
    S = (q scale) k^T with -inf above the diagonal, P = softmax(S), out = P v; backward
    dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(P dP)) (softmax's backward), dQ = dS K scale,
    dK = dS^T (q scale). Saves q scale, k, v and P (made without a graph back to q, k and v, so
    a backward that records its own, create_graph, raises: no second-order gradients, as
    torch's fused CPU attention). Where lmlab's training kernels are compiled
    the operator torch.ops.lmlab.causal_attention_bmm (train_ops.cpp) runs instead: these same
    steps in C++, with the mask and softmax (and its backward) in lmlab's causal softmax kernel
    when :data:`TRAIN_SOFTMAX_KERNEL` is on."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        b, h, t, hd = q.shape
        qs = torch.empty((b, h, t, hd), dtype=q.dtype, device=q.device)
        torch.mul(q, scale, out=qs)  # scaled, contiguous: one pass
        qs = qs.view(b * h, t, hd)
        k3 = k.reshape(b * h, t, hd)
        v3 = v.reshape(b * h, t, v.shape[-1])
        scores = torch.bmm(qs, k3.transpose(1, 2))  # (B H, T, T)
        scores.masked_fill_(causal_above(t, q.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        ctx.save_for_backward(qs, k3, v3, probs)
        ctx.scale, ctx.shape = scale, (b, h, t, hd, v.shape[-1])
        return torch.bmm(probs, v3).view(b, h, t, v.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # create_graph: the saved tensors have no graph to q, k, v
            raise RuntimeError(NO_DOUBLE_BACKWARD)
        qs, k3, v3, probs = ctx.saved_tensors
        b, h, t, hd, hdv = ctx.shape
        g = grad_out.reshape(b * h, t, hdv)
        dv = torch.bmm(probs.transpose(1, 2), g)
        dp = torch.bmm(g, v3.transpose(1, 2))
        ds = torch._softmax_backward_data(dp, probs, -1, probs.dtype)
        dq = torch.bmm(ds, k3).mul_(ctx.scale)
        dk = torch.bmm(ds.transpose(1, 2), qs)
        return dq.view(b, h, t, hd), dk.view(b, h, t, hd), dv.view(b, h, t, hdv), None


def causal_attention_bmm(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal softmax(q k^T * scale) v for q, k, v (B, H, T, hd) of one dtype, as three batched
    matmuls: scores (q * scale) k^T (B H, T, T) in q's dtype (the matmul accumulates in
    float32), -inf above the diagonal, softmax over keys (computed in float32, stored in q's
    dtype), then @ v; the backward written out (:class:`_CausalAttentionBmm`). What eager bf16
    attention computes (the scores rounded to bf16 before the softmax); the fused kernel keeps
    them in float32, so the two agree to bf16 rounding (tests/unit/test_train_fast_paths.py).
    Keeps the (B H, T, T) probabilities for backward: B H T^2 elements, hence the size bound
    :data:`BMM_CAUSAL_MAX_T`. Returns (B, H, T, hd).

    With lmlab's training kernels compiled (:func:`lmlab.nn.train_kernel.available`) it runs
    as the operator torch.ops.lmlab.causal_attention_bmm (train_ops.cpp: the same ATen calls
    and kernel, the same bits, its autograd in C++, without the Python Function's overhead of
    some 20-50 us a call); otherwise as :class:`_CausalAttentionBmm`."""
    from lmlab.nn import train_kernel

    if train_kernel.available():  # the operator takes the kernel for float32 / bf16 only
        return torch.ops.lmlab.causal_attention_bmm(q, k, v, scale, TRAIN_SOFTMAX_KERNEL)
    return _CausalAttentionBmm.apply(q, k, v, scale)


def fused_attention_takes(hd: int, hdv: int) -> bool:
    """Whether the fused kernel is switched on (:data:`TRAIN_FUSED_ATTENTION`) and takes head
    dims hd (q and k) and hdv (v): multiples of 16."""
    return TRAIN_FUSED_ATTENTION and hd % 16 == 0 and hdv % 16 == 0


def fused_attention_applies(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`causal_attention_train` runs lmlab's fused kernel for these q and v (on a
    path where :func:`bmm_causal_applies`): :func:`fused_attention_takes` their head dims, bf16,
    and the kernel built and preferred here (:func:`lmlab.nn.train_kernel.attention_bf16_preferred`:
    AVX512-BF16, no AMX)."""
    from lmlab.nn import train_kernel

    return (
        fused_attention_takes(q.shape[-1], v.shape[-1])
        and q.dtype == torch.bfloat16
        and train_kernel.attention_bf16_preferred()
    )


def causal_attention_train(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal softmax(q k^T * scale) v for bf16 CPU training (:func:`bmm_causal_applies`), q (B,
    H, T, hd), k (B, K, T, hd), v (B, K, T, hdv) -> (B, H, T, hdv).

    Where :func:`fused_attention_applies`, lmlab's fused kernel
    (``torch.ops.lmlab.causal_attention_bf16``): per (batch, head), S = q k^T scale in float32
    over the blocks on or below the diagonal only, the softmax rounded once to bf16, P v, and
    the backward likewise, with AVX512-BF16 dot products, about half the multiply-adds of the
    six full batched matmuls; it shares kv heads itself (GQA, K dividing H: query head h reads
    kv head h // (H / K), dK and dV summed over those heads in float32). Otherwise
    :func:`causal_attention_bmm` (K = H). Both keep P (bf16, T^2 per head) for the backward and
    have no second-order gradients; they agree to bf16 rounding (the fused kernel does not round
    q scale and the scores to bf16 first)."""
    if fused_attention_applies(q, v):
        return torch.ops.lmlab.causal_attention_bf16(q, k, v, scale)
    return causal_attention_bmm(q, k, v, scale)


# torch >= 2.5: scaled_dot_product_attention shares kv heads itself (no repeat_kv copy)
SDPA_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2] if p.isdigit()) >= (2, 5)

ATTENTION_BACKENDS.register(
    "sdpa", "PyTorch's fused scaled_dot_product_attention: fast, returns no weights."
)(backend_traits(attention_sdpa, causal_fast_path=True, softmax=True))
ATTENTION_BACKENDS.register(
    "math", "The formula spelled out: materialises and can return the attention weights."
)(backend_traits(attention_math, returns_weights=True, takes_bias=True, softmax=True))
attention_math.takes_scores_hook = True  # type: ignore[attr-defined]  # see attend(hooks=)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, K, S, hd) -> (B, K * n_rep, S, hd): each kv head serves n_rep consecutive query heads."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    backend: AttentionFn,
    scale: float,
    n_rep: int = 1,
    mask_fn: MaskFn | None = None,
    window: int | None = None,
    key_mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    hooks: tuple[HookPoint, HookPoint] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention of q (B, H, T, hd) over k, v (B, K, S, hd), K = H / ``n_rep``.

    ``mask_fn``: the structural mask, ``fn(t, s, device, window) -> (T, S)`` bool (queries are
    the last T of S positions); None: every query sees every key (cross-attention). ``key_mask``
    (B, S') bool, True = real token, S' >= S (its last S columns are used: a sliding cache keeps
    only the last keys); padding keys are never attended to and a query with no key to attend to
    outputs 0 (weights 0), never NaN. ``bias``: additive float scores broadcastable to (B, H, T,
    S) (ALiBi, T5 relative bias) or None. ``dropout_p``: dropout on the weights (pass 0 in eval).
    ``backend``: a function of :data:`ATTENTION_BACKENDS`.

    ``hooks``: the (scores, pattern) :class:`~lmlab.nn.hooks.HookPoint` pair of the calling
    layer. While either has a function registered (a user's hook, or the recorder of a model
    forward with ``need_weights=True``) the call materialises the weights (a backend that
    returns them, :func:`attention_math` otherwise; no sparse path, no fused fast path): the
    scores point sees the masked scores (B, H, T, S) before the softmax (backends with a
    ``takes_scores_hook`` attribute), the pattern point the weights (B, H, T, S) before
    dropout (0 in the rows of queries with no visible key), and a replaced pattern gives
    out = pattern @ v. Unhooked, nothing changes.

    Returns (out (B, H, T, hd), weights (B, H, T, S) when the backend materialised them, else
    None).
    """
    t, s = q.shape[2], k.shape[2]
    hooked = hooks is not None and bool(hooks[0].fns or hooks[1].fns)
    if hooked and not getattr(backend, "returns_weights", False):
        backend = attention_math  # the one backend that materialises the weights
    extra: dict = {}
    if hooked and hooks is not None and hooks[0].fns:
        if not getattr(backend, "takes_scores_hook", False):
            raise LmlabError(
                f"{hooks[0].name}: this attention backend exposes no pre-softmax scores"
            )
        extra["scores_hook"] = hooks[0]
    sparse = getattr(mask_fn, "sparse_attend", None)
    softmax = getattr(backend, "softmax", False)
    if sparse is not None and softmax and not hooked and bias is None:
        y = sparse(q, k, v, scale=scale, window=window, key_mask=key_mask, dropout_p=dropout_p)
        if y is not None:  # the mask's sparse path; None: it does not apply to this call
            return y, None
    plain_causal = bias is None and key_mask is None and mask_fn is causal_mask
    fast = getattr(backend, "causal_fast_path", False) and not hooked
    if fast and plain_causal and (s == t or t == 1):
        # no mask to build: s == t is causal over the new tokens, t == 1 sees every cached key
        gqa = SDPA_GQA and n_rep > 1
        if not gqa:
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, H, S, hd)
        y, _ = backend(q, k, v, None, scale, dropout_p, is_causal=s == t, enable_gqa=gqa)
        return y, None
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, H, S, hd)
    mask: torch.Tensor | None = None
    empty: torch.Tensor | None = None
    if key_mask is not None:
        key_mask = key_mask[:, -s:]
    if mask_fn is not None:
        mask, empty = combine_masks(mask_fn(t, s, q.device, window), key_mask)
    elif key_mask is not None:
        every = torch.ones(t, s, dtype=torch.bool, device=q.device)  # no structural mask
        mask, empty = combine_masks(every, key_mask)  # (B, 1, T, S)
    if bias is None:
        y, w = backend(q, k, v, mask, scale, dropout_p, **extra)
    elif getattr(backend, "takes_bias", False):
        y, w = backend(q, k, v, mask, scale, dropout_p, bias=bias, **extra)
    else:  # fold the bool mask into the additive bias
        bias = bias.to(q.dtype)
        y, w = backend(
            q,
            k,
            v,
            bias if mask is None else bias.masked_fill(~mask, float("-inf")),
            scale,
            dropout_p,
            **extra,
        )
    if empty is not None and w is not None:  # queries with no visible key weigh 0 on all keys
        w = w.masked_fill(empty, 0.0)
    if hooked and hooks is not None and hooks[1].fns and w is not None:
        replaced = hooks[1](w)  # (B, H, T, S), padding rows 0
        if replaced is not w:  # an edited pattern: recompute the output from it
            w = replaced
            y = torch.matmul(F.dropout(w, p=dropout_p) if dropout_p > 0.0 else w, v)
    if empty is not None:  # queries with no visible key (padding rows) output 0
        y = y.masked_fill(empty, 0.0)
    return y, w
