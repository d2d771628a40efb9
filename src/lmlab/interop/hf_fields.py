"""Types and ranges of the settings in a Hugging Face ``config.json``, checked before any model is
built: the boundary where an untrusted config becomes numbers lmlab allocates from.

Every field below that the file sets is checked for its type (an integer is a JSON integer, not
``"abc"``, ``12.5``, ``true`` or ``null``; a float a finite JSON number; a flag a JSON boolean)
and its range. The upper bounds are far above any published model (the memory check of
:func:`lmlab.training.memory.check_load_memory` is what refuses a model too large for this
machine); they only keep absurd values (``num_hidden_layers: 1e9``) from being built even on the
meta device. Head counts must divide the width unless ``head_dim`` is given, and
``num_key_value_heads`` must divide ``num_attention_heads``. Raises LmlabError naming the file
and the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmlab.errors import LmlabError

MAX_LAYERS = 1024
MAX_WIDTH = 1 << 16  # hidden_size / d_model
MAX_FFN = 1 << 20  # intermediate_size
MAX_HEADS = 4096  # attention heads, and head_dim
MAX_VOCAB = 1 << 24
MAX_POSITIONS = 1 << 24  # max_position_embeddings (tokens)
MAX_EXPERTS = 4096
INF = math.inf


@dataclass(frozen=True)
class Field:
    """``kind``: "int", "float", "bool", "str" or "ids" (None, an id or a list of ids);
    a number must lie in [lo, hi] (``open_lo``: lo itself excluded); ``nullable``: null allowed."""

    kind: str
    lo: float = -INF
    hi: float = INF
    nullable: bool = False
    open_lo: bool = False


def _ints(lo: int, hi: float, names: str, nullable: bool = False) -> dict[str, Field]:
    return {n: Field("int", lo, hi, nullable) for n in names.split()}


HF_FIELDS: dict[str, Field] = {
    **_ints(1, MAX_VOCAB, "vocab_size"),
    **_ints(1, MAX_WIDTH, "hidden_size n_embd d_model"),
    **_ints(1, MAX_LAYERS, "num_hidden_layers n_layer num_layers encoder_layers decoder_layers"),
    **_ints(1, MAX_LAYERS, "num_decoder_layers", nullable=True),
    **_ints(
        1,
        MAX_HEADS,
        "num_attention_heads n_head num_heads encoder_attention_heads decoder_attention_heads d_kv",
    ),
    **_ints(1, MAX_HEADS, "num_key_value_heads head_dim", nullable=True),
    **_ints(1, MAX_FFN, "intermediate_size d_ff encoder_ffn_dim decoder_ffn_dim"),
    **_ints(1, MAX_FFN, "n_inner", nullable=True),
    **_ints(1, MAX_POSITIONS, "max_position_embeddings"),
    **_ints(1, MAX_POSITIONS, "n_positions original_max_position_embeddings", nullable=True),
    **_ints(1, 1 << 31, "sliding_window", nullable=True),
    **_ints(1, MAX_EXPERTS, "num_local_experts num_experts_per_tok"),
    **_ints(0, 1 << 16, "type_vocab_size"),
    **_ints(1, 1 << 16, "relative_attention_num_buckets"),
    **_ints(1, MAX_POSITIONS, "relative_attention_max_distance"),
    **{n: Field("ids") for n in ["pad_token_id", "eos_token_id", "bos_token_id"]},
    "decoder_start_token_id": Field("ids"),
    "rope_theta": Field("float", 0, open_lo=True),
    "rotary_emb_base": Field("float", 0, open_lo=True),
    **{n: Field("float", 0, 1, open_lo=True) for n in ("partial_rotary_factor", "rotary_pct")},
    **{
        n: Field("float", 0, 1, open_lo=True)
        for n in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")
    },
    **{
        n: Field("float", 0, 1)
        for n in ("dropout", "attention_dropout", "hidden_dropout", "dropout_rate")
    },
    **{
        n: Field("float", 0)
        for n in ("initializer_range", "router_aux_loss_coef", "router_jitter_noise")
    },
    **{
        n: Field("bool", nullable=True)
        for n in (
            *("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"),
            *("use_parallel_residual", "scale_embedding"),
        )
    },
    **{
        n: Field("str", nullable=True)
        for n in (
            ["hidden_act", "activation_function", "feed_forward_proj", "position_embedding_type"]
        )
    },
}

# inside rope_parameters / rope_scaling
ROPE_FIELDS: dict[str, Field] = {
    "rope_theta": Field("float", 0, open_lo=True),
    "factor": Field("float", 1, 1e6),
    "original_max_position_embeddings": Field("int", 1, MAX_POSITIONS, nullable=True),
    "partial_rotary_factor": Field("float", 0, 1, open_lo=True),
    "beta_fast": Field("float", 0, nullable=True),
    "beta_slow": Field("float", 0, nullable=True),
    "attention_factor": Field("float", 0, nullable=True, open_lo=True),
    "mscale": Field("float", 0, nullable=True),
    "mscale_all_dim": Field("float", 0, nullable=True),
    "truncate": Field("bool", nullable=True),
    "rope_type": Field("str"),
    "type": Field("str"),
}


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_value(value: Any, field: Field, where: str) -> None:
    """Raise LmlabError (``where``: "FILE: field") unless ``value`` fits ``field``."""
    if value is None:
        if field.nullable or field.kind == "ids":
            return
        raise LmlabError(f"{where} is null; it must be {_wanted(field)}")
    if field.kind == "bool":
        ok = isinstance(value, bool)
    elif field.kind == "str":
        ok = isinstance(value, str)
    elif field.kind == "ids":
        ids = value if isinstance(value, list) else [value]
        ok = all(
            isinstance(i, int) and not isinstance(i, bool) and -1 <= i < MAX_VOCAB for i in ids
        )
    elif field.kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool) and _in_range(value, field)
    else:
        ok = (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and _in_range(value, field)
        )
    if not ok:
        raise LmlabError(f"{where} is {_describe(value)}; it must be {_wanted(field)}")


def _in_range(value: float, field: Field) -> bool:
    above = value > field.lo if field.open_lo else value >= field.lo
    return above and value <= field.hi


def _wanted(field: Field) -> str:
    if field.kind == "bool":
        return "true or false"
    if field.kind == "str":
        return "a string"
    if field.kind == "ids":
        return "a token id (an integer >= -1), a list of them, or null"
    noun = "an integer" if field.kind == "int" else "a finite number"
    lo = f"> {field.lo:g}" if field.open_lo else f">= {field.lo:g}"
    hi = (
        ""
        if field.hi == INF
        else f" and <= {field.hi:,g}"
        if field.kind == "int"
        else (f" and <= {field.hi:g}")
    )
    if field.lo == -INF:
        return noun
    return f"{noun} {lo}{hi}"


# what transformers' rope validation requires of each rope_type lmlab reads (it raises KeyError;
# yarn's original_max_position_embeddings it fills in from max_position_embeddings, as lmlab does)
ROPE_REQUIRED: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
}


def check_hf_config(raw: dict[str, Any], path: Path) -> None:
    """Check every setting of :data:`HF_FIELDS` (and of ``rope_parameters``/``rope_scaling``)
    that ``raw`` (a parsed ``config.json``) holds, then the head counts against the width.
    Raises LmlabError naming ``path`` and the field."""
    for name, field in HF_FIELDS.items():
        if name in raw:
            check_value(raw[name], field, f"{path}: {name}")
    for group in ("rope_parameters", "rope_scaling"):
        params = raw.get(group)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise LmlabError(f"{path}: {group} is {_describe(params)}; it must be an object")
        for name, field in ROPE_FIELDS.items():
            if name in params:
                check_value(params[name], field, f"{path}: {group}.{name}")
        kind = params.get("rope_type", params.get("type", "default"))
        for name in ROPE_REQUIRED.get(str(kind), ()):
            if params.get(name) is None:
                raise LmlabError(f"{path}: {group}.{name} is missing; {kind} needs it")
    both = raw.get("rope_parameters"), raw.get("rope_scaling")
    if all(both) and both[0] != both[1]:
        raise LmlabError(
            f"{path}: rope_parameters and rope_scaling are both set and disagree; transformers "
            "reads rope_scaling, lmlab rope_parameters: keep one of them"
        )
    for width, heads in (
        ("hidden_size", "num_attention_heads"),
        ("n_embd", "n_head"),
        ("d_model", "encoder_attention_heads"),
        ("d_model", "decoder_attention_heads"),
    ):
        given = width in raw and heads in raw and raw.get("head_dim") is None
        if given and raw[width] % raw[heads]:
            raise LmlabError(
                f"{path}: {width} ({raw[width]}) is not divisible by {heads} ({raw[heads]}) "
                "and no head_dim is given"
            )
    kv, heads_n = raw.get("num_key_value_heads"), raw.get("num_attention_heads")
    if isinstance(kv, int) and isinstance(heads_n, int) and heads_n % kv:
        raise LmlabError(
            f"{path}: num_attention_heads ({heads_n}) is not a multiple of num_key_value_heads "
            f"({kv})"
        )
    top_k, experts = raw.get("num_experts_per_tok"), raw.get("num_local_experts")
    if isinstance(top_k, int) and isinstance(experts, int) and top_k > experts:
        raise LmlabError(
            f"{path}: num_experts_per_tok ({top_k}) exceeds num_local_experts ({experts})"
        )
