"""``lmlab inspect``: parameters per component, FLOPs per token, KV cache and training memory.

Everything is counted from the model built on the meta device, which has every parameter's shape
and no storage (:func:`lmlab.models.counting.meta_model`, :mod:`lmlab.analysis.params`,
:mod:`lmlab.analysis.costs`, :mod:`lmlab.training.memory`), so a config file or run folder is
inspected without allocating the model, even at a size far beyond the machine. Conventions:
docs/inspect.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmlab.analysis import costs
from lmlab.analysis.params import count_params
from lmlab.config import ModelConfig, RunConfig, load_config
from lmlab.errors import LmlabError
from lmlab.models.counting import meta_model, moe_summary, params_by_part
from lmlab.training.hardware import planned_precision
from lmlab.training.memory import format_bytes


def resolve_config(
    path: str | Path, overrides: list[str] | None = None
) -> tuple[str, RunConfig, int, str]:
    """(name, run config, parameter dtype bytes, note) of a config file, a run folder or any
    model :func:`lmlab.interop.load.load` accepts.

    A config file or run folder is read without building anything (parameters are float32: 4
    bytes). Other paths are loaded and give their model's ``cfg`` and parameter dtype. A config
    without vocab_size is counted with its tokenizer's size (char: 256) and says so in the note.
    Raises LmlabError (ConfigError) for a missing or bad path, or --set on a loaded model.
    """
    p = Path(path)
    if not p.exists() and not p.is_symlink():  # (a symlink loop is named by load_config)
        raise LmlabError(f"not found: {p}")
    note = ""
    if p.suffix in (".yaml", ".yml") and not p.is_dir() or (p / "config.yaml").is_file():
        cfg = load_config(p / "config.yaml" if p.is_dir() else p, overrides)
        nbytes = 4  # lmlab builds float32 parameters (bf16 only under autocast)
        if cfg.model.vocab_size is None:
            tok = cfg.data.tokenizer
            sized = tok.kind in ("bpe", "wordlevel")  # a char vocabulary: its 256 at most
            cfg.model.vocab_size = tok.vocab_size if sized else 256
            note = (
                f"vocab_size not set: counted with the {tok.kind} tokenizer's "
                f"{cfg.model.vocab_size}"
            )
        return cfg.name, cfg, nbytes, note
    if overrides:
        raise LmlabError(
            f"--set applies to a config file or an lmlab run folder, not to {p} (a loaded model)"
        )
    from lmlab.interop.load import load

    model, _tok = load(p)
    mcfg = getattr(model, "cfg", None)
    if not isinstance(mcfg, ModelConfig):
        raise LmlabError(f"{p}: the loaded model has no lmlab ModelConfig (model.cfg)")
    param = next(model.parameters())
    return p.name or str(p), RunConfig(name=p.name or str(p), model=mcfg), param.element_size(), ""


def components(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by component over all layers, summing to the total (tied weights once):
    embedding, position (learned table; T5's relative-bias table), attention_q/k/v/o (weights +
    biases of the self-attention of every stack), attention_norms (QK/V-norm), ffn (MoE: router
    + every expert), norms (block, embedding and final), lm_head (0 if tied).

    An encoder (BERT) adds token_type (the segment table), pooler (dense + bias on [CLS]) and
    has mlm_head instead of lm_head (dense + LayerNorm + output bias, + the V x D projection
    when untied). An encoder-decoder adds cross_attention_q/k/v/o (the decoder's n layers).
    Read from the meta-built model (:func:`lmlab.models.counting.params_by_part`)."""
    return params_by_part(meta_model(cfg))


