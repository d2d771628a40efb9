"""The logit lens and direct logit attribution: what the residual stream predicts at each layer,
and how much each head and FFN writes into one logit.

Legend: B batch, T tokens, D d_model, V vocab, L layers, H heads (the head axis of ``hook_z``:
H/2 for differential attention), k top tokens, C components.

Both read the model only through :mod:`lmlab.hooks` (``run_with_cache``) and unembed with the
model's own modules (its ``final_norm`` and LM head; an encoder's MLM head), never a copy.
The logit lens is here; the attribution is :mod:`lmlab.analysis.lens_attribution` (importable
from here too), which shares this module's pieces (which stream, how it is run, unembedded).

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
- **Encoder-decoders** (T5, BART): both read the DECODER's stream (hook names
  ``decoder.layers.{i}...``), run against a source (``source_ids``, the encoder input), and
  unembed through the decoder's final norm and the model's head as its forward does (T5's
  d_model**-0.5 output rescale, BART's final_logits_bias). A pre-norm decoder layer adds three
  sublayers, so the attribution has self-attention heads, cross-attention heads (which carry
  everything the source contributes: the encoder is not decomposed) and FFNs.
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
from lmlab.hooks import run_with_cache

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


def _encdec(model: nn.Module) -> bool:
    from lmlab.models.encoder_decoder import EncoderDecoderLM

    return isinstance(model, EncoderDecoderLM)


def _prefix(model: nn.Module) -> str:
    """Where the unembedded stream's hook names live: ``decoder.`` in an encoder-decoder."""
    return "decoder." if _encdec(model) else ""


def unembedding(model: nn.Module) -> Unembed:
    """The model's own map from a residual (..., D) to logits (..., V): a decoder's
    ``lm_head(final_norm(x))``, an encoder's ``mlm(final_norm(x))`` (dense + activation +
    LayerNorm + the vocabulary projection), an encoder-decoder's
    ``lm_head(decoder.final_norm(x) * output_scale) + final_logits_bias`` (its forward's own
    steps: T5's d_model**-0.5 rescale, BART's fixed logit offset, when configured). Raises
    LmlabError for an encoder without an MLM head and for any other model."""
    from lmlab.models.decoder import DecoderLM
    from lmlab.models.encoder import EncoderLM

    if isinstance(model, DecoderLM):
        return lambda x: model.lm_head(model.final_norm(x))
    if _encdec(model):
        m: Any = model

        def encdec(x: torch.Tensor) -> torch.Tensor:
            logits = m.lm_head(m.decoder.final_norm(x) * m.output_scale)
            return logits if m.final_logits_bias is None else logits + m.final_logits_bias

        return encdec
    if isinstance(model, EncoderLM):
        if model.lm_head is None:
            raise LmlabError(
                "this encoder has no masked-LM head (model.mlm_head=false): no vocabulary to "
                "unembed the residual stream into"
            )
        return lambda x: model.mlm(model.final_norm(x))
    raise LmlabError(
        f"the logit lens reads decoder (GPT), encoder (BERT, with an MLM head) and "
        f"encoder-decoder models; this is model.kind={_kind(model)}"
    )


