"""Per-layer state for incremental decoding, and the model-level cache holding one per layer.

Legend: B batch, K kv heads, S cached tokens, T new tokens, hd head_dim. Keys are stored *after*
the positional rotation (RoPE), so cached decoding reproduces the full forward pass exactly.

- :class:`LayerKVCache`: dynamic, grows by concatenation (softmax attention, causal masks);
- :class:`SlidingWindowKVCache`: keeps only the last ``window - 1`` keys/values, so its memory is
  bounded (softmax attention with a sliding-window mask);
- :class:`LinearAttentionState`: the recurrent state of linear attention, of constant size.

Every layer cache reports ``seq_len`` (tokens seen so far, i.e. the absolute position of the
next token) and ``nbytes()`` (memory held, in bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class LayerCache(Protocol):
    """What every per-layer cache offers the model."""

    @property
    def seq_len(self) -> int: ...

    def nbytes(self) -> int: ...


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class LayerKVCache:
    """The keys and values one attention layer has seen so far, ``k`` and ``v`` each
    (B, K, S, hd).

    With gradients off (decoding) they are views of the first S slots of pre-allocated buffers
    (B, K, capacity, hd): a new token is written in place into the next free slot, and the
    buffers double when full, so a step copies one token, not the whole cache (``torch.cat``
    per token, which the grad-enabled path still uses, copies all S). What is attended to is the
    same either way; ``nbytes`` counts the S filled slots, ``reserved_bytes`` the buffers. Two
    caches must not share buffers: to fork a decode, start the copy from ``k.clone()``.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self._kbuf: torch.Tensor | None = None  # (B, K, capacity, hd), self.k its [:, :, :S]
        self._vbuf: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new keys/values (B, K, T, hd); return all of them, (B, K, S + T, hd)."""
        if self.k is None or self.v is None:
            self.k, self.v = k, v
        elif torch.is_grad_enabled() or torch.compiler.is_compiling() or not self._fits(k, v):
            self.k = torch.cat([self.k, k], dim=2)
            self.v = torch.cat([self.v, v], dim=2)
            self._kbuf = self._vbuf = None
        else:
            s, t = self.k.shape[2], k.shape[2]
            kbuf, vbuf = self._buffers(s + t)
            kbuf[:, :, s : s + t] = k
            vbuf[:, :, s : s + t] = v
            self.k, self.v = kbuf[:, :, : s + t], vbuf[:, :, : s + t]
        return self.k, self.v

    def _fits(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether the new k, v (B, K, T, hd) match the cached ones in every dim but T, dtype
        and device (so writing them into a buffer is exactly what ``torch.cat`` would give)."""
        ck, cv = self.k, self.v
        assert ck is not None and cv is not None
        return all(
            a.dtype == b.dtype and a.device == b.device and a.dim() == 4 == b.dim()
            and a.shape[:2] == b.shape[:2] and a.shape[3] == b.shape[3]
            for a, b in ((ck, k), (cv, v))
        )  # fmt: skip

    def reserve(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Make the key and value buffers hold at least ``capacity`` tokens, allocated once to
        that size when they are smaller (instead of doubling as they fill), and return them,
        (B, K, >= capacity, hd) each, the S cached tokens in their first slots: the lean decode
        step (:mod:`lmlab.generation.lean_step`) writes each new token in place into them.
        Needs a non-empty cache (ValueError otherwise)."""
        if self.k is None or self.v is None:
            raise ValueError("reserve needs the cache to hold at least one token")
        kb, vb = self._buffers(capacity, exact=True)
        s = self.k.shape[2]
        self.k, self.v = kb[:, :, :s], vb[:, :, :s]
        return kb, vb

    def _buffers(self, needed: int, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers, holding the S cached tokens in their first slots, with
        room for ``needed`` tokens: the current ones if ``k``/``v`` are still their views and
        they are big enough, else new ones of twice ``needed`` slots (``exact``: ``needed``
        slots) with the tokens copied."""
        ck, cv = self.k, self.v
        kb, vb = self._kbuf, self._vbuf
        assert ck is not None and cv is not None
        if (
            kb is not None
            and vb is not None
            and kb.shape[2] >= needed
            and ck.shape[:2] == kb.shape[:2]
            and ck.data_ptr() == kb.data_ptr()  # k, v not replaced from outside
            and cv.data_ptr() == vb.data_ptr()
            and ck.stride() == kb.stride()
            and cv.stride() == vb.stride()
        ):
            return kb, vb
        s = ck.shape[2]
        cap = max(needed, s) if exact else 2 * needed
        kb = ck.new_empty(ck.shape[0], ck.shape[1], cap, ck.shape[3])
        vb = cv.new_empty(cv.shape[0], cv.shape[1], cap, cv.shape[3])
        kb[:, :, :s] = ck
        vb[:, :, :s] = cv
        self._kbuf, self._vbuf = kb, vb
        return kb, vb

    def reserved_bytes(self) -> int:
        """Memory allocated for keys and values, in bytes: the buffers (filled or not), or the
        cached tensors when there are none."""
        if self._kbuf is not None and self._vbuf is not None:
            return _nbytes(self._kbuf, self._vbuf)
        return self.nbytes()

    @property
    def seq_len(self) -> int:
        return 0 if self.k is None else int(self.k.shape[2])

    def nbytes(self) -> int:
        """Memory held by the cached keys and values, in bytes."""
        return _nbytes(self.k, self.v)


class SlidingWindowKVCache:
    """Keys and values of the last ``window - 1`` tokens only, each (B, K, <= window - 1, hd).

    A query at position p attends to positions p - window + 1 .. p, so the earliest new query
    needs exactly the ``window - 1`` tokens before it: nothing older is ever read again, and the
    memory stays bounded however long decoding runs (Jiang et al. 2023, Mistral's rolling
    buffer cache). :meth:`update` returns the kept tokens followed by the new ones, so the
    attention mask is built over S = kept + T keys with the queries last.
    """

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"a sliding-window cache needs window >= 1, got {window}")
        self.window = window
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.seen = 0

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add new keys/values (B, K, T, hd); return the kept and the new ones, (B, K, S, hd)
        with S = min(seen, window - 1) + T, then drop all but the last ``window - 1``."""
        self.seen += k.shape[2]
        if self.k is not None and self.v is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        start = max(0, k.shape[2] - (self.window - 1))
        # clone: a slice would keep the whole concatenated storage alive
        self.k, self.v = k[:, :, start:].clone(), v[:, :, start:].clone()
        return k, v

    @property
    def seq_len(self) -> int:
        """Tokens seen so far (not the number kept)."""
        return self.seen

    @property
    def kept(self) -> int:
        """Tokens whose keys/values are held, at most ``window - 1``."""
        return 0 if self.k is None else int(self.k.shape[2])

    def nbytes(self) -> int:
        """Memory held by the kept keys and values, in bytes."""
        return _nbytes(self.k, self.v)


class LinearAttentionState:
    """The recurrent state of causal linear attention (Katharopoulos et al. 2020, eq. 10-12):

    ``state = sum_j phi(k_j) v_j^T`` (B, K, hd, hd) and ``normalizer = sum_j phi(k_j)`` (B, K, hd),
    summed over the tokens seen so far. Its size does not grow with the sequence.
    """

    def __init__(self) -> None:
        self.state: torch.Tensor | None = None
        self.normalizer: torch.Tensor | None = None
        self.seen = 0

    def update(self, phi_k: torch.Tensor, v: torch.Tensor) -> None:
        """Add new feature-mapped keys phi_k (B, K, T, hd) and values v (B, K, T, hd) (padding
        keys already zeroed)."""
        s = torch.einsum("bktd,bkte->bkde", phi_k, v)
        z = phi_k.sum(dim=2)
        if self.state is None or self.normalizer is None:
            self.state, self.normalizer = s, z
        else:
            self.state, self.normalizer = self.state + s, self.normalizer + z
        self.seen += phi_k.shape[2]

    @property
    def seq_len(self) -> int:
        return self.seen

    def nbytes(self) -> int:
        """Memory held by the state and the normalizer, in bytes."""
        return _nbytes(self.state, self.normalizer)


class KVCache:
    """The model-level cache: one layer cache per layer.

    ``KVCache(n_layers)`` holds dynamic :class:`LayerKVCache` s; ``KVCache(layers)`` takes the
    layer caches the attention modules made (``DecoderLM.new_cache`` does this, so a
    sliding-window or linear-attention model gets its own kind).
    """

    def __init__(self, layers: int | Sequence[LayerCache]) -> None:
        self.layers: list = (
            [LayerKVCache() for _ in range(layers)] if isinstance(layers, int) else list(layers)
        )

    @property
    def seq_len(self) -> int:
        """Tokens cached so far (the absolute position of the next token)."""
        return self.layers[0].seq_len if self.layers else 0

    def nbytes(self) -> int:
        """Memory held by all layers' caches, in bytes."""
        return sum(layer.nbytes() for layer in self.layers)


