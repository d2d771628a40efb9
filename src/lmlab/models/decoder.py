"""Decoder-only language model (GPT): embed -> N blocks -> final norm -> LM head.

Legend: B batch, T tokens, D d_model, V vocab_size. Every component comes from its registry
(position, block -> attention/norm/ffn), so this file only wires them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.config import ModelConfig
from lmlab.errors import LmlabError
from lmlab.models.counting import matmul_params, num_params, score_flops
from lmlab.models.init import init_weights
from lmlab.models.output import ModelOutput
from lmlab.models.stack import LayerStack, padding_mask
from lmlab.models.tying import TiedEmbeddingsModule
from lmlab.nn.block import BLOCK
from lmlab.nn.fused import linear
from lmlab.nn.hooks import HookPoint, fast_hook_lookup
from lmlab.nn.kv_cache import KVCache
from lmlab.nn.moe import MoE, moe_losses
from lmlab.nn.norm import build_norm
from lmlab.nn.position import POSITION


class DecoderLM(TiedEmbeddingsModule):
    """A causal Transformer language model (Radford et al. 2018/2019, GPT)."""

    examples: tuple[dict, ...] = ({}, {"tie_embeddings": False})

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.vocab_size is None:
            raise LmlabError("model.vocab_size is not set (it normally comes from the tokenizer)")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_scale = cfg.embed_scale  # sqrt(d_model) or 1 (model.scale_embedding)
        self.position = POSITION.get(cfg.position.kind, "model.position.kind")(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        block_cls = BLOCK.get(cfg.block.kind, "model.block.kind")
        self.layers = LayerStack([block_cls(cfg, i) for i in range(cfg.n_layers)])
        self.final_norm = build_norm(cfg) if cfg.final_norm else nn.Identity()
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # hook points (lmlab.hooks) of the model's ends; the layers hold their own
        self.hook_embed = HookPoint()  # (B, T, D) token embedding (x embed_scale)
        self.hook_final_norm = HookPoint()  # (B, T, D) the final norm's output
        self.hook_logits = HookPoint()  # (B, T, V) (or (B, 1, V) with last_only)
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.tie_embeddings()  # lm_head.weight is embed.weight, through every load too
        self.has_moe = any(isinstance(m, MoE) for m in self.modules())  # routing losses to take
        fast_hook_lookup(self)  # hook points named, one dict lookup each

    def reset_parameters(self) -> None:
        """Initialise every weight with the scheme named by ``model.init``, residual projections
        zeroed under ``model.init_zero_residual`` (:func:`lmlab.models.init.init_weights`)."""
        init_weights(self, self.cfg)

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
        need_weights: bool = False,
        output_hidden_states: bool = False,
        last_only: bool = False,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> ModelOutput:
        """input_ids (B, T) int64 -> ModelOutput with logits (B, T, V) (or (B, 1, V) if
        ``last_only``).

        targets (B, T) int64: next-token ids; -100 is ignored. The loss is the mean cross-entropy
        in nats/token, computed in float32. ``cache``: a :class:`KVCache` from
        :meth:`new_cache`; the new tokens sit at positions cache.seq_len .. cache.seq_len + T - 1.

        attention_mask (B, cache.seq_len + T) int or bool, 1 = real token, 0 = padding (the
        Hugging Face convention: it covers the cached tokens too): padding keys are never
        attended to and a padding query's attention outputs 0 (never NaN). position_ids (B, T)
        int64: each token's position; None gives cache.seq_len .. cache.seq_len + T - 1 for every
        row, as the Hugging Face forward does, so a left-padded batch needs
        :func:`lmlab.nn.masks.position_ids_from_attention_mask` to match each sequence alone.
        Raises ValueError for a mask or position_ids of the wrong shape.
        """
        b, t = input_ids.shape
        past = cache.seq_len if cache is not None else 0
        if position_ids is None:
            positions = self.arange_positions(past, t, input_ids.device)  # (T,)
        elif position_ids.shape != (b, t):
            shape = tuple(position_ids.shape)
            raise ValueError(f"position_ids must be (B, T) = {(b, t)}, got {shape}")
        else:
            positions = position_ids  # (B, T)
        dims = "(B, cached + new tokens)"
        key_mask = padding_mask(attention_mask, (b, past + t), "attention_mask", dims)  # (B, S)
        x = self.embed(input_ids)  # (B, T, D)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        x = self.position.embed(self.hook_embed(x), positions)
        x = self.drop(x)
        out = self.layers(
            x, self.position, positions, key_mask, cache, need_weights, output_hidden_states,
            self.normed,
        )  # fmt: skip
        x = out.x
        if last_only:
            x = x[:, -1:, :]
        logits = self.hook_logits(linear(self.lm_head, x))  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100
            )
        aux_loss: torch.Tensor | None = None
        expert_counts: list[torch.Tensor] = []
        if self.has_moe:  # padding (attention_mask 0) counts in neither auxiliary loss
            token_mask = None if attention_mask is None else attention_mask[:, past:]  # (B, T)
            aux_loss, expert_counts = moe_losses(self.layers, token_mask)
        return ModelOutput(
            logits, loss, cache, out.hidden_states, out.attentions, aux_loss, expert_counts
        )

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm of the last layer's output (B, T, D), through ``hook_final_norm``."""
        return self.hook_final_norm(self.final_norm(x))

    def arange_positions(self, past: int, t: int, device: torch.device) -> torch.Tensor:
        """torch.arange(past, past + t) int64 (T,) on ``device``: the same tensor object as the
        last call's while (past, t, device) and its values (version counter) are unchanged, so
        a position encoding that keeps its tables for the positions tensor it last saw (RoPE's
        cos / sin, :meth:`lmlab.nn.position.RotaryPosition.rotation`) reuses them from one
        training step to the next instead of recomputing them every forward. A new tensor under
        inference mode (no version counter) and torch.compile."""
        if torch.is_inference_mode_enabled() or torch.compiler.is_compiling():
            return torch.arange(past, past + t, device=device)
        memo = self.__dict__.get("_positions_memo")
        if memo is not None and memo[0] == (past, t, device) and memo[1]._version == memo[2]:
            return memo[1]
        positions = torch.arange(past, past + t, device=device)
        self.__dict__["_positions_memo"] = ((past, t, device), positions, positions._version)
        return positions

    def new_cache(self) -> KVCache:
        """An empty cache with one slot per layer, of the kind each attention needs: dynamic,
        sliding-window (bounded) or linear attention's recurrent state."""
        attns = [layer.attn for layer in self.layers]
        return KVCache([attn.new_cache() for attn in attns])  # type: ignore[union-attr,operator]

    def num_params(self, non_embedding: bool = False) -> int:
        """Distinct parameters (tied weights counted once); ``non_embedding`` leaves out the
        token embedding (and a tied LM head, which is the same matrix)."""
        return num_params(self, non_embedding)

    # ------------------------------------------------------------------ what it costs
    flops_convention = (
        "per token of a seq_len-token sequence: 2 N + 4 L T d_attn; training = 3 x forward"
    )

    def cache_attention(self) -> list[nn.Module]:
        """The attention modules whose decoding state :meth:`new_cache` holds: every layer's."""
        return [layer.attn for layer in self.layers]  # type: ignore[misc]

    def matmul_params(self) -> int:
        """N of the FLOP count: every nn.Linear weight a token meets, the LM head counted even
        when tied (of an MoE layer the router, top_k and shared experts)."""
        return matmul_params(self)

    def flops_per_token(self, seq_len: int, train: bool = False, mask_prob: float = 0.15) -> int:
        """FLOPs per token of a ``seq_len``-token forward pass, 2 N + the score FLOPs each
        attention declares (4 L T d_attn for softmax; Kaplan et al. 2020, PaLM); ``train``:
        3 x forward. ``mask_prob`` is unused (a causal LM scores every position)."""
        fwd = 2 * self.matmul_params() + score_flops(self.cache_attention(), self.cfg, seq_len)
        return 3 * fwd if train else fwd
