"""Hyper-connections: the residual stream widened to n parallel streams (Zhu et al. 2024,
"Hyper-Connections", arXiv 2409.19606), optionally with mHC's doubly stochastic residual mixing
(Xie et al. 2025, DeepSeek, "mHC: Manifold-Constrained Hyper-Connections", arXiv 2512.24880).

Legend: B batch, T tokens, D d_model, n streams (``model.block.n_streams``). Between layers the
stream state is H (B, T, n, D); the embedding (B, T, D) is copied into the n streams before the
first layer and the streams are summed before the final norm (paper sec. 2.1: H^0 = [h^0 ... h^0],
the last hyper hidden matrix is summed row-wise), through the block's ``expand_stream`` and
``reduce_stream`` that :class:`~lmlab.models.stack.LayerStack` calls.

Each sublayer T (attention, FFN; each with its Pre-Norm norm inside) has its own
hyper-connection, the paper's (n + 1) x (n + 1) matrix [[0, B], [A_m, A_r]] (eq. 1-5):

    h_0 = A_m^T H                      (D,)     width connection: what the sublayer reads
    H'  = A_r^T H                      (n, D)   the streams mixed with each other
    H   = B^T T(h_0) + H'              (n, D)   depth connection: the output written to each

with A_m (n,), A_r (n, n) and B (n,) learned. Initialisation (eq. 14): A_m = e_{k mod n} (layer
k reads stream k mod n), A_r = I_n, B = 1_n; the n streams then stay equal to the Pre-Norm
residual stream, so ``n_streams: 1`` IS the Pre-Norm block (A_m = A_r = B = 1, exactly) and the
paper's init for n > 1 starts as Pre-Norm too (the summed output is n times it, which the final
norm removes up to its eps).

``dynamic: true`` (eq. 10-13, the DHC variant) adds input-dependent parts computed from
H_bar = norm(H), per token: A_m += s_a tanh(H_bar W_m), A_r += s_a tanh(H_bar W_r),
B += s_b tanh(H_bar W_b)^T, with W_* initialised to 0 and s_a = s_b = 0.01 (learned scalars).

``hc_constraint: sinkhorn`` (mHC): A_r is the Sinkhorn-Knopp projection of exp(logits) onto the
doubly stochastic matrices (the Birkhoff polytope; rows and columns sum to 1), ``sinkhorn_iters``
alternating row / column normalisations (mHC: t_max = 20). A doubly stochastic A_r keeps the
mean of the streams (the identity-mapping property), and for n = 1 it is exactly 1. The logits
start at 0 (A_r = 1/n: every stream mixed equally, which keeps equal streams equal, so the
Pre-Norm start above still holds). lmlab keeps HC's unconstrained A_m and B (mHC passes H_pre
through a sigmoid and H_post through 2 sigmoid), so that n = 1 stays exactly the plain residual.

The static coefficients are stored 1-D (A_r flattened), so AdamW's weight decay, which lmlab
applies to parameters of 2 or more dimensions, leaves them alone, as it does norm gains.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmlab.errors import ConfigError
from lmlab.nn.block import BLOCK, Block
from lmlab.nn.norm import build_norm

if TYPE_CHECKING:
    from lmlab.config import ModelConfig

CONSTRAINTS = ("none", "sinkhorn")
DYNAMIC_SCALE_INIT = 0.01  # s_a and s_b at initialisation (the paper's reference code)


@dataclass(frozen=True)
class HCOptions:
    """The block's own fields (``HyperConnectionBlock.fields``), read once from
    ``model.block``: n streams, the constraint (none, sinkhorn), Sinkhorn rounds, dynamic."""

    n_streams: int
    hc_constraint: str
    sinkhorn_iters: int
    dynamic: bool
    residual: bool

    @classmethod
    def of(cls, cfg: ModelConfig) -> HCOptions:
        b: Any = cfg.block  # variant fields: attributes the schema does not name
        return cls(b.n_streams, b.hc_constraint, b.sinkhorn_iters, b.dynamic, b.residual)


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """logits (..., n, n) -> exp(logits) projected onto the doubly stochastic matrices by
    Sinkhorn-Knopp (Sinkhorn & Knopp 1967; mHC eq. 9): ``iters`` rounds of dividing each row by
    its sum, then each column by its sum; the columns sum to 1 exactly, the rows to within the
    iteration's convergence. Same dtype as ``logits``; a 1 x 1 matrix is exactly 1."""
    m = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))  # shifted: no overflow
    for _ in range(iters):
        m = m / m.sum(dim=-1, keepdim=True)
        m = m / m.sum(dim=-2, keepdim=True)
    return m