class CrossAttentionCache:
    """One cross-attention layer's keys and values of the encoder output, each (B, K, S_src, hd).

    Computed once, on the first decoding step, and read unchanged by every later step: the
    encoder output does not change while the decoder generates (Vaswani et al. 2017, sec. 3.2.3).
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def filled(self) -> bool:
        return self.k is not None

    def set(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the projected encoder output (B, K, S_src, hd); raises RuntimeError if filled."""
        if self.filled:
            raise RuntimeError("a cross-attention cache is filled once per source batch")
        self.k, self.v = k, v

    def nbytes(self) -> int:
        """Memory held by the cached keys and values, in bytes."""
        return _nbytes(self.k, self.v)


class EncoderDecoderCache(KVCache):
    """An encoder-decoder model's decoding state: ``layers`` (the decoder self-attention caches,
    as in :class:`KVCache`), ``cross`` (one :class:`CrossAttentionCache` per decoder layer) and
    ``source_mask`` (B, S_src) bool, True = real source token, stored with the cross cache so
    later steps need only the new decoder tokens.

    ``seq_len`` counts decoder tokens; ``nbytes`` covers both kinds of cache.
    """

    def __init__(self, layers: int | Sequence[LayerCache]) -> None:
        super().__init__(layers)
        self.cross = [CrossAttentionCache() for _ in self.layers]
        self.source_mask: torch.Tensor | None = None

    @property
    def cross_filled(self) -> bool:
        """Whether the encoder output's keys and values are cached (every layer at once)."""
        return bool(self.cross) and all(c.filled for c in self.cross)

    def nbytes(self) -> int:
        return super().nbytes() + sum(c.nbytes() for c in self.cross)
