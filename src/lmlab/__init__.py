"""lmlab: build, train, probe and compare Transformer language models.

``lmlab.load(path)`` returns ``(model, tokenizer)`` for a run folder or a Hugging Face folder.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def load(path: Any, device: str = "cpu", quantize: Any = None) -> Any:
    """See :func:`lmlab.interop.load.load` (imported lazily: ``import lmlab`` stays light);
    ``quantize="int8"`` / ``"int4"`` / ``"int4:64"``: weight-only quantized linear layers
    (``"int4+a8"``: activations rounded to int8 too, docs/quantization.md)."""
    from lmlab.interop.load import load as _load

    return _load(path, device, quantize)
