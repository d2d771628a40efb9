"""xPos: RoPE whose rotation also decays with distance (Sun et al. 2022, "A Length-Extrapolatable
Transformer", sec. 3.2), as one lmlab plugin file.

Channel pair i of q at position m is scaled by zeta_i^(m / B) and of k at position n by
zeta_i^(-n / B), zeta_i = (2i / r + gamma) / (1 + gamma), gamma = 0.4, B =
``model.position.scale_base`` (a field this file declares; default 512, the paper's and
torchscale's value), so q_m . k_n gains the factor zeta_i^((m - n) / B): it still depends on
the offset only (cached decoding and left padding keep working) and decays with distance.

    lmlab verify --plugin examples/plugins/xpos.py --config examples/plugins/xpos.yaml
"""

import math

import torch

from lmlab.errors import ConfigError
from lmlab.nn.position import POSITION, RotaryPosition

GAMMA = 0.4  # zeta's offset
MAX_KEY_SCALE = 1e4  # keys are divided by zeta^(n / B): keep that well inside fp16 / bf16


@POSITION.register("xpos")
class XPosPosition(RotaryPosition):
    """xPos: RoPE with a per-channel exponential decay, q times zeta^(m/B), k over zeta^(n/B)
    (Sun et al. 2022)."""

    examples = (
        {},
        {"attention": {"n_kv_heads": 1}},
        {"attention": {"mask": "sliding_window", "window": 4}},
        {"position": {"interleaved": True, "scale_base": 64.0}},
    )
    options = ("rope_theta", "interleaved", "partial_rotary_factor", "scaling")
    fields = {"scale_base": (float, 512.0)}  # B: positions per factor-zeta change of the scale

    @classmethod
    def check(cls, cfg) -> None:
        """RoPE's checks; scale_base > 0; refuse a context whose key scale 1 / zeta_0^(n / B)
        passes MAX_KEY_SCALE."""
        RotaryPosition.check(cfg)
        base = cfg.position.scale_base
        if not 0 < base < float("inf"):
            raise ConfigError(f"model.position.scale_base must be > 0 and finite, got {base}")
        limit = int(base * math.log(MAX_KEY_SCALE) / math.log((1 + GAMMA) / GAMMA))
        if cfg.max_seq_len > limit:
            raise ConfigError(
                f"model.max_seq_len ({cfg.max_seq_len}) must be <= {limit} for "
                f"model.position.kind=xpos: its key scale would pass {MAX_KEY_SCALE:g}"
            )

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.scale_base = cfg.position.scale_base

    def decay(self, positions: torch.Tensor) -> torch.Tensor:
        """(T,) or (B, T) positions -> zeta^(position / B), (T, hd) or (B, T, hd) float32, laid
        out as the rotation's cos/sin; 1 on the hd - r channels RoPE leaves unrotated."""
        r = self.rotary_dim
        zeta = (torch.arange(0, r, 2, device=positions.device) / r + GAMMA) / (1 + GAMMA)
        zeta = zeta.repeat_interleave(2) if self.interleaved else torch.cat((zeta, zeta))
        scale = zeta ** (positions.float().unsqueeze(-1) / self.scale_base)  # (..., T, r)
        ones = scale.new_ones(*scale.shape[:-1], self.head_dim - r)
        return torch.cat((scale, ones), dim=-1)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q (B, H, T, hd), k (B, K, T, hd) -> RoPE-rotated q * zeta^(m/B), k / zeta^(n/B)."""
        q, k = super().rotate(q, k, positions)
        scale = self.decay(positions).to(q.dtype)  # (T, hd) or (B, T, hd)
        if scale.dim() == 3:  # per-row positions (a left-padded batch): broadcast over heads
            scale = scale.unsqueeze(1)
        return q * scale, k / scale