class HyperConnection(nn.Module):
    """The hyper-connection of one sublayer (module docstring): A_m (n,), A_r (n, n) (or its
    logits with ``hc_constraint: sinkhorn``), B (n,), and with ``dynamic`` the norm, W_m (D, 1),
    W_r (D, n), W_b (D, 1) and the scales s_a, s_b."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        b = HCOptions.of(cfg)
        n = self.n = b.n_streams
        self.sinkhorn_iters = b.sinkhorn_iters if b.hc_constraint == "sinkhorn" else 0
        a_m = torch.zeros(n)
        a_m[layer_idx % n] = 1.0  # layer k reads stream k mod n (eq. 14)
        self.a_m = nn.Parameter(a_m)
        # A_r, flattened (n * n,): I_n, or with Sinkhorn its logits, 0 (A_r = 1 / n)
        a_r = torch.zeros(n, n) if self.sinkhorn_iters else torch.eye(n)
        self.a_r = nn.Parameter(a_r.reshape(n * n))
        self.beta = nn.Parameter(torch.ones(n))
        self.dynamic = b.dynamic
        if self.dynamic:
            d = cfg.d_model
            self.norm = build_norm(cfg)
            self.w_m = nn.Parameter(torch.zeros(d, 1))  # zero: the dynamic part starts at 0
            self.w_r = nn.Parameter(torch.zeros(d, n))
            self.w_b = nn.Parameter(torch.zeros(d, 1))
            self.s_a = nn.Parameter(torch.full((), DYNAMIC_SCALE_INIT))
            self.s_b = nn.Parameter(torch.full((), DYNAMIC_SCALE_INIT))

    def coefficients(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """H (B, T, n, D) -> A_m (n,), A_r (n, n), B (n,) (static), or per token (B, T, n),
        (B, T, n, n), (B, T, n) (dynamic); A_r doubly stochastic with Sinkhorn."""
        n = self.n
        a_m: torch.Tensor = self.a_m
        a_r: torch.Tensor = self.a_r.view(n, n)
        beta: torch.Tensor = self.beta
        if self.dynamic:
            hbar = self.norm(h)  # (B, T, n, D)
            a_m = a_m + self.s_a * torch.tanh(hbar @ self.w_m).squeeze(-1)  # (B, T, n)
            a_r = a_r + self.s_a * torch.tanh(hbar @ self.w_r)  # (B, T, n, n)
            beta = beta + self.s_b * torch.tanh(hbar @ self.w_b).squeeze(-1)  # (B, T, n)
        if self.sinkhorn_iters:
            a_r = sinkhorn(a_r, self.sinkhorn_iters)
        return a_m, a_r, beta

    def width(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """H (B, T, n, D) -> (h_0 = A_m^T H (B, T, D): the sublayer's input, H' = A_r^T H
        (B, T, n, D): the mixed streams, B (n,) or (B, T, n): the write weights).

        Written as broadcast products and sums over n, not matmuls, so that autocast keeps the
        residual streams in their own dtype (float32) and a weight of 1 is exact."""
        a_m, a_r, beta = self.coefficients(h)
        h0 = (a_m.unsqueeze(-1) * h).sum(dim=-2)  # (B, T, D)
        # H'_i = sum_j A_r[j, i] H_j: row j of A_r (n,) times stream j (B, T, 1, D)
        terms = (a_r[..., j, :].unsqueeze(-1) * h[..., j : j + 1, :] for j in range(self.n))
        mixed = functools.reduce(torch.add, terms)  # (B, T, n, D)
        return h0, mixed, beta

    @staticmethod
    def depth(mixed: torch.Tensor, beta: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """H' (B, T, n, D), B (n,) or (B, T, n), the sublayer's output T(h_0) (B, T, D) ->
        B^T T(h_0) + H' (B, T, n, D)."""
        return mixed + beta.unsqueeze(-1) * out.unsqueeze(-2)


