"""The logit lens and direct logit attribution: what the residual stream predicts at each layer,
and how much each head and FFN writes into one logit.

Legend: B batch, T tokens, D d_model, V vocab, L layers, H heads (the head axis of ``hook_z``:
H/2 for differential attention), k top tokens, C components.

Both read the model only through :mod:`lmlab.hooks` (``run_with_cache``) and unembed with the
model's own modules (its ``final_norm`` and LM head; an encoder's MLM head), never a copy.

- **Logit lens** (nostalgebraist 2020, "interpreting GPT: the logit lens", LessWrong): the
  residual stream at each layer boundary, ``layers.0.hook_resid_pre`` (the embedding plus any
  learned or sinusoidal positions) then every ``layers.{i}.hook_resid_post``, put through the
  final norm and the LM head as if the model ended there. The last row IS the model's forward:
  the same modules on the same tensor, so it equals its logits bit for bit.
- **Direct logit attribution** (Elhage et al. 2021, "A Mathematical Framework for Transformer
  Circuits", section "Direct path / the residual stream as a sum"): in a pre-norm model the
  final residual is a sum, embedding (+ positions) + every attention output + every FFN output,
  and each attention output is a sum over heads, ``W_O[:, head h] z_h`` plus the o_proj bias.
  Each term is pushed through the final norm with its divisor frozen at the clean run's value
  and dotted with the unembedding row of the target (minus the row of ``versus``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.errors import LmlabError
from lmlab.hooks import hook_names, run_with_cache

Unembed = Callable[[torch.Tensor], torch.Tensor]  # the residual (..., D) -> logits (..., V)


# ----------------------------------------------------------------------------- shared pieces


@contextlib.contextmanager
def _eval(model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) and no autograd for the body; the training flag is restored."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was)


def _kind(model: nn.Module) -> str:
    cfg = getattr(model, "cfg", None)
    return str(getattr(cfg, "kind", type(model).__name__))


def unembedding(model: nn.Module) -> Unembed:
    """The model's own map from a residual (..., D) to logits (..., V): a decoder's
    ``lm_head(final_norm(x))``, an encoder's ``mlm(final_norm(x))`` (dense + activation +
    LayerNorm + the vocabulary projection). Raises LmlabError for an encoder without an MLM
    head and for any other model (an encoder-decoder's decoder residual is read against its
    source, and its layers carry a cross-attention term; neither lens is defined for it here)."""
    from lmlab.models.decoder import DecoderLM
    from lmlab.models.encoder import EncoderLM

    if isinstance(model, DecoderLM):
        return lambda x: model.lm_head(model.final_norm(x))
    if isinstance(model, EncoderLM):
        if model.lm_head is None:
            raise LmlabError(
                "this encoder has no masked-LM head (model.mlm_head=false): no vocabulary to "
                "unembed the residual stream into"
            )
        return lambda x: model.mlm(model.final_norm(x))
    raise LmlabError(
        f"the logit lens reads decoder (GPT) and encoder (BERT, with an MLM head) models; this "
        f"is model.kind={_kind(model)}: an encoder-decoder's decoder stream depends on its "
        "source and its layers add cross-attention, which these functions do not decompose"
    )


def _layers(model: nn.Module) -> Any:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise LmlabError(f"model.kind={_kind(model)} has no layer stack (model.layers)")
    return layers


def _forward_kwargs(model: nn.Module, key_mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """attention_mask (and a decoder's positions counted over real tokens) of a padded batch."""
    if key_mask is None:
        return {}
    from lmlab.models.decoder import DecoderLM
    from lmlab.nn.masks import position_ids_from_attention_mask

    kwargs = {"attention_mask": key_mask}
    if isinstance(model, DecoderLM):  # left padding: each row's positions as if alone
        kwargs["position_ids"] = position_ids_from_attention_mask(key_mask)
    return kwargs


def _as_batch(ids: torch.Tensor) -> torch.Tensor:
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[1] == 0 or ids.dtype != torch.long:
        raise LmlabError(f"ids must be (B, T) or (T,) int64 token ids, got {tuple(ids.shape)}")
    return ids


# ----------------------------------------------------------------------------- logit lens


@dataclass
class LogitLens:
    """The lens of one forward pass. Rows are layer boundaries: row 0 is
    ``layers.0.hook_resid_pre`` (embedding + positions), row i + 1 is
    ``layers.{i}.hook_resid_post``; ``hooks`` names them (L + 1 names).

    top_ids (B, L + 1, T, k) int64 and top_probs (B, L + 1, T, k) float32: the k most likely
    next tokens of each row at each position, most likely first (probabilities, not log).
    log_probs (B, L + 1, T, V) float32 natural-log probabilities (None when not kept).
    logits (B, T, V): the model's own output of the same pass. With targets: target_ids
    (B, T) int64, target_probs (B, L + 1, T) float32 (probability of the target at each row and
    position) and target_ranks (B, L + 1, T) int64, 1 = the most likely token (1 + the number
    of tokens with a strictly higher probability)."""

    hooks: list[str]
    top_ids: torch.Tensor
    top_probs: torch.Tensor
    logits: torch.Tensor
    log_probs: torch.Tensor | None = None
    target_ids: torch.Tensor | None = None
    target_probs: torch.Tensor | None = None
    target_ranks: torch.Tensor | None = None

    @property
    def row_labels(self) -> list[str]:
        """``embed``, ``layer 0``, ... ``layer L-1``: what each row has passed through."""
        return ["embed"] + [f"layer {i}" for i in range(len(self.hooks) - 1)]


def logit_lens(
    model: nn.Module,
    ids: torch.Tensor,
    top_k: int = 5,
    key_mask: torch.Tensor | None = None,
    targets: torch.Tensor | int | None = None,
    keep_log_probs: bool = True,
) -> LogitLens:
    """The logit lens (nostalgebraist 2020) of ``model`` on ``ids`` (B, T) or (T,) int64.

    Each layer boundary's residual stream (``layers.0.hook_resid_pre``, then each
    ``layers.{i}.hook_resid_post``; a hyper-connection stack's n streams summed by the block's
    own ``reduce_stream``, as the final norm reads them) goes through the model's final norm and
    LM head (:func:`unembedding`), then a float32 log-softmax. The last row is the model's
    forward pass itself: ``log_probs[:, -1]`` equals ``log_softmax(logits.float())`` exactly.

    ``key_mask`` (B, T) bool or int, True/1 = real token: a padded batch (a decoder also gets
    positions counted over real tokens, so a left-padded row equals the row alone).
    ``targets``: a token id for every position, or (B, T) int64 ids (e.g. the next tokens), to
    follow through the layers. ``keep_log_probs=False`` keeps only the top k (memory: the full
    tensor is B (L + 1) T V floats). The model runs in eval mode, without autograd.
    Raises LmlabError for models the lens does not read (:func:`unembedding`), top_k outside
    1..V, or targets of the wrong shape or outside the vocabulary.
    """
    ids = _as_batch(ids)
    layers = _layers(model)
    unembed = unembedding(model)
    b, t = ids.shape
    hooks = ["layers.0.hook_resid_pre"] + [
        f"layers.{i}.hook_resid_post" for i in range(len(layers))
    ]
    with _eval(model):
        out, cache = run_with_cache(model, ids, hooks, **_forward_kwargs(model, key_mask))
        logits = out.logits  # (B, T, V)
        v = logits.shape[-1]
        if not 1 <= top_k <= v:
            raise LmlabError(f"top_k must be 1..{v} (the vocabulary), got {top_k}")
        target_ids = _targets(targets, (b, t), v, ids.device)
        tops: list[torch.Tensor] = []
        top_p: list[torch.Tensor] = []
        keep: list[torch.Tensor] = []
        t_probs: list[torch.Tensor] = []
        t_ranks: list[torch.Tensor] = []
        for i, name in enumerate(hooks):
            if i == len(hooks) - 1:
                row = logits  # the forward's own tensor: the same modules on the same input
            else:
                row = unembed(layers[max(i - 1, 0)].reduce_stream(cache[name]))  # (B, T, V)
            lp = F.log_softmax(row.float(), dim=-1)
            p, k = lp.topk(top_k, dim=-1)
            tops.append(k)
            top_p.append(p.exp())
            if keep_log_probs:
                keep.append(lp)
            if target_ids is not None:
                tl = lp.gather(-1, target_ids.unsqueeze(-1))  # (B, T, 1)
                t_probs.append(tl.squeeze(-1).exp())
                t_ranks.append((lp > tl).sum(-1) + 1)
    return LogitLens(
        hooks, torch.stack(tops, 1), torch.stack(top_p, 1), logits, _stack(keep), target_ids,
        _stack(t_probs), _stack(t_ranks),
    )  # fmt: skip


def _stack(rows: list[torch.Tensor]) -> torch.Tensor | None:
    """Per-row tensors (B, ...) -> (B, R, ...), None for none."""
    return torch.stack(rows, dim=1) if rows else None


def _targets(
    targets: torch.Tensor | int | None, shape: tuple[int, int], v: int, device: torch.device
) -> torch.Tensor | None:
    if targets is None:
        return None
    if isinstance(targets, int):
        out = torch.full(shape, targets, dtype=torch.long, device=device)
    else:
        out = _as_batch(targets.to(device))
        if tuple(out.shape) != shape:
            raise LmlabError(f"targets must be (B, T) = {shape}, got {tuple(out.shape)}")
    if bool((out < 0).any()) or bool((out >= v).any()):
        raise LmlabError(f"target token ids must be in 0..{v - 1} (the vocabulary)")
    return out


# ----------------------------------------------------------------------------- attribution


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
    Units: logits (nats of an unnormalised log-probability)."""

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

    Raises LmlabError for: an encoder or encoder-decoder (an encoder's MLM head is dense +
    activation + LayerNorm, not linear), post-norm / hybrid / hyper-connection blocks or
    ``block.residual: false`` (the final residual is not a sum of the components), an attention
    kind without ``hook_z``, a final norm other than RMSNorm / LayerNorm / none, ids of more
    than one sequence, a position out of range, token ids outside the vocabulary.
    """
    ids = _as_batch(ids)
    pos = _check_attributable(model, ids, target, versus, position)
    n_layers = len(_layers(model))
    names = ["hook_embed", "layers.0.hook_resid_pre", f"layers.{n_layers - 1}.hook_resid_post"]
    for i in range(n_layers):
        names += [f"layers.{i}.attn.hook_z", f"layers.{i}.ffn.hook_out"]
    with _eval(model):
        out, cache = run_with_cache(model, ids, names)
    with torch.no_grad():
        return _attribute(model, cache, out.logits[0, pos], pos, target, versus)


def _check_attributable(
    model: nn.Module, ids: torch.Tensor, target: int, versus: int | None, position: int
) -> int:
    """Refuse what direct_logit_attribution cannot decompose (its docstring lists it); returns
    the position counted from 0."""
    from lmlab.models.decoder import DecoderLM
    from lmlab.nn.block import PreNormBlock

    if ids.shape[0] != 1:
        raise LmlabError(f"direct logit attribution reads one sequence: ids (1, T), got "
                         f"{tuple(ids.shape)}")  # fmt: skip
    if not isinstance(model, DecoderLM):
        unembedding(model)  # the general refusal (encoder-decoder ...), else the encoder's
        raise LmlabError(
            "direct logit attribution needs a decoder: this encoder's masked-LM head (dense + "
            "activation + LayerNorm before the vocabulary) is not linear in the residual stream"
        )
    layers = _layers(model)
    cfg = model.cfg
    points = set(hook_names(model))
    for i, layer in enumerate(layers):
        if not isinstance(layer, PreNormBlock) or not layer.residual:
            raise LmlabError(
                f"direct logit attribution needs pre-norm blocks (model.block.kind=pre, "
                f"parallel or not) with residual connections; this model has "
                f"model.block.kind={cfg.block.kind} residual={cfg.block.residual}: a post-norm, "
                "hybrid or hyper-connection block normalises or mixes the stream inside its "
                "layers, so the final residual is not a sum of the components"
            )
        if f"layers.{i}.attn.hook_z" not in points:
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
    v = model.lm_head.weight.shape[0]
    for what, tok in (("target", target), ("versus", versus)):
        if tok is not None and not 0 <= tok < v:
            raise LmlabError(f"{what} token id {tok} is outside the vocabulary (0..{v - 1})")
    return pos


def _attribute(
    model: Any,
    cache: dict[str, torch.Tensor],
    logits: torch.Tensor,
    pos: int,
    target: int,
    versus: int | None,
) -> LogitAttribution:
    """The attribution from a clean run's cache (see direct_logit_attribution); logits (V,)."""
    layers, cfg = _layers(model), model.cfg
    n_layers = len(layers)
    f64, cpu = torch.float64, torch.device("cpu")  # one position: float64 on the CPU

    def at(name: str) -> torch.Tensor:  # (D,), or (H, hz) of hook_z, at the position, float64
        x = cache[name][0]
        return (x[:, pos] if name.endswith("hook_z") else x[pos]).to(cpu, f64)

    terms: list[tuple[str, torch.Tensor]] = [("embed", at("hook_embed"))]
    positions = at("layers.0.hook_resid_pre") - terms[0][1]
    if bool(positions.ne(0).any()):
        terms.append(("positions", positions))
    heads_idx: list[list[int]] = []
    bias_idx: list[int | None] = []
    ffn_idx: list[int] = []
    for i, layer in enumerate(layers):
        z = at(f"layers.{i}.attn.hook_z")  # (H, hz)
        w_o = layer.attn.o_proj.weight.to(cpu, f64)  # (D, H hz)
        n_h, hz = z.shape
        if w_o.shape[1] != n_h * hz:
            raise LmlabError(
                f"layer {i}: hook_z is {n_h} heads x {hz} but o_proj reads {w_o.shape[1]} "
                f"features (model.attention.kind={cfg.attention.kind})"
            )
        per_head = torch.einsum("dhz,hz->hd", w_o.view(-1, n_h, hz), z)  # (H, D)
        heads_idx.append(list(range(len(terms), len(terms) + n_h)))
        terms += [(f"L{i}H{h}", per_head[h]) for h in range(n_h)]
        if layer.attn.o_proj.bias is not None:
            bias_idx.append(len(terms))
            terms.append((f"L{i}.attn_bias", layer.attn.o_proj.bias.to(cpu, f64)))
        else:
            bias_idx.append(None)
        ffn_idx.append(len(terms))
        terms.append((f"L{i}.ffn", at(f"layers.{i}.ffn.hook_out")))
    resid = cache[f"layers.{n_layers - 1}.hook_resid_post"][0, pos].cpu()  # (D,) as computed
    stacked = torch.stack([c for _, c in terms])  # (C, D) float64
    _check_sum(stacked.sum(0), resid, len(terms), cfg.block.kind)
    linear, const, scale = frozen_norm(model.final_norm, resid)
    u = model.lm_head.weight[target].to(cpu, f64)  # (D,)
    if versus is not None:
        u = u - model.lm_head.weight[versus].to(cpu, f64)
    values = linear(stacked) @ u  # (C,)
    extra = [("final_norm.bias", float(const @ u))] if const is not None else []
    head_bias = getattr(model.lm_head, "bias", None)
    if head_bias is not None:
        hb = head_bias[target] - (head_bias[versus] if versus is not None else 0)
        extra.append(("lm_head.bias", float(hb)))
    all_names = [n for n, _ in terms] + [n for n, _ in extra]
    values = torch.cat([values, torch.tensor([x for _, x in extra], dtype=f64)])
    logits = logits.to(cpu, f64)
    actual = logits[target] - (logits[versus] if versus is not None else 0.0)
    zero = torch.zeros((), dtype=f64)
    return LogitAttribution(
        names=all_names,
        values=values,
        heads=torch.stack([values[idx] for idx in heads_idx]),
        attn_bias=torch.stack([values[j] if j is not None else zero for j in bias_idx]),
        ffn=values[ffn_idx],
        total=float(values.sum()),
        actual=float(actual),
        scale=scale,
        target=target,
        versus=versus,
        position=pos,
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
