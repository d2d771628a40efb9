"""Encoder-only Transformer (BERT): embeddings -> N bidirectional blocks -> pooler and MLM head.

Legend: B batch, T tokens, D d_model, V vocab_size. Embeddings are token + position (any
registered kind; BERT: learned) + token type (segment), then LayerNorm and dropout (Devlin et al.
2019). Blocks come from the block registry (BERT: post-norm) with ``attention.mask``
bidirectional and a key padding mask. The pooler is dense + tanh on the first token ([CLS]); the
masked-LM head is dense + activation + LayerNorm, then a projection onto the vocabulary that
shares the token-embedding matrix, plus a bias.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.checks import positive
from lmlab.config import ModelConfig
from lmlab.errors import ConfigError, LmlabError
from lmlab.models.counting import matmul_params, num_params, score_flops
from lmlab.models.init import init_weights
from lmlab.models.output import ModelOutput
from lmlab.models.stack import LayerStack
from lmlab.models.tying import TiedEmbeddingsModule
from lmlab.nn.block import BLOCK
from lmlab.nn.ffn import ACTIVATIONS
from lmlab.nn.fused import linear
from lmlab.nn.hooks import HookPoint, fast_hook_lookup
from lmlab.nn.norm import build_norm
from lmlab.nn.position import POSITION


class EncoderLM(TiedEmbeddingsModule):
    """A bidirectional Transformer encoder with a masked-LM head (Devlin et al. 2019, BERT)."""

    # segment (token-type) embeddings, 0 for none; the pooler (dense + tanh on the first
    # token); the masked-LM head over the vocabulary
    options = ("type_vocab_size", "pooler", "mlm_head")

    @staticmethod
    def check(m: ModelConfig) -> None:
        """type_vocab_size >= 0; bidirectional attention."""
        positive(m.type_vocab_size, "model.type_vocab_size", allow_zero=True)
        if m.attention.mask != "bidirectional":
            raise ConfigError(
                "model.kind=encoder needs model.attention.mask=bidirectional (every token sees "
                f"the whole sequence), got {m.attention.mask!r}"
            )

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.vocab_size is None:
            raise LmlabError("model.vocab_size is not set (it normally comes from the tokenizer)")
        self.cfg = cfg
        d = cfg.d_model
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.embed_scale = cfg.embed_scale  # sqrt(d_model) or 1 (model.scale_embedding)
        self.position = POSITION.get(cfg.position.kind, "model.position.kind")(cfg)
        self.token_type = nn.Embedding(cfg.type_vocab_size, d) if cfg.type_vocab_size else None
        self.embed_norm = build_norm(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        block_cls = BLOCK.get(cfg.block.kind, "model.block.kind")
        self.layers = LayerStack([block_cls(cfg, i) for i in range(cfg.n_layers)])
        # A post-norm block already ends in a norm; the others end on the residual stream.
        post = cfg.block.kind == "post"
        self.final_norm = build_norm(cfg) if cfg.final_norm and not post else nn.Identity()
        self.pooler = nn.Linear(d, d) if cfg.pooler else None
        self.mlm_dense = nn.Linear(d, d) if cfg.mlm_head else None
        self.mlm_act = ACTIVATIONS.get(cfg.ffn.activation, "model.ffn.activation")
        self.mlm_norm = build_norm(cfg) if cfg.mlm_head else None
        self.lm_head = nn.Linear(d, cfg.vocab_size) if cfg.mlm_head else None
        # hook points (lmlab.hooks) of the model's ends; the layers hold their own
        self.hook_embed = HookPoint()  # (B, T, D) token embedding (x embed_scale)
        self.hook_final_norm = HookPoint()  # (B, T, D) the final norm's output
        self.hook_logits = HookPoint()  # (B, T, V) or (M, V) with targets; MLM head only
        self.reset_parameters()
        if self.lm_head is not None and cfg.tie_embeddings:
            self.tie_embeddings()  # lm_head.weight is embed.weight, through every load too
        fast_hook_lookup(self)  # hook points named, one dict lookup each

    def reset_parameters(self) -> None:
        """Initialise every weight with the scheme named by ``model.init``, residual projections
        zeroed under ``model.init_zero_residual`` (:func:`lmlab.models.init.init_weights`)."""
        init_weights(self, self.cfg)

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        need_weights: bool = False,
        output_hidden_states: bool = False,
    ) -> ModelOutput:
        """input_ids (B, T) int64 -> ModelOutput with logits (B, T, V) float (the final hidden
        states (B, T, D) when ``model.mlm_head`` is false).

        targets (B, T) int64: the original token at each masked position, -100 elsewhere; the
        loss is the mean cross-entropy over the masked positions, nats/token, in float32. With
        targets the MLM head runs on the masked positions only and ``logits`` is (M, V), one row
        per position where targets != -100 in row-major order (``logits[i]`` predicts
        ``targets[targets != -100][i]``); call without targets for every position's logits.
        attention_mask (B, T) int or bool, 1 = real token, 0 = padding: padding keys are never
        attended to. token_type_ids (B, T) int64 segment ids (default 0). position_ids (B, T) or
        (T,) int64 (default 0 .. T-1). hidden_states: the embedding output, then each layer's
        output (the last after the final norm). Raises ValueError for a mask or ids of the
        wrong shape, LmlabError for targets without an MLM head.
        """
        b, t = input_ids.shape
        for name, ids in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
            if ids is not None and ids.shape != (b, t):
                raise ValueError(f"{name} must be (B, T) = {(b, t)}, got {tuple(ids.shape)}")
        positions = (
            torch.arange(t, device=input_ids.device) if position_ids is None else position_ids
        )  # (T,) or (B, T)
        x = self.embed(input_ids)  # (B, T, D)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        x = self.position.embed(self.hook_embed(x), positions)
        if self.token_type is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            x = x + self.token_type(token_type_ids)
        x = self.drop(self.embed_norm(x))
        key_mask = attention_mask.bool() if attention_mask is not None else None  # (B, T)
        out = self.layers(
            x, self.position, positions, key_mask, None, need_weights, output_hidden_states,
            self.normed,
        )  # fmt: skip
        x, hidden, attns = out.x, out.hidden_states, out.attentions
        if self.lm_head is None:
            if targets is not None:
                raise LmlabError("this encoder has no masked-LM head (model.mlm_head=false)")
            return ModelOutput(x, None, None, hidden, attns)
        if targets is None:
            return ModelOutput(self.mlm(x), None, None, hidden, attns)  # (B, T, V)
        # Only the masked positions are scored, so the head (dense + LN + the D x V projection,
        # the costliest matmul of a small BERT) runs on those ~15% rows alone.
        selected = targets != -100  # (B, T)
        logits = self.mlm(x[selected])  # (M, V), M = selected positions in row-major order
        loss = F.cross_entropy(logits.float(), targets[selected])
        return ModelOutput(logits, loss, None, hidden, attns)

    def mlm(self, h: torch.Tensor) -> torch.Tensor:
        """The masked-LM head on hidden states (..., D) -> vocabulary logits (..., V):
        lm_head(LayerNorm(act(dense(h)))) (BERT's ``cls.predictions``)."""
        assert self.mlm_dense is not None and self.mlm_norm is not None
        assert self.lm_head is not None
        return self.hook_logits(
            linear(self.lm_head, self.mlm_norm(self.mlm_act(linear(self.mlm_dense, h))))
        )

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm of the last layer's output (B, T, D), through ``hook_final_norm``."""
        return self.hook_final_norm(self.final_norm(x))

    def pool(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """BERT's pooled output: tanh(dense(h[:, 0])) of the final hidden states (B, T, D) ->
        (B, D). Raises LmlabError when the model has no pooler (``model.pooler`` false)."""
        if self.pooler is None:
            raise LmlabError("this encoder has no pooler (model.pooler=false)")
        return torch.tanh(linear(self.pooler, last_hidden[:, 0]))

    def num_params(self, non_embedding: bool = False) -> int:
        """Distinct parameters (tied weights counted once); ``non_embedding`` leaves out the
        token embedding (and a tied MLM decoder, which is the same matrix)."""
        return num_params(self, non_embedding)

    # ------------------------------------------------------------------ what it costs
    flops_convention = (
        "per token of a seq_len-token sequence: 2 N + 4 L T d_attn, the MLM head at every "
        "position; training = 3 x (layers + the head at train.mask_prob of the positions)"
    )

    def param_parts(self) -> dict[str, str]:
        """Top-level module -> parameter part (lmlab.models.counting.params_by_part)."""
        head = "mlm_head"
        return {"embed": "embedding", "token_type": "token_type", "pooler": "pooler",
                "mlm_dense": head, "mlm_norm": head, "lm_head": head}  # fmt: skip

    def cache_attention(self) -> list[nn.Module]:
        """None: an encoder reads its input in one pass and does not decode."""
        return []

    def mlm_head_matmul_params(self) -> int:
        """The masked-LM head's matmul weights, dense D x D + the V x D projection (0 without
        a head)."""
        return sum(matmul_params(m) for m in (self.mlm_dense, self.lm_head) if m is not None)

    def matmul_params(self) -> int:
        """N of the FLOP count: the layers' matmul weights and the MLM head's; the pooler runs
        once per sequence on [CLS] and is left out."""
        return matmul_params(self.layers) + self.mlm_head_matmul_params()

    def flops_per_token(self, seq_len: int, train: bool = False, mask_prob: float = 0.15) -> int:
        """FLOPs per token of a ``seq_len``-token pass: 2 N + 4 L T d_attn with the MLM head at
        every position (inference: fill-mask). ``train``: the head runs on the ``mask_prob``
        share of masked positions only, 3 (2 N_layers + 4 L T d_attn) + 3 mask_prob 2 N_head."""
        attns = [layer.attn for layer in self.layers]
        head = 2 * self.mlm_head_matmul_params()
        fwd = 2 * self.matmul_params() + score_flops(attns, self.cfg, seq_len)  # type: ignore[arg-type]
        return 3 * (fwd - head) + round(3 * mask_prob * head) if train else fwd
