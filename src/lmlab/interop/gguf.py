"""GGUF (llama.cpp's file format) -> lmlab: metadata to ModelConfig, tensors to a state dict.

A GGUF file holds key/value metadata (``general.architecture``, ``llama.block_count`` ...,
``tokenizer.ggml.*``) and named tensors, many quantized. The ``gguf`` library reads the file and
dequantizes every quantized tensor to float32 (its own ``gguf.quants.dequantize``); nothing here
runs llama.cpp. Supported: the Llama family (``general.architecture: llama``, which also covers
Mistral-shaped and SmolLM models): RMSNorm, SwiGLU, RoPE, grouped-query attention, Pre-Norm; and
``starcoder2`` (what ``lmlab export --format gguf`` writes for the default Mini-GPT shape,
:mod:`lmlab.interop.gguf_export`): LayerNorm with bias, a GELU MLP with biases, biased q/k/v/o,
half-split (NeoX) RoPE over every channel, Pre-Norm. llama.cpp computes starcoder2's GELU with
the tanh approximation; a file lmlab wrote records the exact one in ``lmlab.ffn.activation``,
which lmlab honours (``lmlab_keys``) and llama.cpp ignores.

Tensor names (GGUF -> lmlab): ``token_embd`` -> ``embed``, ``blk.N.attn_q/k/v/output`` ->
``layers.N.attn.q/k/v/o_proj``, ``blk.N.ffn_gate/up/down`` -> ``layers.N.ffn.gate/up/down_proj``,
``blk.N.attn_norm``/``ffn_norm`` -> ``layers.N.attn_norm``/``ffn_norm``, ``output_norm`` ->
``final_norm``, ``output`` -> ``lm_head`` (absent: tied to the embedding); starcoder2 adds a
``.bias`` to each. For ``llama`` llama.cpp's converter stores q/k rows in the interleaved RoPE
order; they are put back in lmlab's half-split order by
:func:`lmlab.interop.rope_layout.gguf_unpermute` (starcoder2 is stored half-split). GGML lists
dimensions fastest-first, so a tensor of GGML shape [D, V] is the (V, D) matrix PyTorch expects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lmlab.config import (
    AttentionConfig,
    BlockConfig,
    FFNConfig,
    ModelConfig,
    NormConfig,
    PositionConfig,
    RopeScalingConfig,
)
from lmlab.errors import CheckpointError, LmlabError
from lmlab.interop import hf_fields as F
from lmlab.interop.rope_layout import gguf_unpermute
from lmlab.training.weights_fit import check_finite

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama", "starcoder2")
# lmlab.ffn.activation values a starcoder2 file may name (llama.cpp itself computes gelu_tanh)
STARCODER2_ACTIVATIONS = ("gelu", "gelu_tanh")

GGUF_TOP_KEYS = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "final_norm.weight",
    "output_norm.bias": "final_norm.bias",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_KEYS = {
    "attn_q": "attn.q_proj",
    "attn_k": "attn.k_proj",
    "attn_v": "attn.v_proj",
    "attn_output": "attn.o_proj",
    "ffn_gate": "ffn.gate_proj",
    "ffn_up": "ffn.up_proj",
    "ffn_down": "ffn.down_proj",
    "attn_norm": "attn_norm",
    "ffn_norm": "ffn_norm",
}


def is_gguf_file(path: str | Path) -> bool:
    """True if ``path`` is a file starting with the GGUF magic bytes."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


@dataclass
class GGUFFile:
    """What lmlab reads from a GGUF file: scalar/string metadata, token arrays, tensors.

    ``metadata``: every key -> value (str, int, float, bool or a list of those);
    ``tensors``: GGUF tensor name -> float32 tensor in PyTorch order (rows first), dequantized;
    ``tensor_types``: GGUF tensor name -> its stored type name (``Q4_1``, ``F32`` ...).
    """

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    tensor_types: dict[str, str]


