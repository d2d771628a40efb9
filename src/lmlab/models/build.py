"""build_model(cfg): the one place that turns a model config into a module."""

from __future__ import annotations

from torch import nn

from lmlab.config import ModelConfig
from lmlab.models.decoder import DecoderLM
from lmlab.models.encoder import EncoderLM
from lmlab.models.encoder_decoder import EncoderDecoderLM
from lmlab.registry import Registry

MODELS: Registry[type[nn.Module]] = Registry("model", "model.kind")
MODELS.register("decoder", "Decoder-only causal language model (GPT).")(DecoderLM)
MODELS.register("encoder_decoder", "Encoder-decoder sequence-to-sequence model (T5, BART).")(
    EncoderDecoderLM
)
MODELS.register("encoder", "Encoder-only masked language model (BERT, Devlin et al. 2019).")(
    EncoderLM
)


def build_model(cfg: ModelConfig) -> nn.Module:
    """Build the model family named by ``cfg.kind`` with freshly initialised weights."""
    return MODELS.get(cfg.kind, "model.kind")(cfg)