def inspect_model(
    path: str | Path,
    overrides: list[str] | None = None,
    seq_len: int | None = None,
    batch: int = 1,
    context: int | None = None,
    dtype: str | None = None,
) -> dict[str, Any]:
    """The inspect report of ``path`` as one JSON-ready dict.

    seq_len: tokens the FLOPs' attention term and the training-memory estimate use (default
    model.max_seq_len); batch: sequences for the KV cache and training memory; context: tokens
    in the KV cache (default max_seq_len); dtype: KV-cache element type (default the model's
    parameter dtype). Counts are integers: parameters, FLOPs per token, bytes.

    Keys: name, vocab_size, vocab_note, params_total, params_non_embedding, params_active,
    components (sums to params_total), moe (or None), flops_per_token_forward,
    flops_per_token_train, flops_seq_len, kv_cache_* and training_memory (see docs/inspect.md).
    An encoder-decoder's kv_cache_bytes includes the cross-attention cache of a
    ``context``-token source (kv_cache_cross_bytes); an encoder has no KV cache (0).
    Raises LmlabError for a bad path or a value < 1, or a model kind it cannot count.
    """
    name, run_cfg, param_bytes, note = resolve_config(path, overrides)
    cfg = run_cfg.model
    model = meta_model(cfg)
    if not all(callable(getattr(model, m, None)) for m in ("flops_per_token", "cache_attention")):
        raise LmlabError(
            f"inspect counts a model kind that declares flops_per_token() and cache_attention(); "
            f"{name} is {cfg.kind!r}"
        )
    seq = cfg.max_seq_len if seq_len is None else seq_len
    ctx = cfg.max_seq_len if context is None else context
    for flag, value in (("--seq-len", seq), ("--batch", batch), ("--context", ctx)):
        if value < 1:
            raise LmlabError(f"{flag} must be >= 1, got {value}")
    kv_bytes = param_bytes if dtype is None else costs.dtype_bytes(dtype)
    kv_dtype = dtype or {4: "float32", 2: "bfloat16/float16", 1: "int8"}.get(param_bytes, "?")

    parts = count_params(cfg)
    moe = moe_summary(model)
    n_dec = costs.decoder_layers(cfg)  # layers with a KV cache: 0 for an encoder
    per_token = costs.kv_cache_bytes_per_token(cfg, kv_bytes)
    per_layer_token = 0 if n_dec == 0 else per_token // n_dec
    total_kv = costs.kv_cache_bytes(cfg, batch, ctx, kv_bytes)
    cross_kv = batch * ctx * costs.cross_cache_bytes_per_source_token(cfg, kv_bytes)
    mem = costs.training_memory(cfg, batch, seq, run_cfg.train)
    mask_prob = run_cfg.train.mask_prob
    return {
        "name": name,
        "kind": cfg.kind,
        "vocab_size": cfg.vocab_size,
        "vocab_note": note,
        "tied_embeddings": cfg.tie_embeddings,
        "params_total": parts["total"],
        "params_non_embedding": parts["non_embedding"],
        "params_active": costs.active_params(cfg),
        "components": components(cfg),
        "moe": moe,
        "flops_seq_len": seq,
        "flops_convention": str(getattr(model, "flops_convention", "")),
        "flops_per_token_forward": costs.flops_per_token(cfg, seq),
        "flops_per_token_train": costs.flops_per_token(cfg, seq, True, mask_prob),
        "flops_matmul_params": costs.matmul_params(cfg),
        "kv_cache_dtype": kv_dtype,
        "kv_cache_dtype_bytes": kv_bytes,
        "kv_cache_bytes_per_token": per_token,
        "kv_cache_bytes_per_token_per_layer": per_layer_token,
        "kv_cache_cross_bytes_per_source_token": costs.cross_cache_bytes_per_source_token(
            cfg, kv_bytes
        ),
        "kv_cache_batch": batch,
        "kv_cache_context": ctx,
        "kv_cache_tokens_held": costs.cached_tokens(cfg, ctx),
        "kv_cache_bytes": total_kv,
        "kv_cache_cross_bytes": cross_kv,
        "kv_cache_bytes_per_layer": 0 if n_dec == 0 else total_kv // n_dec,
        "kv_cache_bounded": costs.kv_cache_bounded(cfg),
        "training_memory": {
            "batch": batch,
            "seq_len": seq,
            "precision": planned_precision(run_cfg.train),
            "weights": mem.weights,
            "gradients": mem.gradients,
            "optimizer": mem.optimizer,
            "autocast": mem.autocast,
            "activations": mem.activations,
            "total": mem.total,
        },
    }


