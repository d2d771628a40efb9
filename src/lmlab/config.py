"""Typed run configuration: ``model``, ``data`` and ``train`` sections, YAML in and out.

Each component family is a sub-section chosen by its ``kind`` (``model.position.kind: rope``).
:func:`config_from_dict` rejects an unknown field or a value of the wrong type with a message that
names the dotted field and lists what is allowed; :meth:`RunConfig.validate` then checks the kinds
against the component registries, each variant's own rules and the cross-field rules
(:mod:`lmlab.validation`, which sits above the components).

This module is the schema only: it imports no component (nn, models, data, training, interop).
A variant may add fields to its section (:attr:`lmlab.registry.Contract.fields`); they are found
through :func:`lmlab.registry.families` by the family's field (``model.position.kind`` for the
section ``model.position``), parsed, read as attributes and written back like the fields here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import yaml

from lmlab.config_fields import VariantSection, from_dict, section_dict
from lmlab.config_fields import variant_fields as variant_fields  # re-exported
from lmlab.errors import ConfigError
from lmlab.safeio import is_yaml, parse_yaml

if TYPE_CHECKING:  # for mypy; at run time module __getattr__ below loads them
    from lmlab.config_ranges import FIELD_RANGES as FIELD_RANGES
    from lmlab.config_ranges import MAX_STEPS as MAX_STEPS
    from lmlab.config_ranges import MAX_TOKENS as MAX_TOKENS
    from lmlab.config_ranges import MAX_VOCAB as MAX_VOCAB
    from lmlab.config_ranges import MAX_WIDTH as MAX_WIDTH
    from lmlab.config_ranges import Range as Range
    from lmlab.config_ranges import check_ranges as check_ranges
    from lmlab.config_ranges import numeric_fields as numeric_fields
    from lmlab.validation import validate_model as validate_model
    from lmlab.validation import validate_run_config as validate_run_config

# names that moved, still importable from here (loaded on first use: no import cycle)
_MOVED = {
    **dict.fromkeys(
        ("FIELD_RANGES", "MAX_STEPS", "MAX_TOKENS", "MAX_VOCAB", "MAX_WIDTH", "Range"),
        "lmlab.config_ranges",
    ),
    **dict.fromkeys(("check_ranges", "numeric_fields"), "lmlab.config_ranges"),
    **dict.fromkeys(("validate_run_config", "validate_model"), "lmlab.validation"),
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------- model sections


@dataclass
class AttentionConfig(VariantSection):
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
    _extra: dict[str, Any] = field(default_factory=dict, repr=False)  # variant fields
    _path: ClassVar[str] = "model.attention"


@dataclass
class RopeScalingConfig(VariantSection):
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
    _extra: dict[str, Any] = field(default_factory=dict, repr=False)  # variant fields
    _path: ClassVar[str] = "model.position.scaling"


@dataclass
class PositionConfig(VariantSection):
    """Positional encoding: none, sinusoidal, learned, alibi or rope."""

    kind: str = "rope"
    rope_theta: float = 10000.0  # RoPE base (Su et al. 2021)
    interleaved: bool = False  # rope: pair channels (2i, 2i+1) (GPT-J); False: (i, i+r/2) (Llama)
    partial_rotary_factor: float = 1.0  # rope: rotate only the first int(hd * this) channels
    scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)  # rope only
    offset: int = 0  # learned only: table rows before position 0 (BART: 2)
    num_buckets: int = 32  # t5_relative: relative-distance buckets per direction set (T5: 32)
    max_distance: int = 128  # t5_relative: distances >= this share the last bucket (T5: 128)
    _extra: dict[str, Any] = field(default_factory=dict, repr=False)  # variant fields
    _path: ClassVar[str] = "model.position"


@dataclass
class NormConfig(VariantSection):
    """Normalisation layer: layernorm or rmsnorm."""

    kind: str = "layernorm"
    eps: float = 1e-5
    bias: bool = True  # LayerNorm only
    _extra: dict[str, Any] = field(default_factory=dict, repr=False)  # variant fields
    _path: ClassVar[str] = "model.norm"


@dataclass
class FFNConfig(VariantSection):
    """Position-wise feed-forward network: mlp (up -> act -> down), swiglu, geglu or moe."""

    kind: str = "mlp"
    d_ff: int | None = None  # None: 4 * d_model (per expert for moe)
    activation: str = "gelu"  # mlp, gated (and an encoder's MLM head); swiglu/geglu refuse it
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
    _extra: dict[str, Any] = field(default_factory=dict, repr=False)  # variant fields
    _path: ClassVar[str] = "model.ffn"


@dataclass
class BlockConfig(VariantSection):
    """Norm placement in a layer: pre (Pre-Norm), post (Post-Norm) or hybrid (HybridNorm)."""

    kind: str = "pre"
    parallel: bool = False  # attention and FFN side by side on the same input (GPT-J, NeoX)
    residual: bool = True  # False drops the skip connections: x = branch(x) (an ablation)
    _extra: dict[str, Any] = field(default_factory=dict, repr=False)  # variant fields
    _path: ClassVar[str] = "model.block"


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
class ModelConfig(VariantSection):
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
    # zero the residual projections (attention o_proj, FFN down_proj) after the init scheme:
    # every block starts as the identity (modded-nanogpt); needs block.residual
    init_zero_residual: bool = False
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

    _extra: dict[str, Any] = field(default_factory=dict, repr=False)  # variant fields
    _path: ClassVar[str] = "model"

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
class TokenizerConfig(VariantSection):
    """char: one token per Unicode character of the corpus. bpe: byte-level BPE (train split)."""

    kind: str = "char"  # char | bpe | wordlevel (whole words and punctuation, for MLM)
    vocab_size: int = 2048  # bpe and wordlevel (bpe: includes the 256 byte tokens, specials)
    # Named set of special tokens (lmlab.data.tokenizer.SPECIAL_TOKEN_SETS): bert ([PAD] [UNK]
    # [CLS] [SEP] [MASK]) or seq2seq (<pad> <unk> <s> </s>); None: char none, bpe only
    # <|endoftext|>, wordlevel bert.
    special_tokens: str | None = None
    _extra: dict[str, Any] = field(default_factory=dict, repr=False)  # variant fields
    _path: ClassVar[str] = "data.tokenizer"


@dataclass
class DataConfig:
    """Where the text comes from and how it becomes tokens.

    ``corpus``: a bundled corpus name (``tinyshakespeare``), a UTF-8 text file (its last
    ``val_fraction`` is validation), or a folder with ``train.txt``, ``valid.txt`` and optionally
    ``test.txt``.
    """

    corpus: str = "tinyshakespeare"
    val_fraction: float = 0.1
    # all | answers: the LM loss over every target, or over the answer tokens of a synthetic
    # corpus only (passkey, recall; lmlab.data.answers)
    loss_on: str = "all"
    # passkey corpus only: training (and val) distances uniform in [min, max] characters; None:
    # lmlab.data.passkey.MIN_DISTANCE / TRAIN_MAX_DISTANCE (20 / 224)
    passkey_min_distance: int | None = None
    passkey_max_distance: int | None = None
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
    optimizer: str = "adamw"  # adamw | muon (Muon on the blocks' matrices, AdamW on the rest)
    muon_lr: float = 0.02  # Muon's peak lr (the schedule scales it like train.lr)
    muon_momentum: float = 0.95  # Muon's Nesterov momentum
    muon_weight_decay: float = 0.01  # Muon's decoupled weight decay (x its lr per step)
    schedule: str = "cosine"  # cosine | wsd (warmup, constant, decay over the last steps)
    decay_fraction: float = 0.2  # wsd: share of the run's steps spent decaying to min_lr
    decay_shape: str = "linear"  # wsd: linear | sqrt (1 - sqrt, Hägele et al. 2024)
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    max_skipped_steps: int = 3  # consecutive NaN/Inf loss or gradient steps skipped, then stop
    eval_every: int = 250
    eval_batches: int = 20
    log_every: int = 10
    checkpoint_every: int | None = None  # steps; None: by time only
    checkpoint_interval_s: float = 60.0  # also checkpoint when this much time has passed
    keep_checkpoints: int = 3
    seed: int = 1337
    precision: str = "auto"  # bf16 (autocast) | fp32 | auto: bf16 where the device has bf16 units
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
        """Check kinds, each selected variant's rules and the cross-field rules
        (:func:`lmlab.validation.validate_run_config`); return self. Raises
        :class:`ConfigError`."""
        from lmlab.validation import validate_run_config

        validate_run_config(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dicts: every field, plus the fields the selected kinds declare."""
        return section_dict(self)


def config_from_dict(data: dict[str, Any] | None) -> RunConfig:
    """Build a :class:`RunConfig` from nested dicts; missing fields keep their defaults."""
    return from_dict(RunConfig, data or {}, "")


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