@BLOCK.register("hyper")
class HyperConnectionBlock(Block):
    """Pre-Norm sublayers on n residual streams mixed by learned hyper-connections (Zhu et al.
    2024); ``hc_constraint: sinkhorn``: doubly stochastic stream mixing (mHC, Xie et al. 2025).

    Each of attention and FFN reads h_0 = A_m^T H, writes B^T T(h_0) + A_r^T H (module
    docstring); the block carries H (B, T, n, D) from layer to layer."""

    examples: tuple[dict, ...] = (
        {"block": {"n_streams": 1}},
        {"block": {"n_streams": 2}},
        {"block": {"n_streams": 4}},
        {"block": {"n_streams": 4, "hc_constraint": "sinkhorn", "sinkhorn_iters": 10}},
        {"block": {"n_streams": 2, "dynamic": True}},
        {
            "block": {
                "n_streams": 3,
                "dynamic": True,
                "hc_constraint": "sinkhorn",
                "sinkhorn_iters": 3,
            }
        },
    )
    # n: streams; hc_constraint: none (HC) or sinkhorn (mHC); sinkhorn_iters: Sinkhorn-Knopp
    # rounds (mHC's t_max); dynamic: the input-dependent coefficients of DHC
    fields = {
        "n_streams": (int, 4),
        "hc_constraint": (str, "none"),
        "sinkhorn_iters": (int, 20),
        "dynamic": (bool, False),
    }

    @classmethod
    def check(cls, cfg: ModelConfig) -> None:
        """n_streams >= 1; hc_constraint none or sinkhorn; sinkhorn_iters >= 1 and only with
        sinkhorn; block.residual true; model.kind decoder or encoder."""
        b = HCOptions.of(cfg)
        if not isinstance(b.n_streams, int) or b.n_streams < 1:
            raise ConfigError(f"model.block.n_streams must be an integer >= 1, got {b.n_streams}")
        if b.hc_constraint not in CONSTRAINTS:
            raise ConfigError(
                f"model.block.hc_constraint must be one of {', '.join(CONSTRAINTS)}, got "
                f"{b.hc_constraint!r}"
            )
        if not isinstance(b.sinkhorn_iters, int) or b.sinkhorn_iters < 1:
            raise ConfigError(
                f"model.block.sinkhorn_iters must be an integer >= 1, got {b.sinkhorn_iters}"
            )
        if b.sinkhorn_iters != 20 and b.hc_constraint != "sinkhorn":
            raise ConfigError(
                "model.block.sinkhorn_iters applies with model.block.hc_constraint=sinkhorn only"
            )
        if not b.residual:
            raise ConfigError(
                "model.block.residual: false is not supported by model.block.kind=hyper (its "
                "residual streams are the hyper-connections)"
            )
        if cfg.kind == "encoder_decoder":
            raise ConfigError(
                "model.block.kind=hyper supports model.kind decoder and encoder, not "
                "encoder_decoder (its decoder layers are not hyper-connected)"
            )

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        if hasattr(self, "hook_resid_mid"):  # n streams mixed in, none between the sublayers
            del self.hook_resid_mid
        self.n_streams, self.d_model = HCOptions.of(cfg).n_streams, cfg.d_model
        self.attn_hc = HyperConnection(cfg, layer_idx)
        self.ffn_hc = HyperConnection(cfg, layer_idx)

    def expand_stream(self, x: torch.Tensor) -> torch.Tensor:
        """The embedding x (B, T, D) -> H^0 (B, T, n, D): n copies (a broadcast view)."""
        return x.unsqueeze(-2).expand(*x.shape[:-1], self.n_streams, x.shape[-1])

    def reduce_stream(self, h: torch.Tensor) -> torch.Tensor:
        """H (B, T, n, D) -> the streams' sum (B, T, D), what the final norm reads."""
        return h.sum(dim=-2)

    def saved_stream_bytes(self, act_bytes: int) -> int:
        """Bytes per token this block's autograd graph keeps beyond a Pre-Norm block's, for the
        training-memory estimate (:mod:`lmlab.training.memory`): per sublayer the stream H
        (n D, float32) that the mixing's backward reads and the sublayer output (D,
        ``act_bytes`` each) that B's reads (the first layer's H is a view of the embedding:
        slightly less there); with ``dynamic`` also H_bar (n D), the n (n + 2) projections
        before and after tanh and two per-stream norm statistics (float32); with dynamic
        Sinkhorn each round's matrix and sums, twice (n (n + 1) each). The static Sinkhorn's
        n x n intermediates do not grow with the tokens and are left out."""
        n, d = self.n_streams, self.d_model
        per = 4 * n * d + act_bytes * d
        if self.attn_hc.dynamic:
            per += 4 * (n * d + 2 * n * (n + 2) + 2 * n)
            per += 4 * 2 * n * (n + 1) * self.attn_hc.sinkhorn_iters
        return 2 * per

    def forward(self, x, position, positions, key_mask=None, cache=None):
        """H (B, T, n, D) -> H (B, T, n, D)."""
        h0, mixed, beta = self.attn_hc.width(x)
        a = self.attn(self.attn_norm(h0), position, positions, key_mask, cache)
        h = self.attn_hc.depth(mixed, beta, self.drop(a.out))
        h0, mixed, beta = self.ffn_hc.width(h)
        return self.ffn_hc.depth(mixed, beta, self.drop(self.ffn(self.ffn_norm(h0))))
