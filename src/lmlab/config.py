"""Typed run configuration: ``model``, ``data`` and ``train`` sections, YAML in and out.

Each component family is a sub-section chosen by its ``kind`` (``model.position.kind: rope``).
:func:`config_from_dict` rejects an unknown field or a value of the wrong type with a message that
names the dotted field and lists what is allowed; :meth:`RunConfig.validate` then checks the kinds
against the component registries and the cross-field rules (``d_model % n_heads == 0`` ...).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, Union

import yaml

from lmlab.errors import ConfigError
from lmlab.safeio import is_yaml, parse_yaml, short_repr

# ----------------------------------------------------------------------------- model sections


@dataclass
class AttentionConfig:
    """Self-attention. ``n_kv_heads`` < ``n_heads`` gives GQA, 1 gives MQA (Ainslie et al. 2023)."""

    kind: str = "softmax"  # softmax | linear (Katharopoulos et al. 2020)
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: equal to n_heads (multi-head attention)
    head_dim: int | None = None  # None: d_model // n_heads
    backend: str = "sdpa"  # sdpa (fused kernel) | math (explicit, can return weights)
    bias: bool = False  # bias on the q/k/v/o projections
    out_bias: bool | None = None  # bias on o_proj alone; None: same as bias (Qwen2: bias, no out)
    dropout: float = 0.0  # dropout on attention weights (training only)
    mask: str = "causal"  # causal | bidirectional | sliding_window
    window: int | None = None  # sliding_window only: a query sees itself + window-1 earlier tokens
    qk_norm: bool = False  # RMSNorm over head_dim on each q and k head, before RoPE (Qwen3)
    v_norm: bool = False  # the same on each v head (block.kind=hybrid turns both on)
    scaled: bool = True  # False drops the 1/sqrt(head_dim) factor on the scores


@dataclass
class RopeScalingConfig:
    """RoPE context scaling: none, linear, ntk, dynamic_ntk or yarn (lmlab.nn.rope_scaling)."""

    kind: str = "none"
    factor: float = 1.0  # context extension ratio s = new length / original length, >= 1
    original_max_seq_len: int | None = None  # pretraining context, tokens; None: max_seq_len
    beta_fast: float = 32.0  # yarn: pairs rotating more often than this over L extrapolate
    beta_slow: float = 1.0  # yarn: pairs rotating less often than this interpolate
    truncate: bool = True  # yarn: floor/ceil the ramp's channel range (HF default)
    attention_factor: float | None = None  # yarn: cos/sin multiplier; None: 0.1 ln(s) + 1
    mscale: float | None = None  # yarn (DeepSeek-V2): with mscale_all_dim, sets attention_factor
    mscale_all_dim: float | None = None


@dataclass
class PositionConfig:
    """Positional encoding: none, sinusoidal, learned, alibi or rope."""

    kind: str = "rope"
    rope_theta: float = 10000.0  # RoPE base (Su et al. 2021)
    interleaved: bool = False  # rope: pair channels (2i, 2i+1) (GPT-J); False: (i, i+r/2) (Llama)
    partial_rotary_factor: float = 1.0  # rope: rotate only the first int(hd * this) channels
    scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)  # rope only
    offset: int = 0  # learned only: table rows before position 0 (BART: 2)
    num_buckets: int = 32  # t5_relative: relative-distance buckets per direction set (T5: 32)
    max_distance: int = 128  # t5_relative: distances >= this share the last bucket (T5: 128)


@dataclass
class NormConfig:
    """Normalisation layer: layernorm or rmsnorm."""

    kind: str = "layernorm"
    eps: float = 1e-5
    bias: bool = True  # LayerNorm only


@dataclass
class FFNConfig:
    """Position-wise feed-forward network: mlp (up -> act -> down), swiglu, geglu or moe."""

    kind: str = "mlp"
    d_ff: int | None = None  # None: 4 * d_model (per expert for moe)
    activation: str = "gelu"  # mlp and gated; swiglu and geglu fix their gate activation
    bias: bool = True
    # d_ff = None only: take 2/3 of 4*d_model (a gated FFN then has the MLP's parameter count,
    # Shazeer 2020; Llama), rounded up to a multiple of multiple_of.
    two_thirds: bool = False
    multiple_of: int = 1
    # moe only (Mixture of Experts, see lmlab.nn.moe)
    n_experts: int = 8
    top_k: int = 2  # experts per token
    router: str = "topk_softmax"  # topk_softmax (Mixtral) | softmax_topk (Switch, DeepSeekMoE)
    expert: str = "swiglu"  # the FFN kind of each expert (mlp, swiglu, geglu), d_ff wide
    shared_expert: bool = False  # one more expert applied to every token (DeepSeekMoE)
    aux_loss_coef: float = 0.01  # load-balancing loss weight (Switch Transformer: 0.01)
    z_loss_coef: float = 0.001  # router z-loss weight (ST-MoE: 0.001)


@dataclass
class BlockConfig:
    """Norm placement in a layer: pre (Pre-Norm), post (Post-Norm) or hybrid (HybridNorm)."""

    kind: str = "pre"
    parallel: bool = False  # attention and FFN side by side on the same input (GPT-J, NeoX)
    residual: bool = True  # False drops the skip connections: x = branch(x) (an ablation)


@dataclass
class Seq2SeqConfig:
    """model.kind=encoder_decoder only (T5, BART): decoder depth, special ids, BART/T5 options."""

    n_decoder_layers: int | None = None  # None: n_layers (the encoder's depth)
    pad_token_id: int | None = None  # fills -100 targets in decoder inputs; None: not set
    decoder_start_token_id: int | None = None  # first decoder input (T5: pad, BART: eos)
    eos_token_id: int | None = None  # generation stops here
    scale_embedding: bool = False  # token embeddings * sqrt(d_model) (Vaswani et al. 2017)
    embed_norm: bool = False  # a norm after embeddings + positions (BART layernorm_embedding)
    final_logits_bias: bool = False  # a (V,) buffer added to the logits (BART)
    scale_decoder_output: bool = False  # decoder output * d_model**-0.5 before the head (T5)


@dataclass
class ModelConfig:
    """A Transformer language model. ``vocab_size`` None means: take it from the tokenizer."""

    kind: str = "decoder"
    vocab_size: int | None = None
    d_model: int = 256
    n_layers: int = 6
    max_seq_len: int = 256  # context window, tokens
    dropout: float = 0.0  # on embeddings and residual branches
    tie_embeddings: bool = True  # lm_head shares the token-embedding matrix (Press & Wolf 2017)
    final_norm: bool = True
    init: str = "gpt2"  # weight initialisation scheme (lmlab list init)
    init_std: float = 0.02  # the schemes' base standard deviation
    # token embeddings * sqrt(d_model) before positions are added (Vaswani et al. 2017), decoder
    # and encoder; None: true for position.kind=sinusoidal (whose amplitude-1 table otherwise
    # drowns std-0.02 embeddings), false otherwise. encoder_decoder: seq2seq.scale_embedding.
    scale_embedding: bool | None = None
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    position: PositionConfig = field(default_factory=PositionConfig)
    norm: NormConfig = field(default_factory=NormConfig)
    ffn: FFNConfig = field(default_factory=FFNConfig)
    block: BlockConfig = field(default_factory=BlockConfig)
    seq2seq: Seq2SeqConfig = field(default_factory=Seq2SeqConfig)  # kind=encoder_decoder only

    # kind=encoder only (BERT, Devlin et al. 2019): segment (token-type) embeddings, 0 for none;
    # the pooler (dense + tanh on the first token); the masked-LM head over the vocabulary.
    type_vocab_size: int = 2
    pooler: bool = True
    mlm_head: bool = True

    @property
    def embed_scale(self) -> float:
        """The factor on the token embeddings of a decoder or encoder: sqrt(d_model) or 1."""
        scale = self.scale_embedding
        if scale is None:
            scale = self.position.kind == "sinusoidal"
        return math.sqrt(self.d_model) if scale else 1.0

    @property
    def head_dim(self) -> int:
        return self.attention.head_dim or self.d_model // self.attention.n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.attention.n_kv_heads or self.attention.n_heads

    @property
    def d_ff(self) -> int:
        if self.ffn.d_ff:
            return self.ffn.d_ff
        d_ff = 4 * self.d_model
        if self.ffn.two_thirds:
            m = self.ffn.multiple_of
            d_ff = m * -(-(2 * d_ff // 3) // m)
        return d_ff


# ----------------------------------------------------------------------------- data and train


@dataclass
class TokenizerConfig:
    """char: one token per Unicode character of the corpus. bpe: byte-level BPE (train split)."""

    kind: str = "char"  # char | bpe | wordlevel (whole words and punctuation, for MLM)
    vocab_size: int = 2048  # bpe and wordlevel (bpe: includes the 256 byte tokens, specials)
    # Named set of special tokens (lmlab.data.tokenizer.SPECIAL_TOKEN_SETS): bert ([PAD] [UNK]
    # [CLS] [SEP] [MASK]) or seq2seq (<pad> <unk> <s> </s>); None: char none, bpe only
    # <|endoftext|>, wordlevel bert.
    special_tokens: str | None = None


@dataclass
class DataConfig:
    """Where the text comes from and how it becomes tokens.

    ``corpus``: a bundled corpus name (``tinyshakespeare``), a UTF-8 text file (its last
    ``val_fraction`` is validation), or a folder with ``train.txt``, ``valid.txt`` and optionally
    ``test.txt``.
    """

    corpus: str = "tinyshakespeare"
    val_fraction: float = 0.1
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping. Steps are optimizer steps; times are wall-clock seconds."""

    max_steps: int = 750
    batch_size: int = 16  # sequences per micro-batch
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    seq_len: int | None = None  # None: model.max_seq_len
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    lr_decay_steps: int | None = None  # cosine decay length; None: max_steps at the run's start
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    max_skipped_steps: int = 3  # consecutive NaN/Inf loss or gradient steps skipped, then stop
    eval_every: int = 250
    eval_batches: int = 20
    log_every: int = 10
    checkpoint_every: int | None = None  # steps; None: by time only
    checkpoint_interval_s: float = 60.0  # also checkpoint when this much time has passed
    keep_checkpoints: int = 3
    seed: int = 1337
    precision: str = "bf16"  # bf16 (autocast) | fp32
    compile: bool = False  # torch.compile the model
    device: str = "auto"
    parallel: str = "ddp"  # under torchrun: ddp (replicas) | fsdp (FSDP2 shards, DCP checkpoints)
    # training objective (lmlab.training.objectives): clm | mlm; None: the model kind's own
    # (decoder clm, encoder mlm)
    objective: str | None = None
    mask_prob: float = 0.15  # mlm: fraction of (non-special) tokens selected for prediction
    whole_word_mask: bool = False  # mlm: select whole words (all their tokens) at once