def _layers(model: nn.Module) -> Any:
    """The layers whose stream is unembedded (an encoder-decoder's: the decoder's)."""
    layers = getattr(model.decoder if _encdec(model) else model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise LmlabError(f"model.kind={_kind(model)} has no layer stack (model.layers)")
    return layers


def _forward_kwargs(model: nn.Module, key_mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """attention_mask (and a decoder's positions counted over real tokens) of a padded batch;
    an encoder-decoder's is its decoder_attention_mask."""
    if key_mask is None:
        return {}
    if _encdec(model):
        return {"decoder_attention_mask": key_mask}
    from lmlab.models.decoder import DecoderLM
    from lmlab.nn.masks import position_ids_from_attention_mask

    kwargs = {"attention_mask": key_mask}
    if isinstance(model, DecoderLM):  # left padding: each row's positions as if alone
        kwargs["position_ids"] = position_ids_from_attention_mask(key_mask)
    return kwargs


def _run(
    model: nn.Module,
    ids: torch.Tensor,
    names: list[str],
    key_mask: torch.Tensor | None,
    source: tuple[torch.Tensor, torch.Tensor | None] | None,
) -> tuple[Any, dict[str, torch.Tensor]]:
    """run_with_cache of ``ids`` (an encoder-decoder's decoder input, read against ``source``
    = (source ids, source mask) from :func:`_source`)."""
    kwargs: dict[str, Any] = _forward_kwargs(model, key_mask)
    if source is None:
        return run_with_cache(model, ids, names, **kwargs)
    src, src_mask = source
    return run_with_cache(model, None, names, input_ids=src, attention_mask=src_mask,
                          decoder_input_ids=ids, **kwargs)  # fmt: skip


def _source(
    model: nn.Module,
    ids: torch.Tensor,
    source_ids: torch.Tensor | None,
    source_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The encoder input of an encoder-decoder, checked: (source ids (B, S) int64 with the batch
    of ``ids``, mask (B, S) or None); None for the other kinds. Raises LmlabError for a source
    missing (encoder-decoder) or given (any other kind), or of the wrong shape."""
    if not _encdec(model):
        if source_ids is not None or source_mask is not None:
            raise LmlabError(
                f"source_ids (an encoder input) go with an encoder-decoder; this model is "
                f"model.kind={_kind(model)}, which reads ids alone"
            )
        return None
    if source_ids is None:
        raise LmlabError(
            "model.kind=encoder_decoder: give source_ids (B, S), the encoder's input; ids are "
            "the decoder's input (starting with model.seq2seq.decoder_start_token_id)"
        )
    src = _as_batch(source_ids).to(ids.device)
    if src.shape[0] != ids.shape[0]:
        raise LmlabError(f"source_ids have {src.shape[0]} rows but ids have {ids.shape[0]}")
    if source_mask is not None and tuple(source_mask.shape) != tuple(src.shape):
        raise LmlabError(f"source_mask must be (B, S) = {tuple(src.shape)}, got "
                         f"{tuple(source_mask.shape)}")  # fmt: skip
    return src, (None if source_mask is None else source_mask.to(ids.device))


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
    source_ids: torch.Tensor | None = None,
    source_mask: torch.Tensor | None = None,
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

    An encoder-decoder: ``ids`` are the DECODER's input (as in training: the decoder start
    token, then the target so far), ``source_ids`` (B, S) int64 the encoder's, ``source_mask``
    (B, S) its padding (1 = real token); the rows are the decoder's (``decoder.layers.0.
    hook_resid_pre``, ``decoder.layers.{i}.hook_resid_post``), unembedded as its forward does.
    Raises LmlabError for models the lens does not read (:func:`unembedding`), top_k outside
    1..V, targets of the wrong shape or outside the vocabulary, a source missing for an
    encoder-decoder or given to another kind.
    """
    ids = _as_batch(ids)
    layers = _layers(model)
    unembed = unembedding(model)
    source = _source(model, ids, source_ids, source_mask)
    b, t = ids.shape
    pre = _prefix(model)
    hooks = [f"{pre}layers.0.hook_resid_pre"] + [
        f"{pre}layers.{i}.hook_resid_post" for i in range(len(layers))
    ]
    with _eval(model):
        out, cache = _run(model, ids, hooks, key_mask, source)
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


def __getattr__(name: str) -> Any:
    """``LogitAttribution``, ``direct_logit_attribution`` and ``frozen_norm`` live in
    :mod:`lmlab.analysis.lens_attribution`; importing them from here keeps working (PEP 562)."""
    if name in ("LogitAttribution", "direct_logit_attribution", "frozen_norm"):
        from lmlab.analysis import lens_attribution

        return getattr(lens_attribution, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
