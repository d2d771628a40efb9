"""The layer stack every model runs: N blocks in order, then the final norm, with the bookkeeping
of caches, hidden states and attention weights written once.

Legend: B batch, T tokens (new ones), S key tokens (cached + new), S_src source tokens, D d_model,
H heads. A :class:`LayerStack` is an :class:`torch.nn.ModuleList` of blocks (so its parameters
keep the names ``layers.{i}.attn.q_proj.weight`` ...), called like a block with a few extras.

Attention maps (a model forward's ``need_weights=True``) are not threaded through the blocks:
for that one call the stack records the hook points each attention names
(:meth:`~lmlab.nn.attention.Attention.map_points`: its ``hook_pattern``) with
:func:`~lmlab.nn.hooks.recording`, and the attention joins what they saw into its map
(:meth:`~lmlab.nn.attention.Attention.attention_map`). A pattern point with a function on it
makes its layer materialise the weights (the math formula), as ``need_weights`` always did.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from lmlab.errors import LmlabError
from lmlab.nn.hooks import HookPoint, recording
from lmlab.nn.kv_cache import EncoderDecoderCache, KVCache

if TYPE_CHECKING:
    from lmlab.nn.attention import Attention
    from lmlab.nn.position import PositionEncoding

MapPoints = tuple["Attention", tuple[HookPoint, ...]]  # an attention and its map's hook points


@dataclass
class StackOutput:
    """x (B, T, D): the output after the final norm; hidden_states: the residual stream entering
    each layer plus x (when asked for); attentions: per layer (B, H, T, S) self-attention weights
    and cross_attentions: per layer (B, H, T, S_src) (cross-attention stacks only), when
    ``need_weights`` (recorded from the layers' hook points, see the module docstring)."""

    x: torch.Tensor
    hidden_states: list[torch.Tensor] = field(default_factory=list)
    attentions: list[torch.Tensor | None] = field(default_factory=list)
    cross_attentions: list[torch.Tensor | None] = field(default_factory=list)


class LayerStack(nn.ModuleList):
    """Blocks applied in order. ``cross``: the blocks are decoder blocks of an encoder-decoder
    (:data:`~lmlab.nn.block.DECODER_BLOCK`: they also take the encoder output and return
    cross-attention weights); otherwise :data:`~lmlab.nn.block.BLOCK` blocks."""

    def __init__(self, layers: list[nn.Module], cross: bool = False) -> None:
        super().__init__(layers)
        self.cross = cross

    def forward(
        self,
        x: torch.Tensor,
        position: PositionEncoding,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None,
        cache: KVCache | None,
        need_weights: bool,
        output_hidden_states: bool,
        final_norm: Callable[[torch.Tensor], torch.Tensor],
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
    ) -> StackOutput:
        """x (B, T, D) at ``positions`` (T,) or (B, T) -> :class:`StackOutput`.

        ``key_mask`` (B, S) bool, True = real token (None: no padding); ``cache``: layer i reads
        and extends ``cache.layers[i]`` (and ``cache.cross[i]`` in a cross stack); ``memory``
        (B, S_src, D) and ``memory_mask`` (B, S_src) bool: the encoder output and its padding
        mask (cross stacks only). ``final_norm`` runs on the last layer's output. A block kind
        with a wider residual stream (hyper-connections: (B, T, n, D)) widens x before the first
        layer and narrows it back before the final norm and in ``hidden_states``
        (``expand_stream`` / ``reduce_stream``, the identity for the other kinds).

        ``need_weights``: also return each layer's attention map (and cross-attention map),
        recorded from its hook points for this call (module docstring); False records nothing.
        Raises LmlabError before any layer runs where a kind has no map for the call (nsa;
        linear attention over cached tokens)."""
        args = (x, position, positions, key_mask, cache, output_hidden_states, final_norm)
        if not need_weights:  # nothing registered, nothing recorded
            return self.run(*args, memory, memory_mask)
        own, cross = self.map_points(cache)
        with recording([p for _, points in own + cross for p in points]) as seen:
            out = self.run(*args, memory, memory_mask)
        recorded = iter(seen)
        out.attentions = [attention_map(attn, points, recorded) for attn, points in own]
        out.cross_attentions = [attention_map(attn, points, recorded) for attn, points in cross]
        return out

    def map_points(self, cache: KVCache | None) -> tuple[list[MapPoints], list[MapPoints]]:
        """Per layer, its self-attention and the hook points of its map for this call
        (:meth:`~lmlab.nn.attention.Attention.map_points` given the layer's cache), and the
        same for the cross-attention of a cross stack (else []). Raises what an attention
        raises for a call without a map."""
        cross_cache = cache.cross if isinstance(cache, EncoderDecoderCache) else None
        own: list[MapPoints] = []
        cross: list[MapPoints] = []
        for i, layer in enumerate(self):
            attn: Attention = layer.attn  # type: ignore[assignment]
            own.append((attn, attn.map_points(cache.layers[i] if cache is not None else None)))
            if self.cross:
                c: Attention = layer.cross_attn  # type: ignore[assignment]
                c_cache = cross_cache[i] if cross_cache is not None else None
                cross.append((c, c.map_points(c_cache)))  # type: ignore[arg-type]
        return own, cross

    def run(
        self,
        x: torch.Tensor,
        position: PositionEncoding,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None,
        cache: KVCache | None,
        output_hidden_states: bool,
        final_norm: Callable[[torch.Tensor], torch.Tensor],
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
    ) -> StackOutput:
        """The blocks in order (arguments as :meth:`forward`): the output and hidden states."""
        out = StackOutput(x)
        cross = cache.cross if isinstance(cache, EncoderDecoderCache) else None
        x = self[0].expand_stream(x)  # type: ignore[operator]  # the block kind's stream
        for i, layer in enumerate(self):
            x = layer.hook_resid_pre(x)  # type: ignore[operator]
            if output_hidden_states:
                out.hidden_states.append(layer.reduce_stream(x))  # type: ignore[operator]
            layer_cache = cache.layers[i] if cache is not None else None
            if self.cross:
                cross_cache = cross[i] if cross is not None else None
                x = layer(
                    x, position, positions, memory, memory_mask, key_mask, layer_cache,
                    cross_cache,
                )  # fmt: skip
            else:
                x = layer(x, position, positions, key_mask, layer_cache)
            x = layer.hook_resid_post(x)  # type: ignore[operator]
        out.x = final_norm(self[-1].reduce_stream(x))  # type: ignore[operator]
        if output_hidden_states:
            out.hidden_states.append(out.x)
        return out


def attention_map(
    attn: Attention, points: tuple[HookPoint, ...], recorded: Iterator[list[torch.Tensor]]
) -> torch.Tensor:
    """One layer's attention map from what its map ``points`` saw (the next entries of
    ``recorded``, one list per point): :meth:`~lmlab.nn.attention.Attention.attention_map`.
    Raises LmlabError when a point did not run exactly once in the pass."""
    tensors = []
    for point in points:
        seen = next(recorded)
        if len(seen) != 1:
            raise LmlabError(
                f"{point.name or 'hook_pattern'} ran {len(seen)} times in one forward pass; an "
                "attention map (need_weights=True) takes one pattern per map point"
            )
        tensors.append(seen[0])
    return attn.attention_map(tensors)


def padding_mask(
    mask: torch.Tensor | None, shape: tuple[int, int], name: str, dims: str
) -> torch.Tensor | None:
    """An attention mask (B, S) int or bool (1 = real token, 0 = padding) -> the bool key mask
    (True = real token), or None. Raises ValueError naming ``name`` and its expected ``dims``
    (e.g. "(B, T)") when its shape is not ``shape``."""
    if mask is None:
        return None
    if mask.shape != shape:
        raise ValueError(f"{name} must be {dims} = {shape}, got {tuple(mask.shape)}")
    return mask.bool()