def _open(path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # the gguf library raises ValueError, KeyError, IndexError ...
        raise CheckpointError(f"{path} is not a readable GGUF file: {e}") from None


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Only the metadata of a GGUF file (no tensor is dequantized). Raises CheckpointError for
    a file the gguf library cannot parse."""
    return _metadata(_open(Path(path)), Path(path))


def _metadata(reader: Any, path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception as e:  # a malformed value
            raise CheckpointError(f"{path}: metadata key {key!r} is unreadable: {e}") from None
    return out


def _dequantize(tensor: Any, path: Path) -> torch.Tensor:
    """One GGUF tensor -> float32 torch tensor in PyTorch order. Raises LmlabError naming the
    tensor and its type when the gguf library cannot dequantize that type."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype.name.startswith(("I8", "I16", "I32", "I64")):
        raise LmlabError(
            f"{path}: tensor {tensor.name} is stored as integers ({qtype.name}), not weights "
            "lmlab can load"
        )
    try:
        arr = dequantize(tensor.data, qtype)
    except NotImplementedError:
        raise LmlabError(
            f"{path}: tensor {tensor.name} uses the quantization type {qtype.name}, which the "
            "gguf library cannot dequantize; re-quantize the model with another type (Q4_0, "
            "Q4_1, Q5_K, Q8_0, F16 ...)"
        ) from None
    shape = tuple(int(d) for d in reversed(list(tensor.shape)))  # GGML lists fastest dim first
    out = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True).reshape(shape))
    check_finite(tensor.name, out, path)
    return out


def read_gguf(path: str | Path) -> GGUFFile:
    """Read a GGUF file whole: metadata and every tensor dequantized to float32.

    Raises CheckpointError for a file the gguf library cannot parse, LmlabError for a tensor
    type it cannot dequantize (naming the tensor and the type).
    """
    p = Path(path)
    reader = _open(p)
    meta = _metadata(reader, p)
    tensors: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    for t in reader.tensors:
        tensors[t.name] = _dequantize(t, p)
        types[t.name] = t.tensor_type.name
    return GGUFFile(p, meta, tensors, types)


_MISSING = object()


def _get(meta: dict[str, Any], key: str, path: Path, default: Any = _MISSING) -> Any:
    value = meta.get(key, default)
    if value is _MISSING or value is None:
        raise LmlabError(f"{path} lacks the metadata key {key!r}, which this GGUF needs")
    if isinstance(value, list):
        raise LmlabError(f"{path}: {key} holds one value per layer, which lmlab does not support")
    return value


