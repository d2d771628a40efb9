"""The layer stack every model runs: N blocks in order, then the final norm, with the bookkeeping
of caches, hidden states and attention weights written once.

Legend: B batch, T tokens (new ones), S key tokens (cached + new), S_src source tokens, D d_model,
H heads. A :class:`LayerStack` is an :class:`torch.nn.ModuleList` of blocks (so its parameters
keep the names ``layers.{i}.attn.q_proj.weight`` ...), called like a block with a few extras.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from lmlab.nn.kv_cache import EncoderDecoderCache, KVCache

if TYPE_CHECKING:
    from lmlab.nn.position import PositionEncoding


@dataclass
class StackOutput:
    """x (B, T, D): the output after the final norm; hidden_states: the residual stream entering
    each layer plus x (when asked for); attentions: per layer (B, H, T, S) self-attention weights
    and cross_attentions: per layer (B, H, T, S_src) (cross-attention stacks only), when
    ``need_weights``."""

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
        (``expand_stream`` / ``reduce_stream``, the identity for the other kinds)."""
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
                x, w, c = layer(
                    x, position, positions, memory, memory_mask, key_mask, layer_cache,
                    cross_cache, need_weights,
                )  # fmt: skip
                if need_weights:
                    out.cross_attentions.append(c)
            else:
                x, w = layer(x, position, positions, key_mask, layer_cache, need_weights)
            x = layer.hook_resid_post(x)  # type: ignore[operator]
            if need_weights:
                out.attentions.append(w)
        out.x = final_norm(self[-1].reduce_stream(x))  # type: ignore[operator]
        if output_hidden_states:
            out.hidden_states.append(out.x)
        return out


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