@dataclass
class RunConfig:
    """Everything that defines a run. ``name`` names the default run folder ``runs/<name>``."""

    name: str = "minigpt"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> RunConfig:
        """Check kinds and cross-field rules; return self. Raises :class:`ConfigError`."""
        validate_run_config(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- dict <-> dataclass

C = TypeVar("C")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {short_repr(value)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a section (mapping), got {short_repr(value)}")
        return _from_dict(tp, value, where)  # type: ignore[arg-type]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:  # YAML 1.1 reads "3e-4" (no dot) as a string
            return float(value) if isinstance(value, str) else _fail(tp, value, where)
        except ValueError:
            pass
    elif tp is str and isinstance(value, str):
        return value
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {short_repr(value)}")


def _fail(tp: Any, value: Any, where: str) -> Any:
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {short_repr(value)}")


def _from_dict(cls: type[C], data: dict[str, Any], prefix: str) -> C:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            hint = _did_you_mean(cls, str(key), prefix)
            extra = f" (did you mean {hint!r}?)" if hint else ""
            raise ConfigError(f"unknown config field {where!r}{extra}; allowed: {', '.join(names)}")
        kwargs[key] = _coerce(value, hints[key], where)
    return cls(**kwargs)


def _leaf_fields(cls: type, prefix: str) -> list[tuple[str, str]]:
    """(dotted path, field name) of every field in the nested sections of ``cls``."""
    out: list[tuple[str, str]] = []
    for name, tp in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            path = f"{prefix}.{name}" if prefix else name
            out += [(f"{path}.{leaf}", leaf) for leaf in _field_names(tp)]
            out += _leaf_fields(tp, path)
    return out


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _did_you_mean(cls: type, key: str, prefix: str) -> str | None:
    """The field meant by an unknown ``key`` of section ``cls`` (at ``prefix``): a field of the
    section by its bare name, or a field of a section nested in it by its dotted path
    (``model.n_heads`` -> ``model.attention.n_heads``), whichever is spelt closest (a nested
    field spelt exactly ``key`` wins)."""
    names = _field_names(cls)
    nested = _leaf_fields(cls, prefix)
    exact = [path for path, leaf in nested if leaf == key]
    if exact:
        return exact[0]
    candidates = {name: name for name in names}
    for path, leaf in nested:
        candidates.setdefault(leaf, path)
    best = difflib.get_close_matches(key, list(candidates), n=1)
    return candidates[best[0]] if best else None


def config_from_dict(data: dict[str, Any] | None) -> RunConfig:
    """Build a :class:`RunConfig` from nested dicts; missing fields keep their defaults."""
    return _from_dict(RunConfig, data or {}, "")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (or the defaults when ``path`` is None), apply ``--set`` overrides.

    Each override is ``dotted.key=value``; the value is parsed as YAML (``8``, ``true``, ``null``).
    The file must be a regular file of at most :data:`CONFIG_MAX_BYTES`, parsed by
    :func:`lmlab.safeio.parse_yaml` (duplicate keys refused, aliases bounded). Raises
    :class:`ConfigError` naming the file or field at fault (a bad field of the file (not one
    set by an override) names both: ``config file PATH: model.d_model: ...``).
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        loaded = read_yaml(p, "config file")
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping with model/data/train sections")
        data = loaded or {}
        data.setdefault("name", p.stem)
    for item in overrides or []:
        apply_override(data, item)
    try:
        return config_from_dict(data).validate()
    except ConfigError as e:  # a field of the file: the message names the file too
        keys = [item.split("=", 1)[0].strip() for item in overrides or []]
        if path is None or str(path) in str(e) or any(k and k in str(e) for k in keys):
            raise
        raise ConfigError(f"config file {path}: {e}") from None


# ----------------------------------------------------------------------------- YAML in, bounded

CONFIG_MAX_BYTES = 1 << 20  # a config or experiment file: shipped ones are under 4 KiB


def read_yaml(path: str | Path, what: str = "config file") -> Any:
    """A config or experiment file: :func:`lmlab.safeio.read_yaml` of a regular UTF-8 file of at
    most :data:`CONFIG_MAX_BYTES` (duplicate keys refused, aliases bounded). Raises ConfigError."""
    from lmlab.safeio import read_yaml as read

    return read(path, what, CONFIG_MAX_BYTES, ConfigError)


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one ``dotted.key=value`` override to a nested dict in place."""
    if "=" not in item:
        raise ConfigError(f"--set expects dotted.key=value, got {item!r}")
    key, raw = item.split("=", 1)
    value: Any = raw
    if raw.strip() and is_yaml(raw):  # else the text itself (a path with ': ' in it ...)
        value = parse_yaml(raw, f"--set {key.strip()}", ConfigError)
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def config_to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write ``cfg`` as YAML atomically (a resumed run rewrites it; a kill never truncates it)."""
    from lmlab.fsutil import atomic_write_text

    atomic_write_text(path, config_to_yaml(cfg))


def diff_configs(a: RunConfig, b: RunConfig) -> list[str]:
    """Dotted names of the fields whose values differ between two configs."""
    out: list[str] = []

    def walk(x: Any, y: Any, prefix: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in x.keys() | y.keys():
                walk(x.get(k), y.get(k), f"{prefix}.{k}" if prefix else k)
        elif x != y:
            out.append(prefix)

    walk(a.to_dict(), b.to_dict(), "")
    return sorted(out)


# ----------------------------------------------------------------------------- ranges


@dataclass(frozen=True)
class Range:
    """An interval of allowed values: ``[low, high]``, either end open when its flag says so."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:  # False for NaN
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return bool(above and below)

    def __str__(self) -> str:
        def num(x: float) -> str:
            return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"

        lo, hi = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"{lo}{num(self.low)}, {num(self.high)}{hi}"


MAX_TOKENS = 1 << 24  # context lengths, windows, positions (16,777,216 tokens)
MAX_VOCAB = 1 << 22  # vocabulary sizes and token ids (4,194,304; the largest real vocab: ~260k)
MAX_STEPS = 10**9  # optimizer-step counts and intervals
MAX_WIDTH = 1 << 16  # d_model, d_ff, head counts x head_dim stay far below this
_UNIT, _PROB = Range(0, 1, high_open=True), Range(0, 1, low_open=True, high_open=True)


def _positive_up_to(high: float) -> Range:
    return Range(0, high, low_open=True)


def _count(low: int, high: int) -> Range:
    return Range(low, high)


# Every int or float field of RunConfig with its allowed interval; checked by check_ranges after
# the cross-field rules (tests/unit/test_config.py fails for a numeric field missing here).
FIELD_RANGES: dict[str, Range] = {
    "model.vocab_size": _count(1, MAX_VOCAB),
    "model.d_model": _count(1, MAX_WIDTH),
    "model.n_layers": _count(1, 1024),
    "model.max_seq_len": _count(1, MAX_TOKENS),
    "model.dropout": _UNIT,
    "model.init_std": _positive_up_to(1.0),
    "model.attention.n_heads": _count(1, 1024),
    "model.attention.n_kv_heads": _count(1, 1024),
    "model.attention.head_dim": _count(1, 4096),
    "model.attention.dropout": _UNIT,
    "model.attention.window": _count(1, MAX_TOKENS),
    "model.position.rope_theta": _positive_up_to(1e12),
    "model.position.partial_rotary_factor": Range(0, 1, low_open=True),
    "model.position.scaling.factor": Range(1, 1e4),
    "model.position.scaling.original_max_seq_len": _count(1, MAX_TOKENS),
    "model.position.scaling.beta_fast": _positive_up_to(1e6),
    "model.position.scaling.beta_slow": _positive_up_to(1e6),
    "model.position.scaling.attention_factor": _positive_up_to(1e3),
    "model.position.scaling.mscale": _positive_up_to(1e3),
    "model.position.scaling.mscale_all_dim": _positive_up_to(1e3),
    "model.position.offset": _count(0, 1 << 16),
    "model.position.num_buckets": _count(1, 1 << 16),
    "model.position.max_distance": _count(1, MAX_TOKENS),
    "model.norm.eps": _positive_up_to(0.1),
    "model.ffn.d_ff": _count(1, 1 << 20),
    "model.ffn.multiple_of": _count(1, 1 << 16),
    "model.ffn.n_experts": _count(1, 4096),
    "model.ffn.top_k": _count(1, 4096),
    "model.ffn.aux_loss_coef": Range(0, 100),
    "model.ffn.z_loss_coef": Range(0, 100),
    "model.seq2seq.n_decoder_layers": _count(1, 1024),
    "model.seq2seq.pad_token_id": _count(0, MAX_VOCAB - 1),
    "model.seq2seq.decoder_start_token_id": _count(0, MAX_VOCAB - 1),
    "model.seq2seq.eos_token_id": _count(0, MAX_VOCAB - 1),
    "model.type_vocab_size": _count(0, 1024),
    "data.val_fraction": _PROB,
    "data.tokenizer.vocab_size": _count(1, MAX_VOCAB),
    "train.max_steps": _count(1, MAX_STEPS),
    "train.batch_size": _count(1, 1 << 16),
    "train.grad_accum_steps": _count(1, 1 << 16),
    "train.seq_len": _count(1, MAX_TOKENS),
    "train.lr": _positive_up_to(10.0),
    "train.min_lr": Range(0, 10.0),
    "train.warmup_steps": _count(0, MAX_STEPS),
    "train.lr_decay_steps": _count(1, MAX_STEPS),
    "train.weight_decay": Range(0, 10.0),
    "train.beta1": _UNIT,
    "train.beta2": _UNIT,
    "train.grad_clip": Range(0, 1e6),
    "train.max_skipped_steps": _count(0, 10**6),
    "train.eval_every": _count(1, MAX_STEPS),
    "train.eval_batches": _count(1, 10**6),
    "train.log_every": _count(1, MAX_STEPS),
    "train.checkpoint_every": _count(1, MAX_STEPS),
    "train.checkpoint_interval_s": _positive_up_to(1e9),
    "train.keep_checkpoints": _count(1, 10**6),
    "train.seed": Range(0, 2**32, high_open=True),
    "train.mask_prob": _PROB,
}


def numeric_fields(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Dotted names of every int or float field (optional ones included) of ``cls``."""
    out: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += numeric_fields(tp, f"{prefix}{f.name}.")  # type: ignore[arg-type]
        elif {int, float} & set(typing.get_args(tp) or (tp,)):
            out.append(prefix + f.name)
    return out


def check_ranges(cfg: RunConfig) -> None:
    """Refuse a numeric field outside its :data:`FIELD_RANGES` interval (NaN and inf included;
    None, where a field allows it, means "derived" and is not checked). Raises ConfigError."""
    for name, allowed in FIELD_RANGES.items():
        value: Any = cfg
        for part in name.split("."):
            value = getattr(value, part)
        if value is not None and value not in allowed:
            raise ConfigError(f"{name} must be in {allowed}, got {value}")


# ----------------------------------------------------------------------------- validation


def _positive(value: int | float | None, where: str, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value != value:  # NaN passes every comparison below
        raise ConfigError(f"{where} must be a number, got nan")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{where} must be {bound}, got {value}")


def _choice(value: str, allowed: list[str], where: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{where}: {value!r} is not allowed; allowed: {', '.join(allowed)}")


def _validate_attention_mask(m: ModelConfig) -> None:
    from lmlab.nn.masks import MASKS

    a = m.attention
    MASKS.get(a.mask, "model.attention.mask")
    if a.mask != "sliding_window":
        if a.window is not None:
            raise ConfigError(
                f"model.attention.window ({a.window}) is only used by "
                f"model.attention.mask=sliding_window (the mask is {a.mask!r}); remove it"
            )
    elif a.window is None:
        raise ConfigError(
            "model.attention.window must be set for model.attention.mask=sliding_window "
            "(tokens a query sees, itself included; an integer in [1, model.max_seq_len])"
        )
    elif not 1 <= a.window <= m.max_seq_len:
        raise ConfigError(
            f"model.attention.window must be in [1, model.max_seq_len={m.max_seq_len}], got "
            f"{a.window} (a window wider than the context is causal attention: use mask=causal)"
        )
    if a.kind == "linear" and a.mask not in ("causal", "bidirectional"):
        raise ConfigError(
            f"model.attention.kind=linear supports model.attention.mask causal or bidirectional, "
            f"got {a.mask!r} (a sliding window has no constant-size recurrent state)"
        )
    if a.kind == "linear" and not a.scaled:
        raise ConfigError(
            "model.attention.scaled=false has no effect with model.attention.kind=linear (linear "
            "attention has no 1/sqrt(d_k) factor); remove it or use kind=softmax"
        )


def _validate_position(m: ModelConfig) -> None:
    """RoPE options: rotary dim, theta, and the scaling kind with its parameters."""
    from lmlab.nn.rope_scaling import ROPE_SCALING

    p, s = m.position, m.position.scaling
    if m.kind == "encoder_decoder" and m.scale_embedding is not None:
        raise ConfigError(
            "model.scale_embedding applies to kind=decoder and encoder; an encoder_decoder "
            "sets model.seq2seq.scale_embedding"
        )
    ROPE_SCALING.get(s.kind, "model.position.scaling.kind")
    default = PositionConfig()
    _validate_position_tables(m)
    if p.kind != "rope":
        for name in ("interleaved", "partial_rotary_factor", "scaling"):
            if getattr(p, name) != getattr(default, name):
                raise ConfigError(f"model.position.{name} applies to kind=rope only, not {p.kind}")
        return
    _positive(p.rope_theta, "model.position.rope_theta")
    if not 0.0 < p.partial_rotary_factor <= 1.0:
        raise ConfigError(
            f"model.position.partial_rotary_factor must be in (0, 1], got {p.partial_rotary_factor}"
        )
    r = int(m.head_dim * p.partial_rotary_factor)
    if r < 2 or r % 2:
        raise ConfigError(
            f"model.position.kind=rope needs an even number (>= 2) of rotated channels, "
            f"int(head_dim * partial_rotary_factor) = int({m.head_dim} * "
            f"{p.partial_rotary_factor}) = {r}"
        )
    where = "model.position.scaling"
    used = {  # the fields each kind reads; yarn reads them all
        "none": ("kind",),
        "linear": ("kind", "factor"),
        "ntk": ("kind", "factor"),
        "dynamic_ntk": ("kind", "factor", "original_max_seq_len"),
    }.get(s.kind)
    for f in dataclasses.fields(s):
        value = getattr(s, f.name)
        if used is not None and f.name not in used and value != getattr(default.scaling, f.name):
            raise ConfigError(f"{where}.{f.name}={value} has no effect with {where}.kind={s.kind}")
    if s.kind == "none":
        return
    if not 1.0 <= s.factor < float("inf"):  # NaN and inf gave NaN losses
        raise ConfigError(
            f"{where}.factor must be >= 1 and finite (new length / original), got {s.factor}"
        )
    _positive(s.original_max_seq_len, f"{where}.original_max_seq_len")
    if s.kind in ("ntk", "dynamic_ntk") and r <= 2:
        raise ConfigError(f"{where}.kind={s.kind} needs more than 2 rotated channels, got {r}")
    if s.kind == "yarn":
        _positive(s.beta_slow, f"{where}.beta_slow")
        if s.beta_fast <= s.beta_slow:
            raise ConfigError(
                f"{where}.beta_fast ({s.beta_fast}) must exceed {where}.beta_slow ({s.beta_slow})"
            )
        _positive(s.attention_factor, f"{where}.attention_factor")
        _positive(s.mscale, f"{where}.mscale")
        _positive(s.mscale_all_dim, f"{where}.mscale_all_dim")
        if (s.mscale is None) != (s.mscale_all_dim is None):
            raise ConfigError(f"{where}.mscale and {where}.mscale_all_dim must be set together")


def _validate_position_tables(m: ModelConfig) -> None:
    """learned's offset and t5_relative's buckets: each applies to its own kind only."""
    p, default = m.position, PositionConfig()
    owner = {"offset": "learned", "num_buckets": "t5_relative", "max_distance": "t5_relative"}
    for name, kind in owner.items():
        if p.kind != kind and getattr(p, name) != getattr(default, name):
            raise ConfigError(f"model.position.{name} applies to kind={kind} only, not {p.kind}")
    _positive(p.offset, "model.position.offset", allow_zero=True)
    if p.kind == "t5_relative":
        if p.num_buckets < 4 or p.num_buckets % 2:
            raise ConfigError(
                f"model.position.num_buckets must be even and >= 4, got {p.num_buckets}"
            )
        if p.max_distance <= p.num_buckets // 2:
            raise ConfigError(
                f"model.position.max_distance ({p.max_distance}) must exceed num_buckets / 2 "
                f"({p.num_buckets // 2}): half the buckets hold exact distances below it"
            )
        if m.attention.kind != "softmax":
            raise ConfigError(
                "model.position.kind=t5_relative adds a bias to attention scores: it needs "
                f"model.attention.kind=softmax, not {m.attention.kind}"
            )


def _validate_seq2seq(m: ModelConfig) -> None:
    """model.seq2seq applies to kind=encoder_decoder, which has its own block and mask rules."""
    s = m.seq2seq
    if m.kind != "encoder_decoder":
        if s != Seq2SeqConfig():
            raise ConfigError(
                f"model.seq2seq applies to model.kind=encoder_decoder only, not {m.kind}"
            )
        return
    _positive(s.n_decoder_layers, "model.seq2seq.n_decoder_layers")
    for name in ("pad_token_id", "decoder_start_token_id", "eos_token_id"):
        value = getattr(s, name)
        _positive(value, f"model.seq2seq.{name}", allow_zero=True)
        if value is not None and m.vocab_size is not None and value >= m.vocab_size:
            raise ConfigError(
                f"model.seq2seq.{name} ({value}) must be < model.vocab_size ({m.vocab_size})"
            )
    _choice(m.block.kind, ["pre", "post"], "model.block.kind (encoder_decoder)")
    if m.block.parallel:
        raise ConfigError("model.block.parallel is not supported by model.kind=encoder_decoder")
    _choice(m.attention.kind, ["softmax"], "model.attention.kind (encoder_decoder)")
    _choice(m.attention.mask, ["causal"], "model.attention.mask (encoder_decoder: the decoder's)")
    _choice(m.ffn.kind, [k for k in ("mlp", "swiglu", "geglu", "gated")], "model.ffn.kind")


def _validate_encoder(m: ModelConfig) -> None:
    """The encoder-only fields: set only with kind=encoder, which needs bidirectional attention."""
    default = ModelConfig()
    if m.kind != "encoder":
        for name in ("type_vocab_size", "pooler", "mlm_head"):
            if getattr(m, name) != getattr(default, name):
                raise ConfigError(f"model.{name} applies to model.kind=encoder only, not {m.kind}")
        return
    _positive(m.type_vocab_size, "model.type_vocab_size", allow_zero=True)
    if m.attention.mask != "bidirectional":
        raise ConfigError(
            f"model.kind=encoder needs model.attention.mask=bidirectional (every token sees the "
            f"whole sequence), got {m.attention.mask!r}"
        )


def validate_run_config(cfg: RunConfig) -> None:
    """Cross-field checks; every message names the dotted field and the allowed values."""
    from lmlab import nn as lnn  # registers every component
    from lmlab.models.build import MODELS

    if not cfg.name or cfg.name in (".", "..") or any(c in cfg.name for c in "/\\\0"):
        raise ConfigError(f"name: {cfg.name!r} must be a plain folder name (no slashes)")
    m = cfg.model
    MODELS.get(m.kind, "model.kind")
    lnn.ATTENTION.get(m.attention.kind, "model.attention.kind")
    lnn.POSITION.get(m.position.kind, "model.position.kind")
    lnn.NORM.get(m.norm.kind, "model.norm.kind")
    lnn.FFN.get(m.ffn.kind, "model.ffn.kind")
    lnn.BLOCK.get(m.block.kind, "model.block.kind")
    from lmlab.models.init import INIT

    INIT.get(m.init, "model.init")
    if m.block.parallel and m.block.kind != "pre":
        raise ConfigError(
            f"model.block.parallel needs model.block.kind=pre (got {m.block.kind!r}): a parallel "
            "block normalises each branch's input"
        )
    _choice(m.ffn.activation, sorted(lnn.ACTIVATIONS), "model.ffn.activation")
    _choice(m.attention.backend, list(lnn.ATTENTION_BACKENDS), "model.attention.backend")
    _validate_attention_mask(m)
    for name in ("d_model", "n_layers", "max_seq_len", "vocab_size"):
        _positive(getattr(m, name), f"model.{name}")
    _positive(m.attention.n_heads, "model.attention.n_heads")
    _positive(m.attention.n_kv_heads, "model.attention.n_kv_heads")
    _positive(m.attention.head_dim, "model.attention.head_dim")
    _positive(m.ffn.d_ff, "model.ffn.d_ff")
    _positive(m.ffn.multiple_of, "model.ffn.multiple_of")
    lnn.ROUTERS.get(m.ffn.router, "model.ffn.router")
    _choice(m.ffn.expert, [k for k in lnn.FFN.names() if k != "moe"], "model.ffn.expert")
    _positive(m.ffn.n_experts, "model.ffn.n_experts")
    _positive(m.ffn.top_k, "model.ffn.top_k")
    if m.ffn.top_k > m.ffn.n_experts:
        raise ConfigError(
            f"model.ffn.top_k ({m.ffn.top_k}) must not exceed model.ffn.n_experts "
            f"({m.ffn.n_experts})"
        )
    _positive(m.ffn.aux_loss_coef, "model.ffn.aux_loss_coef", allow_zero=True)
    _positive(m.ffn.z_loss_coef, "model.ffn.z_loss_coef", allow_zero=True)
    _positive(m.init_std, "model.init_std")
    for name, value in (
        ("model.dropout", m.dropout),
        ("model.attention.dropout", m.attention.dropout),
    ):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{name} must be in [0, 1), got {value}")
    if m.attention.head_dim is None and m.d_model % m.attention.n_heads:
        raise ConfigError(
            f"model.d_model ({m.d_model}) must be divisible by model.attention.n_heads "
            f"({m.attention.n_heads}), or set model.attention.head_dim"
        )
    if m.attention.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.attention.n_heads ({m.attention.n_heads}) must be a multiple of "
            f"model.attention.n_kv_heads ({m.n_kv_heads})"
        )
    _validate_position(m)
    _validate_seq2seq(m)

    _validate_encoder(m)

    d = cfg.data
    from lmlab.data.tokenizer import TOKENIZERS

    TOKENIZERS.get(d.tokenizer.kind, "data.tokenizer.kind")
    if d.tokenizer.special_tokens is not None:
        from lmlab.data.tokenizer import SPECIAL_TOKEN_SETS

        _choice(
            d.tokenizer.special_tokens, list(SPECIAL_TOKEN_SETS), "data.tokenizer.special_tokens"
        )
        if d.tokenizer.kind == "char":
            raise ConfigError("data.tokenizer.special_tokens needs kind bpe or wordlevel, not char")
    if d.tokenizer.kind == "bpe" and d.tokenizer.vocab_size < 258:
        raise ConfigError(
            f"data.tokenizer.vocab_size must be >= 258 for bpe (256 bytes + <|endoftext|> + 1 "
            f"merge), got {d.tokenizer.vocab_size}"
        )
    if not 0.0 < d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be in (0, 1), got {d.val_fraction}")
    if not d.corpus:
        raise ConfigError("data.corpus must name a bundled corpus, a text file or a folder")

    t = cfg.train
    for name in ("max_steps", "batch_size", "grad_accum_steps", "eval_every", "eval_batches"):
        _positive(getattr(t, name), f"train.{name}")
    for name in ("log_every", "keep_checkpoints", "checkpoint_every", "lr_decay_steps"):
        _positive(getattr(t, name), f"train.{name}")
    _positive(t.seq_len, "train.seq_len")
    _positive(t.lr, "train.lr")
    _positive(t.min_lr, "train.min_lr", allow_zero=True)
    _positive(t.warmup_steps, "train.warmup_steps", allow_zero=True)
    _positive(t.weight_decay, "train.weight_decay", allow_zero=True)
    _positive(t.grad_clip, "train.grad_clip", allow_zero=True)
    _positive(t.max_skipped_steps, "train.max_skipped_steps", allow_zero=True)
    _positive(t.checkpoint_interval_s, "train.checkpoint_interval_s")
    if (
        not 0 <= t.seed < 2**32
    ):  # NumPy refuses < 0; seed x 1,000,003 + ... must fit torch's 64 bits
        raise ConfigError(f"train.seed must be an integer in 0..{2**32 - 1}, got {t.seed}")
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr ({t.min_lr}) must not exceed train.lr ({t.lr})")
    for name, beta in (("train.beta1", t.beta1), ("train.beta2", t.beta2)):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"{name} must be in [0, 1), got {beta}")
    if t.seq_len is not None and t.seq_len > m.max_seq_len:
        raise ConfigError(
            f"train.seq_len ({t.seq_len}) must not exceed model.max_seq_len ({m.max_seq_len})"
        )
    _choice(t.precision, ["bf16", "fp32"], "train.precision")
    _choice(t.device, ["auto", "cpu", "cuda", "mps"], "train.device")
    _choice(t.parallel, ["ddp", "fsdp"], "train.parallel")
    from lmlab.training.objectives import OBJECTIVES, objective_name

    name = objective_name(cfg)
    if t.objective is not None or name in OBJECTIVES.names():  # a kind's default may come later
        OBJECTIVES.get(name, "train.objective").validate_config(cfg)
    if name != "mlm":
        for name in ("mask_prob", "whole_word_mask"):
            if getattr(t, name) != getattr(TrainConfig(), name):
                raise ConfigError(f"train.{name} applies to train.objective=mlm only")
    check_ranges(cfg)  # last: the rules above give the more specific messages