def _int(
    meta: dict[str, Any], key: str, path: Path, hi: int, default: Any = _MISSING, lo: int = 1
) -> int:
    """Metadata ``key`` as an integer in [lo, hi]; LmlabError naming the file and key."""
    value = _get(meta, key, path, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise LmlabError(f"{path}: {key} is {value!r}; it must be an integer in [{lo}, {hi:,}]")
    return value


def _float(meta: dict[str, Any], key: str, path: Path, default: Any = _MISSING) -> float:
    """Metadata ``key`` as a finite number > 0; LmlabError naming the file and key."""
    value = _get(meta, key, path, default)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise LmlabError(f"{path}: {key} is {value!r}; it must be a finite number > 0")
    return float(value)


def gguf_model_config(
    meta: dict[str, Any], tensor_names: set[str], path: Path, lmlab_keys: bool = True
) -> ModelConfig:
    """GGUF metadata -> the Llama-shaped ModelConfig (RMSNorm, SwiGLU, half-split RoPE, GQA,
    Pre-Norm, no biases), or for ``starcoder2`` the Mini-GPT shape (LayerNorm, GELU MLP, every
    bias). ``output.weight`` absent from ``tensor_names`` means tied embeddings.
    ``lmlab_keys``: honour ``lmlab.ffn.activation`` (starcoder2: the exact GELU an lmlab export
    recorded); False gives what llama.cpp computes (tanh GELU).

    Every number is checked for its type and range (the bounds of
    :mod:`lmlab.interop.hf_fields`) before anything is built. Raises LmlabError for an
    architecture other than those in SUPPORTED_ARCHITECTURES (naming it), a missing or bad key
    (naming it), partial rotary, or a RoPE scaling type lmlab has no component for.
    """
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise LmlabError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    a = f"{arch}."
    d_model = _int(meta, a + "embedding_length", path, F.MAX_WIDTH)
    n_heads = _int(meta, a + "attention.head_count", path, F.MAX_HEADS)
    n_kv = _int(meta, a + "attention.head_count_kv", path, n_heads, n_heads)
    if n_heads % n_kv:
        raise LmlabError(
            f"{path}: {a}attention.head_count ({n_heads}) is not a multiple of "
            f"{a}attention.head_count_kv ({n_kv})"
        )
    key_length = meta.get(a + "attention.key_length")
    if key_length is None and d_model % n_heads:
        raise LmlabError(
            f"{path}: {a}embedding_length ({d_model}) is not divisible by "
            f"{a}attention.head_count ({n_heads}) and no {a}attention.key_length is given"
        )
    head_dim = _int(meta, a + "attention.key_length", path, F.MAX_HEADS, d_model // n_heads)
    rot = _int(meta, a + "rope.dimension_count", path, F.MAX_HEADS, head_dim)
    if rot != head_dim:
        raise LmlabError(
            f"{path}: rope.dimension_count {rot} != head_dim {head_dim} (partial rotary) is not "
            "supported for Llama GGUF files"
        )
    scaling = RopeScalingConfig()
    scaling_type = meta.get(a + "rope.scaling.type", "none")
    if scaling_type == "linear":
        factor = _float(meta, a + "rope.scaling.factor", path)
        scaling = RopeScalingConfig(kind="linear", factor=factor)
    elif scaling_type != "none":
        raise LmlabError(
            f"{path}: RoPE scaling {scaling_type!r} has no lmlab component here; "
            "supported: none, linear"
        )
    if "rope_freqs.weight" in tensor_names:
        raise LmlabError(
            f"{path}: per-channel RoPE frequencies (rope_freqs, Llama 3.1) are not supported"
        )
    vocab: int | None = None
    if meta.get(a + "vocab_size") is not None:
        vocab = _int(meta, a + "vocab_size", path, F.MAX_VOCAB)
    head_dim_cfg = head_dim if head_dim != d_model // n_heads else None
    d_ff = _int(meta, a + "feed_forward_length", path, F.MAX_FFN)
    if arch == "starcoder2":
        norm = NormConfig(
            kind="layernorm", eps=_float(meta, a + "attention.layer_norm_epsilon", path)
        )
        act = meta.get("lmlab.ffn.activation", "gelu_tanh") if lmlab_keys else "gelu_tanh"
        if act not in STARCODER2_ACTIVATIONS:
            raise LmlabError(
                f"{path}: lmlab.ffn.activation is {act!r}; a starcoder2 file may name "
                f"{', '.join(STARCODER2_ACTIVATIONS)}"
            )
        ffn = FFNConfig(kind="mlp", d_ff=d_ff, activation=act, bias=True)
        bias = True
    else:
        eps = _float(meta, a + "attention.layer_norm_rms_epsilon", path)
        norm = NormConfig(kind="rmsnorm", eps=eps)
        ffn = FFNConfig(kind="swiglu", d_ff=d_ff, bias=False)
        bias = False
    return ModelConfig(
        vocab_size=vocab,
        d_model=d_model,
        n_layers=_int(meta, a + "block_count", path, F.MAX_LAYERS),
        max_seq_len=_int(meta, a + "context_length", path, F.MAX_POSITIONS),
        tie_embeddings="output.weight" not in tensor_names,
        attention=AttentionConfig(
            n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim_cfg, bias=bias
        ),
        position=PositionConfig(
            kind="rope",
            rope_theta=_float(meta, a + "rope.freq_base", path, 10000.0),
            scaling=scaling,
        ),
        norm=norm,
        ffn=ffn,
        block=BlockConfig(kind="pre"),
    )


def gguf_state_dict(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """GGUF tensor names -> lmlab's state dict; for a Llama file (RMSNorm: the only one stored
    interleaved) q/k rows unpermuted to half-split RoPE order.

    Raises LmlabError naming a tensor lmlab has no place for.
    """
    permuted = cfg.norm.kind == "rmsnorm"  # llama; starcoder2 (LayerNorm) is stored half-split
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        if name in GGUF_TOP_KEYS:
            out[GGUF_TOP_KEYS[name]] = value
            continue
        parts = name.split(".")  # blk.{i}.{module}.{weight|bias}
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in GGUF_LAYER_KEYS:
            raise LmlabError(f"GGUF tensor {name!r} has no place in an lmlab model")
        i, module, kind = parts[1], parts[2], parts[3]
        if module == "attn_q" and permuted:
            value = gguf_unpermute(value, cfg.attention.n_heads)
        elif module == "attn_k" and permuted:
            value = gguf_unpermute(value, cfg.n_kv_heads)
        out[f"layers.{i}.{GGUF_LAYER_KEYS[module]}.{kind}"] = value
    if cfg.tie_embeddings and "embed.weight" in out:
        out["lm_head.weight"] = out["embed.weight"]
    return out


def check_state_dict(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Raise CheckpointError naming a missing, unexpected or wrongly shaped tensor (with both
    shapes) before ``load_state_dict`` would raise a torch error."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(
            f"{source} lacks the tensor for {missing[0]} ({len(missing)} missing)"
        )
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise CheckpointError(f"{source} has a tensor lmlab has no place for: {unexpected[0]}")
    for key, value in state.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise CheckpointError(
                f"{source}: tensor {key} has shape {tuple(value.shape)} but the model expects "
                f"{tuple(expected[key].shape)}"
            )


def _stored_shapes(reader: Any, path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the file as a float32 meta tensor of its PyTorch shape (nothing
    dequantized), its type checked. Raises LmlabError naming a tensor stored as integers."""
    from gguf import GGMLQuantizationType

    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype.name.startswith(("I8", "I16", "I32", "I64")):
            raise LmlabError(
                f"{path}: tensor {t.name} is stored as integers ({qtype.name}), not weights "
                "lmlab can load"
            )
        shape = tuple(int(d) for d in reversed(list(t.shape)))  # GGML lists fastest dim first
        out[t.name] = torch.empty(shape, dtype=torch.float32, device="meta")
    return out


def load_gguf(
    path: str | Path, device: str = "cpu", lmlab_keys: bool = True
) -> tuple[nn.Module, Any]:
    """Load a Llama-family GGUF file as ``(DecoderLM in eval mode, GGUFTokenizer)``: every
    tensor dequantized to float32, q/k rows in half-split RoPE order, the tokenizer and chat
    template from the metadata (:mod:`lmlab.interop.gguf_tokenizer`).

    Before any tensor is dequantized: the metadata is checked key by key, every tensor's name
    and shape against the model the metadata describes, and the float32 bytes against the
    memory available (:func:`lmlab.training.memory.check_load_memory`, cgroup limits included).
    Raises CheckpointError for an unreadable file or a missing / wrongly shaped tensor (named,
    both shapes given), LmlabError for an unsupported architecture, a bad metadata value,
    quantization type or tokenizer, or a model too large for the memory. ``lmlab_keys``: see
    :func:`gguf_model_config`.
    """
    from lmlab.interop.gguf_tokenizer import gguf_tokenizer
    from lmlab.models.build import build_model
    from lmlab.nn.position import POSITION
    from lmlab.training.hardware import resolve_device
    from lmlab.training.memory import check_load_memory

    p = Path(path)
    reader = _open(p)
    meta = _metadata(reader, p)
    shapes = _stored_shapes(reader, p)
    cfg = gguf_model_config(meta, set(shapes), p, lmlab_keys)
    tokenizer = gguf_tokenizer(meta, p)
    if cfg.vocab_size is None:
        cfg.vocab_size = tokenizer.vocab_size
    with torch.device("meta"):  # no random init of weights about to be replaced
        model = build_model(cfg)
    check_state_dict(model, gguf_state_dict(shapes, cfg), str(p))
    nbytes = sum(t.numel() * 4 for t in shapes.values())  # float32 after dequantizing
    check_load_memory(nbytes, torch.device("cpu"), f"the model in {p}")
    dev = resolve_device(device)
    if dev.type != "cpu":
        check_load_memory(nbytes, dev, f"the model in {p}")
    tensors = {t.name: _dequantize(t, p) for t in reader.tensors}
    state = gguf_state_dict(tensors, cfg)
    check_state_dict(model, state, str(p))
    model.load_state_dict(state, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight  # type: ignore[union-attr]
    # the one non-persistent buffer (RoPE's inverse frequencies) is rebuilt off the meta device
    model.position = POSITION.get(cfg.position.kind, "model.position.kind")(cfg)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise LmlabError(f"internal: {left[0]} was not loaded from {p}")
    return model.to(dev).eval(), tokenizer
