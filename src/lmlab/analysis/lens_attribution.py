"""Direct logit attribution (Elhage et al. 2021, "A Mathematical Framework for Transformer
Circuits", section "Direct path / the residual stream as a sum"): how much each head and FFN
writes into one logit, in a pre-norm decoder or a pre-norm encoder-decoder's decoder.

Legend: T tokens, D d_model, V vocab, L layers, H heads (the head axis of ``hook_z``), hz its
width, C components. The model is read through :mod:`lmlab.hooks` only, with the shared pieces
of :mod:`lmlab.analysis.lens` (which stream, how it is run and unembedded); the method and what
is exact are described in that module's docstring and :func:`direct_logit_attribution`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmlab.analysis.lens import (
    _as_batch,
    _encdec,
    _eval,
    _layers,
    _prefix,
    _run,
    _source,
    unembedding,
)
from lmlab.errors import LmlabError
from lmlab.hooks import hook_names


@dataclass
class LogitAttribution:
    """Direct logit attribution of one logit (or logit difference) at one position.

    ``names`` (C,) and ``values`` (C,) float64, in residual order: ``embed``, ``positions``
    (learned or sinusoidal tables only), then per layer i ``L{i}H{h}`` for each head,
    ``L{i}.attn_bias`` (o_proj's bias, when it has one) and ``L{i}.ffn``, and last the constant
    terms ``final_norm.bias`` (LayerNorm) and ``lm_head.bias`` (when present). The same numbers
    by shape: heads (L, H), attn_bias (L,), ffn (L,). ``total`` = values.sum(); ``actual`` the
    model's own logit (difference) from the same pass; ``scale`` the frozen divisor of the final
    norm (sqrt(mean(x^2) + eps) for RMSNorm, sqrt(var(x) + eps) for LayerNorm, 1 without one).
    Units: logits (nats of an unnormalised log-probability).

    An encoder-decoder's decoder layer i has ``L{i}.self.H{h}``, ``L{i}.self.bias``,
    ``L{i}.cross.H{h}``, ``L{i}.cross.bias`` and ``L{i}.ffn`` (heads / attn_bias are the
    self-attention's, cross_heads (L, H) / cross_bias (L,) the cross-attention's; None in
    the other kinds), and the constant ``final_logits_bias`` (BART) when configured."""

    names: list[str]
    values: torch.Tensor
    heads: torch.Tensor
    attn_bias: torch.Tensor
    ffn: torch.Tensor
    total: float
    actual: float
    scale: float
    target: int
    versus: int | None
    position: int
    cross_heads: torch.Tensor | None = None
    cross_bias: torch.Tensor | None = None

    def top(self, n: int = 10) -> list[tuple[str, float]]:
        """The ``n`` components with the largest |contribution|, largest first."""
        order = self.values.abs().argsort(descending=True)[:n]
        return [(self.names[i], float(self.values[i])) for i in order.tolist()]

    def __getitem__(self, name: str) -> float:
        if name not in self.names:
            raise KeyError(name)
        return float(self.values[self.names.index(name)])


def direct_logit_attribution(
    model: nn.Module,
    ids: torch.Tensor,
    target: int,
    versus: int | None = None,
    position: int = -1,
    source_ids: torch.Tensor | None = None,
    source_mask: torch.Tensor | None = None,
) -> LogitAttribution:
    """Split the logit of token ``target`` at ``position`` (or, with ``versus``, the logit
    difference target - versus) into what each component writes into the final residual
    (Elhage et al. 2021): the embedding (+ positions), every attention head, every o_proj bias
    and every FFN output, of a pre-norm decoder (``ids`` (1, T) or (T,) int64, one sequence).

    Head h of layer i contributes ``o_proj.weight[:, h hz : (h + 1) hz] @ z_h`` where z is
    ``layers.{i}.attn.hook_z`` (B, H, T, hz) (differential attention: its H/2 heads of width
    2 hd; MLA: H heads of width dv; every kind that reaches o_proj through hook_z).

    Where it is exact and where a linearisation: the split of the final residual into the
    components is exact (the residual of a pre-norm or parallel block is that sum; checked,
    LmlabError otherwise), and so is the head split of each attention output (o_proj is
    linear). The final norm is not linear: its divisor (RMS, or the standard deviation for
    LayerNorm) is frozen at the clean run's value and each component is pushed through the now
    linear map (LayerNorm's mean subtraction is linear; its bias is a constant term). The
    contributions therefore sum to the real logit (to float rounding; computed in float64), but
    a component's value is its share at this run's scale, not the logit change if it were
    removed (that would also change the divisor and every later layer). With no final norm
    (``model.final_norm: false``) the last layer's terms are exactly that change.

    A pre-norm encoder-decoder (``ids`` the decoder input, ``source_ids`` (1, S) the encoder
    input, ``source_mask`` (1, S) or None): the decoder's embedding (+ positions; with
    ``seq2seq.embed_norm`` the one normed ``embed`` term), per layer its self-attention heads
    (``decoder.layers.{i}.attn.hook_z``), cross-attention heads (``...cross_attn.hook_z``:
    what each reads from the source, the encoder not decomposed) and FFN, through the decoder's
    final norm frozen as above and the head with its output scale.

    Raises LmlabError for: an encoder (its MLM head is dense + activation + LayerNorm, not
    linear), post-norm / hybrid / hyper-connection blocks or ``block.residual: false`` (the
    final residual is not a sum of the components; an encoder-decoder's post-norm (BART)
    decoder too), an attention kind without ``hook_z``, a final norm other than RMSNorm /
    LayerNorm / none, ids of more than one sequence, a position out of range, token ids
    outside the vocabulary, a source missing (encoder-decoder) or given (other kinds).
    """
    ids = _as_batch(ids)
    source = _source(model, ids, source_ids, source_mask)
    pos = _check_attributable(model, ids, target, versus, position)
    n_layers, p = len(_layers(model)), _prefix(model)
    names = [f"{p}hook_embed", f"{p}layers.0.hook_resid_pre",
             f"{p}layers.{n_layers - 1}.hook_resid_post"]  # fmt: skip
    for i in range(n_layers):
        names += [f"{p}layers.{i}.{a}.hook_z" for a in _attentions(model)]
        names.append(f"{p}layers.{i}.ffn.hook_out")
    with _eval(model):
        out, cache = _run(model, ids, names, None, source)
    with torch.no_grad():
        return _attribute(model, cache, out.logits[0, pos], pos, target, versus)


def _attentions(model: nn.Module) -> tuple[str, ...]:
    """The attention sublayers of a layer, in residual order."""
    return ("attn", "cross_attn") if _encdec(model) else ("attn",)


def _check_attributable(
    model: nn.Module, ids: torch.Tensor, target: int, versus: int | None, position: int
) -> int:
    """Refuse what direct_logit_attribution cannot decompose (its docstring lists it); returns
    the position counted from 0."""
    from lmlab.models.decoder import DecoderLM
    from lmlab.nn.block import PreNormBlock, PreNormDecoderBlock

    if ids.shape[0] != 1:
        raise LmlabError(f"direct logit attribution reads one sequence: ids (1, T), got "
                         f"{tuple(ids.shape)}")  # fmt: skip
    encdec = _encdec(model)
    if not isinstance(model, DecoderLM) and not encdec:
        unembedding(model)  # the general refusal, else the encoder's
        raise LmlabError(
            "direct logit attribution needs a decoder: this encoder's masked-LM head (dense + "
            "activation + LayerNorm before the vocabulary) is not linear in the residual stream"
        )
    layers = _layers(model)
    cfg: Any = getattr(model, "cfg")  # noqa: B009
    points = set(hook_names(model))
    for i, layer in enumerate(layers):
        if encdec and not isinstance(layer, PreNormDecoderBlock):
            raise LmlabError(
                f"direct logit attribution needs pre-norm decoder blocks (model.block.kind=pre); "
                f"this encoder-decoder has model.block.kind={cfg.block.kind}: a post-norm "
                "decoder layer normalises the stream after each residual addition "
                "(norm(x + sublayer(x)), BART), so the final residual is not a sum of the "
                "components"
            )
        if not encdec and (not isinstance(layer, PreNormBlock) or not layer.residual):
            raise LmlabError(
                f"direct logit attribution needs pre-norm blocks (model.block.kind=pre, "
                f"parallel or not) with residual connections; this model has "
                f"model.block.kind={cfg.block.kind} residual={cfg.block.residual}: a post-norm, "
                "hybrid or hyper-connection block normalises or mixes the stream inside its "
                "layers, so the final residual is not a sum of the components"
            )
        for a in _attentions(model):
            if f"{_prefix(model)}layers.{i}.{a}.hook_z" not in points:
                raise LmlabError(
                    f"model.attention.kind={cfg.attention.kind} has no per-head output point "
                    "(hook_z), so its heads cannot be separated"
                )
    t = ids.shape[1]
    if not -t <= position < t:
        raise LmlabError(
            f"position {position} is out of range: the text has {t} tokens (0..{t - 1}, or "
            f"-{t}..-1 from the end)"
        )
    pos = position % t
    v = getattr(model, "lm_head").weight.shape[0]  # noqa: B009
    for what, tok in (("target", target), ("versus", versus)):
        if tok is not None and not 0 <= tok < v:
            raise LmlabError(f"{what} token id {tok} is outside the vocabulary (0..{v - 1})")
    return pos


def _head_terms(
    attn: Any, z: torch.Tensor, layer: str, kind: str
) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor | None]:
    """One attention's per-head writes (H, D) from its z (H, hz) at one position (float64 CPU),
    named ``{layer}H{h}`` (``layer`` = "L3" or "L3.self." / "L3.cross."), and its o_proj bias
    (D,) or None. Raises LmlabError when hook_z does not match o_proj."""
    w_o = attn.o_proj.weight.to("cpu", torch.float64)  # (D, H hz)
    n_h, hz = z.shape
    if w_o.shape[1] != n_h * hz:
        raise LmlabError(
            f"layer {layer.strip('L.')}: hook_z is {n_h} heads x {hz} but o_proj reads "
            f"{w_o.shape[1]} features (model.attention.kind={kind})"
        )
    per_head = torch.einsum("dhz,hz->hd", w_o.view(-1, n_h, hz), z)  # (H, D)
    bias = attn.o_proj.bias
    return [(f"{layer}H{h}", per_head[h]) for h in range(n_h)], (
        None if bias is None else bias.to("cpu", torch.float64)
    )


def _attribute(
    model: Any,
    cache: dict[str, torch.Tensor],
    logits: torch.Tensor,
    pos: int,
    target: int,
    versus: int | None,
) -> LogitAttribution:
    """The attribution from a clean run's cache (see direct_logit_attribution); logits (V,)."""
    layers, cfg, p, encdec = _layers(model), model.cfg, _prefix(model), _encdec(model)
    n_layers = len(layers)
    f64, cpu = torch.float64, torch.device("cpu")  # one position: float64 on the CPU

    def at(name: str) -> torch.Tensor:  # (D,), or (H, hz) of hook_z, at the position, float64
        x = cache[p + name][0]
        return (x[:, pos] if name.endswith("hook_z") else x[pos]).to(cpu, f64)

    stream = model.decoder if encdec else model
    terms: list[tuple[str, torch.Tensor]] = [("embed", at("hook_embed"))]
    if encdec and not isinstance(stream.embed_norm, nn.Identity):
        terms = [("embed", at("layers.0.hook_resid_pre"))]  # normed: one term with positions
    positions = at("layers.0.hook_resid_pre") - terms[0][1]
    if bool(positions.ne(0).any()):
        terms.append(("positions", positions))
    idx: dict[str, list[list[int]]] = {"heads": [], "bias": [], "cross": [], "cross_bias": []}
    ffn_idx: list[int] = []
    for i, layer in enumerate(layers):
        for a, key in zip(_attentions(model), ("", "cross_"), strict=False):
            label = f"L{i}." + ("cross." if key else "self.") if encdec else f"L{i}"
            heads, bias = _head_terms(getattr(layer, a), at(f"layers.{i}.{a}.hook_z"), label,
                                      cfg.attention.kind)  # fmt: skip
            idx["cross" if key else "heads"].append(
                list(range(len(terms), len(terms) + len(heads)))
            )
            terms += heads
            idx[key + "bias"].append([len(terms)] if bias is not None else [])
            if bias is not None:
                terms.append((f"{label}bias" if encdec else f"L{i}.attn_bias", bias))
        ffn_idx.append(len(terms))
        terms.append((f"L{i}.ffn", at(f"layers.{i}.ffn.hook_out")))
    resid = cache[f"{p}layers.{n_layers - 1}.hook_resid_post"][0, pos].cpu()  # (D,) as computed
    stacked = torch.stack([c for _, c in terms])  # (C, D) float64
    _check_sum(stacked.sum(0), resid, len(terms), cfg.block.kind)
    linear, const, scale = frozen_norm(stream.final_norm, resid)
    w_u, out_scale = model.lm_head.weight, getattr(model, "output_scale", 1.0)
    u = w_u[target].to(cpu, f64)  # (D,)
    if versus is not None:
        u = u - w_u[versus].to(cpu, f64)
    if out_scale != 1.0:  # T5: lm_head(final_norm(x) * d_model**-0.5)
        u = u * out_scale
    values = linear(stacked) @ u  # (C,)
    extra = [("final_norm.bias", float(const @ u))] if const is not None else []
    head_bias = getattr(model.lm_head, "bias", None)
    if head_bias is not None:
        hb = head_bias[target] - (head_bias[versus] if versus is not None else 0)
        extra.append(("lm_head.bias", float(hb)))
    fb = getattr(model, "final_logits_bias", None)  # BART: (1, V) added to the logits
    if fb is not None:
        fb = fb[0].to(cpu, f64)
        extra.append(
            ("final_logits_bias", float(fb[target] - (fb[versus] if versus is not None else 0.0)))
        )
    all_names = [n for n, _ in terms] + [n for n, _ in extra]
    values = torch.cat([values, torch.tensor([x for _, x in extra], dtype=f64)])
    logits = logits.to(cpu, f64)
    actual = logits[target] - (logits[versus] if versus is not None else 0.0)
    zero = torch.zeros((), dtype=f64)

    def biases(rows: list[list[int]]) -> torch.Tensor:
        return torch.stack([values[j[0]] if j else zero for j in rows])

    return LogitAttribution(
        names=all_names,
        values=values,
        heads=torch.stack([values[j] for j in idx["heads"]]),
        attn_bias=biases(idx["bias"]),
        ffn=values[ffn_idx],
        total=float(values.sum()),
        actual=float(actual),
        scale=scale,
        target=target,
        versus=versus,
        position=pos,
        cross_heads=torch.stack([values[j] for j in idx["cross"]]) if encdec else None,
        cross_bias=biases(idx["cross_bias"]) if encdec else None,
    )


def _check_sum(total: torch.Tensor, resid: torch.Tensor, n_terms: int, kind: str) -> None:
    """The components (summed in float64) must rebuild the residual as the model computed it
    in its dtype (a guard for block kinds from plugins): to 1e-4 relative, or the rounding of
    ``n_terms`` additions in a low-precision dtype (bfloat16: eps 2^-7)."""
    rel = max(1e-4, n_terms * torch.finfo(resid.dtype).eps)
    err = float((total - resid.to(total.dtype)).abs().max())
    if err > rel * (1.0 + float(resid.abs().max())):
        raise LmlabError(
            f"the embedding and the sublayer outputs do not add up to the final residual "
            f"(max |difference| {err:.2e}; model.block.kind={kind}): direct logit attribution "
            "needs a residual stream that is their sum"
        )


def frozen_norm(
    norm: nn.Module, x: torch.Tensor
) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor | None, float]:
    """The final norm linearised at the residual ``x`` (D,): (linear map on (..., D) float64
    CPU tensors, constant term (D,) or None, the frozen divisor). RMSNorm: c -> c / s * weight with
    s = sqrt(mean(x^2) + eps); LayerNorm: c -> (c - mean(c)) / s * weight, constant = bias,
    s = sqrt(var(x) + eps) (biased variance, as LayerNorm's); nn.Identity (no final norm):
    c -> c, s = 1. linear(x) + constant equals norm(x) (the module's own output) to float
    rounding. Raises LmlabError for any other norm (a plugin's)."""
    from lmlab.nn.norm import RMSNorm

    xf = x.to("cpu", torch.float64)
    if isinstance(norm, nn.Identity):
        return (lambda c: c), None, 1.0
    if isinstance(norm, RMSNorm):
        s = float(torch.sqrt(xf.pow(2).mean() + norm.eps))
        w = norm.weight.to("cpu", torch.float64)
        return (lambda c: c / s * w), None, s
    if isinstance(norm, nn.LayerNorm):
        s = float(torch.sqrt(xf.var(unbiased=False) + norm.eps))
        w = norm.weight.to("cpu", torch.float64) if norm.weight is not None else 1.0
        b = norm.bias.to("cpu", torch.float64) if norm.bias is not None else None
        return (lambda c: (c - c.mean(-1, keepdim=True)) / s * w), b, s
    raise LmlabError(
        f"direct logit attribution linearises an RMSNorm, a LayerNorm or no final norm; this "
        f"model's final norm is {type(norm).__name__}"
    )
