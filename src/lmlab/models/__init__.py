"""Model families wired from :mod:`lmlab.nn` components."""

from lmlab.models.build import MODELS, build_model
from lmlab.models.decoder import DecoderLM
from lmlab.models.encoder_decoder import EncoderDecoderLM, Seq2SeqOutput
from lmlab.models.output import ModelOutput

__all__ = [
    "MODELS",
    "DecoderLM",
    "EncoderDecoderLM",
    "ModelOutput",
    "Seq2SeqOutput",
    "build_model",
]
