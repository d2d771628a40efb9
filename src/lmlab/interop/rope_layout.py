"""RoPE channel layouts, and converting q/k projection rows between them, in one place.

Legend: H heads (query heads for q, key/value heads for k), hd head_dim, r rotary channels
(hd * partial_rotary_factor), D d_model (input features of the projection).

RoPE rotates channel pairs; two layouts pair them differently (``model.position.interleaved``):

- half-split (GPT-NeoX, Hugging Face Llama, lmlab's default): pair i is channels (i, i + r/2);
- interleaved (RoFormer, GPT-J, Meta's original Llama, llama.cpp): pair i is channels (2i, 2i + 1).

Attention scores depend only on which channels form a pair, so a model in one layout equals the
model in the other once the rows of every head of the q and k projections (weight (H*hd, D),
bias (H*hd,)) are reordered. Channels r..hd-1 (partial rotary) are not rotated and stay in place.

GGUF: llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) stores a Hugging
Face Llama's half-split q/k weights in the interleaved order its kernels use, per head, with the
key/value head count for k. :func:`gguf_permute` is that conversion, :func:`gguf_unpermute` undoes
it when a GGUF file is read into lmlab's half-split layout.
"""

from __future__ import annotations

import torch

from lmlab.errors import LmlabError


def half_split_to_interleaved_order(hd: int, rotary_dim: int | None = None) -> torch.Tensor:
    """(hd,) int64 channel order: ``new = old[order]`` takes half-split channel pairs
    (i, i + r/2) to interleaved pairs (2i, 2i + 1); channels r..hd-1 stay where they are."""
    r = hd if rotary_dim is None else rotary_dim
    if r % 2 or not 0 < r <= hd:
        raise LmlabError(f"rotary channels must be even and in 1..{hd}, got {r}")
    order = torch.arange(hd)
    order[0:r:2] = torch.arange(r // 2)
    order[1:r:2] = torch.arange(r // 2) + r // 2
    return order


def interleaved_to_half_split_order(hd: int, rotary_dim: int | None = None) -> torch.Tensor:
    """(hd,) int64: the inverse of :func:`half_split_to_interleaved_order`."""
    return torch.argsort(half_split_to_interleaved_order(hd, rotary_dim))


def reorder_head_rows(w: torch.Tensor, n_heads: int, order: torch.Tensor) -> torch.Tensor:
    """Reorder the rows of each head of a q or k projection: weight (H*hd, D) or bias (H*hd,)
    -> same shape, row ``h*hd + j`` taken from ``h*hd + order[j]``.

    Raises LmlabError if the first dimension is not ``n_heads * len(order)``.
    """
    hd = len(order)
    if w.shape[0] != n_heads * hd:
        raise LmlabError(
            f"a q/k projection of {n_heads} heads x {hd} channels needs {n_heads * hd} rows, "
            f"got shape {tuple(w.shape)}"
        )
    heads = w.reshape(n_heads, hd, *w.shape[1:])  # (H, hd, D) or (H, hd)
    return heads[:, order].reshape(w.shape).contiguous()


def half_split_to_interleaved(
    w: torch.Tensor, n_heads: int, rotary_dim: int | None = None
) -> torch.Tensor:
    """q/k rows (H*hd, D) or (H*hd,) of a half-split model -> those of the equal interleaved one."""
    hd = w.shape[0] // n_heads
    return reorder_head_rows(w, n_heads, half_split_to_interleaved_order(hd, rotary_dim))


def interleaved_to_half_split(
    w: torch.Tensor, n_heads: int, rotary_dim: int | None = None
) -> torch.Tensor:
    """q/k rows of an interleaved model -> those of the equal half-split one (the inverse of
    :func:`half_split_to_interleaved`)."""
    hd = w.shape[0] // n_heads
    return reorder_head_rows(w, n_heads, interleaved_to_half_split_order(hd, rotary_dim))


def gguf_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """A Hugging Face Llama q or k weight (H*hd, D) -> the row order llama.cpp's converter writes
    to GGUF (``attn_q``/``attn_k``); ``n_heads`` is the query head count for q and the key/value
    head count for k. Full rotary (Llama rotates every channel)."""
    return half_split_to_interleaved(w, n_heads)


def gguf_unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """A GGUF ``attn_q``/``attn_k`` tensor (H*hd, D) -> half-split rows (Hugging Face and lmlab);
    the inverse of :func:`gguf_permute`."""
    return interleaved_to_half_split(w, n_heads)