def _si(n: float) -> str:
    """1.6e10 -> '16.0 G' (decimal prefixes, for FLOPs)."""
    for unit in ("", "k", "M", "G", "T", "P"):
        if abs(n) < 1000 or unit == "P":
            return f"{n:.0f} {unit}" if unit == "" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def format_inspection(info: dict[str, Any]) -> str:
    """The human-readable table of :func:`inspect_model`'s dict."""
    total = int(info["params_total"])
    lines = [
        f"{info['name']}: {total:,} parameters ({int(info['params_non_embedding']):,} "
        "non-embedding)"
    ]
    lines.append(f"  {'component':<16} {'parameters':>16}  share")
    for name, n in info["components"].items():
        if n:
            lines.append(f"  {name:<16} {n:>16,}  {100 * n / total:5.1f}%")
    if info["tied_embeddings"] and info["components"].get("mlm_head", 0):
        lines.append("  (the MLM head's V x D projection is the embedding: counted once)")
    elif info["tied_embeddings"] and "lm_head" in info["components"]:
        lines.append("  (lm_head is tied to the embedding: counted once)")
    moe = info["moe"]
    if moe:
        lines.append(
            f"MoE: {moe['n_experts']} experts of {moe['params_per_expert']:,} parameters, "
            f"top_k {moe['top_k']}{' + a shared expert' if moe['shared_expert'] else ''}: "
            f"{int(info['params_active']):,} active parameters per token of {total:,}"
        )
    seq = info["flops_seq_len"]
    lines.append(
        f"FLOPs per token at seq_len {seq}: forward {_si(info['flops_per_token_forward'])}FLOP, "
        f"training {_si(info['flops_per_token_train'])}FLOP "
        f"(N = {int(info['flops_matmul_params']):,}; {info['flops_convention']})"
    )
    b, ctx = info["kv_cache_batch"], info["kv_cache_context"]
    if not info["kv_cache_bytes"] and not info["kv_cache_bounded"]:  # no decoding layer
        kv = "KV cache: none (an encoder reads its input in one pass; it does not decode)"
    else:
        kv = (
            f"KV cache ({info['kv_cache_dtype']}, {info['kv_cache_dtype_bytes']} B/element): "
            f"{int(info['kv_cache_bytes_per_token']):,} B per token "
            f"({int(info['kv_cache_bytes_per_token_per_layer']):,} per layer); "
            f"batch {b} x {ctx} tokens: {format_bytes(info['kv_cache_bytes'])} "
            f"({format_bytes(info['kv_cache_bytes_per_layer'])} per layer)"
        )
    if info["kv_cache_cross_bytes_per_source_token"]:
        kv += (
            f", of which the cross-attention cache of a {ctx}-token source, computed once: "
            f"{format_bytes(info['kv_cache_cross_bytes'])} "
            f"({int(info['kv_cache_cross_bytes_per_source_token']):,} B per source token)"
        )
    if info["kv_cache_bounded"] and info["kv_cache_tokens_held"]:
        kv += f"; bounded by the sliding window: holds {info['kv_cache_tokens_held']} tokens"
    elif info["kv_cache_bounded"]:
        kv += "; linear attention: a constant-size state, whatever the context"
    lines.append(kv)
    m = info["training_memory"]
    terms = ", ".join(
        f"{k} {format_bytes(m[k])}"
        for k in ("weights", "gradients", "optimizer", "autocast", "activations")
        if m[k]
    )
    lines.append(
        f"training memory at batch {m['batch']} x {m['seq_len']} tokens ({m['precision']}, "
        f"AdamW): {format_bytes(m['total'])} ({terms})"
    )
    if info["vocab_note"]:
        lines.append(f"note: {info['vocab_note']}")
    return "\n".join(lines)
