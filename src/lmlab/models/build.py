"""build_model(cfg): the one place that turns a model config into a module."""

from __future__ import annotations

from torch import nn

from lmlab.config import ModelConfig
from lmlab.models.decoder import DecoderLM
from lmlab.models.encoder import EncoderLM
from lmlab.models.encoder_decoder import EncoderDecoderLM
from lmlab.registry import Registry

MODELS: Registry[type[nn.Module]] = Registry("model", "model.kind")
MODELS.notes = """
`model.tie_embeddings: true` (Press & Wolf 2017): the LM head reuses the token-embedding matrix,
which saves V x d parameters in small models. It stays one matrix through every load
(`load_state_dict(..., assign=True)`, a state dict holding either name alone), and a state dict
with two different matrices is refused.
"""
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
