"""``lmlab.load(path)``: an lmlab run folder or a Hugging Face model folder -> (model, tokenizer).

A Hugging Face folder holds ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``), optionally ``tokenizer.json``. Nothing is downloaded.

Everything in the folder is untrusted and checked before a tensor is allocated: ``config.json``
field by field (:mod:`lmlab.interop.hf_fields`), the lmlab model config it gives, every file the
folder or its index names (inside the folder; a symlink leading out is refused, except a Hugging
Face hub cache snapshot's links into its own ``blobs/``), each safetensors header (names, shapes
and dtypes against the model the config builds), and the bytes the load needs against the
memory available (:func:`lmlab.training.memory.check_load_memory`, cgroup limits included).
"""

from __future__ import annotations

import copy
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from lmlab.config import DataConfig, ModelConfig, RunConfig, TokenizerConfig
from lmlab.data.tokenizer import Tokenizer, load_tokenizer
from lmlab.errors import CheckpointError, ConfigError, DataError, LmlabError
from lmlab.interop.families import HFFamily, family_for
from lmlab.interop.hf_fields import check_hf_config
from lmlab.models.build import build_model
from lmlab.safeio import inside, read_json_object, regular_file
from lmlab.training.hardware import resolve_device
from lmlab.training.memory import check_load_memory
from lmlab.training.weights_fit import check_finite

MAX_SHARDS = 10_000
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _hub_blob(folder: Path, name: str) -> bool:
    """True when ``folder`` is a Hugging Face hub cache snapshot (``.../snapshots/<rev>``) and
    ``name`` links into that cache repository's own ``blobs/`` folder."""
    base = folder.resolve()
    rel = Path(name)
    if base.parent.name != "snapshots" or rel.is_absolute() or ".." in rel.parts:
        return False
    blobs = (base.parent.parent / "blobs").resolve()
    return blobs in (folder / rel).resolve().parents


def folder_file(folder: Path, name: str, what: str) -> Path:
    """``folder / name`` for a file the folder holds or one of its files names (``what`` says
    who names it). Raises CheckpointError for an absolute path, ``..``, or a path that leads
    outside ``folder`` through a symlink (a hub cache snapshot's links into its ``blobs/``
    excepted)."""
    try:
        return inside(folder, name, what, CheckpointError)
    except CheckpointError:
        if _hub_blob(folder, name):
            return folder / name
        if what != str(folder):
            raise
    raise CheckpointError(  # the folder's own file, a symlink leading out of it
        f"{folder / name} is a symlink leading outside {folder}; lmlab reads only files inside a "
        "model folder (copy the file in)"
    )


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a Hugging Face folder: the shards its
    ``model.safetensors.index.json`` names, else ``model.safetensors``. Raises CheckpointError
    for a malformed index, a file outside the folder, a missing or irregular file, or a folder
    with only pickled weights."""
    index = folder / "model.safetensors.index.json"
    if os.path.lexists(index):
        folder_file(folder, index.name, f"{folder}")
        raw = read_json_object(index, "shard index", error=CheckpointError)
        weight_map = raw.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(
                f"{index}: weight_map must be a non-empty object (tensor name -> file name)"
            )
        bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str)), None)
        if bad is not None:
            raise CheckpointError(f"{index}: weight_map[{bad[0]!r}] is {bad[1]!r}, not a file name")
        names = sorted(set(weight_map.values()))
        if len(names) > MAX_SHARDS:
            raise CheckpointError(f"{index} names {len(names):,} shards, more than {MAX_SHARDS:,}")
        files = [folder_file(folder, n, f"{index} weight_map") for n in names]
    elif os.path.lexists(folder / "model.safetensors"):
        files = [folder_file(folder, "model.safetensors", f"{folder}")]
    else:
        pickled = [n for n in ("pytorch_model.bin", "model.pt") if (folder / n).is_file()]
        hint = (
            f" ({pickled[0]} is a pickle, which lmlab never loads: it can run code; convert it "
            "to safetensors with a tool you trust)"
            if pickled
            else ""
        )
        raise CheckpointError(f"{folder} has config.json but no model.safetensors{hint}")
    for f in files:
        regular_file(f, "weight file", max_bytes=None, error=CheckpointError)
    return files


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a safetensors header describes it: its file, shape and dtype."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype

    def meta(self) -> torch.Tensor:
        """A tensor of this shape and dtype on the meta device (nothing allocated)."""
        return torch.empty(self.shape, dtype=self.dtype, device="meta")

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def read_headers(files: list[Path]) -> dict[str, StoredTensor]:
    """Every tensor's name, shape and dtype from the safetensors headers (no data read).
    Raises CheckpointError naming the file for a header the safetensors library refuses (too
    long, not JSON, offsets that do not fit), a dtype lmlab does not know, or a tensor in two
    files."""
    from safetensors import safe_open

    out: dict[str, StoredTensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for key in h.keys():  # noqa: SIM118 (a safe_open handle)
                    sl = h.get_slice(key)
                    dtype_name, shape = str(sl.get_dtype()), tuple(int(d) for d in sl.get_shape())
                    if dtype_name not in SAFETENSORS_DTYPES:
                        raise CheckpointError(
                            f"{f}: tensor {key} has dtype {dtype_name}, which lmlab does not load"
                        )
                    if key in out:
                        raise CheckpointError(
                            f"tensor {key} is stored twice, in {out[key].file} and {f}"
                        )
                    out[key] = StoredTensor(f, shape, SAFETENSORS_DTYPES[dtype_name])
        except LmlabError:
            raise
        except Exception as e:  # safetensors raises SafetensorError, OSError, ValueError ...
            raise CheckpointError(
                f"{f} is corrupt: not a readable safetensors file ({e})"
            ) from None
    return out


def read_hf_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face folder (single file or shards). Raises CheckpointError
    for an unreadable file or a floating-point tensor holding NaN or inf (naming the file and
    the tensor)."""
    sd: dict[str, torch.Tensor] = {}
    for f in weight_files(folder):
        try:
            part = load_file(str(f))
        except Exception as e:  # SafetensorError, OSError, MemoryError ...
            raise CheckpointError(f"{f} is corrupt: {e}") from None
        for name in sorted(part):
            check_finite(name, part[name], f)
        sd.update(part)
    return sd


def _check_shapes(
    tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], folder: Path
) -> None:
    """Raise CheckpointError naming the first tensor whose shape differs from the one its
    config.json implies (both shapes given)."""
    for key, want in expected.items():
        if key in tensors and tuple(tensors[key].shape) != tuple(want.shape):
            raise CheckpointError(
                f"{folder}: tensor {key} has shape {tuple(tensors[key].shape)} but config.json "
                f"implies {tuple(want.shape)}"
            )


def check_state(model: nn.Module, state: dict[str, torch.Tensor], folder: Path) -> None:
    """Raise CheckpointError for the first tensor of ``state`` (lmlab names) whose shape differs
    from ``model``'s (both shapes given), that holds integers where the model has a float
    weight, or that the model has no place for, and for the first weight it lacks."""
    expected = model.state_dict()
    for key, value in state.items():
        want = expected.get(key)
        if want is None:
            raise CheckpointError(
                f"{folder} does not fit its config.json: the model it describes has no {key}"
            )
        if tuple(value.shape) != tuple(want.shape):
            raise CheckpointError(
                f"{folder} does not fit its config.json: size mismatch for {key}: the file holds "
                f"shape {tuple(value.shape)}, the model config.json describes needs "
                f"{tuple(want.shape)}"
            )
        if want.is_floating_point() and not value.is_floating_point():
            raise CheckpointError(
                f"{folder}: tensor {key} is stored as {value.dtype} (shape {tuple(value.shape)}), "
                "not floating point as a weight must be"
            )
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(
            f"{folder} does not fit its config.json: it lacks tensor {missing[0]} (shape "
            f"{tuple(expected[missing[0]].shape)})"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        )


def _model_config(family: HFFamily, raw: dict[str, Any], path: Path) -> ModelConfig:
    """``family.to_config`` of ``raw``, its errors naming ``path``."""
    try:
        return family.to_config(SimpleNamespace(**raw))
    except AttributeError as e:  # a field the family needs is absent
        raise LmlabError(
            f"{path} lacks {getattr(e, 'name', None) or e!s}, which a "
            f"{raw.get('model_type')} config needs"
        ) from None
    except KeyError as e:
        raise LmlabError(f"{path} lacks {e}, which its settings need") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise LmlabError(f"{path} holds settings lmlab cannot read: {e}") from None


def _validate(cfg: ModelConfig, path: Path) -> None:
    """The lmlab model config a config.json gives, checked as ``lmlab train`` checks its own."""
    # a tokenizer setting that the training objective of the model's kind accepts: only the
    # model section is in question here
    specials = {"encoder": "bert", "encoder_decoder": "seq2seq"}.get(cfg.kind)
    data = DataConfig(tokenizer=TokenizerConfig(kind="wordlevel", special_tokens=specials))
    try:
        RunConfig(model=cfg, data=data).validate()
    except ConfigError as e:
        raise LmlabError(f"{path} describes a model lmlab cannot build: {e}") from None


def _to_state(
    family: HFFamily, tensors: dict[str, torch.Tensor], cfg: ModelConfig, folder: Path
) -> dict[str, torch.Tensor]:
    try:
        return family.to_state(tensors, cfg)
    except LmlabError as e:
        raise CheckpointError(f"{folder}: {e}") from None
    except (KeyError, IndexError, ValueError, RuntimeError) as e:  # a name or shape out of place
        raise CheckpointError(
            f"{folder}: its tensors do not fit the {family.model_type} layout "
            f"({type(e).__name__}: {e})"
        ) from None


# (LM head, embedding) as Hugging Face names them, for the families whose lmlab state converter
# honours model.tie_embeddings (Llama, Mistral, Qwen, Mixtral, DiffLlama, DeepSeek-V3; GPT-NeoX)
UNTIEABLE_HEADS: tuple[tuple[str, str], ...] = (  # (head, embedding) pairs
    ("lm_head.weight", "model.embed_tokens.weight"),
    ("lm_head.weight", "transformer.wte.weight"),  # GPT-2
    ("embed_out.weight", "gpt_neox.embed_in.weight"),
)
# families whose converter always ties the head (T5, BART): a distinct one is refused
TIED_ONLY_HEADS = {
    "lm_head.weight": ("shared.weight", "model.shared.weight"),
}


def untie_stored_head(
    cfg: ModelConfig, stored: dict[str, StoredTensor], config_path: Path
) -> ModelConfig:
    """``cfg`` untied when config.json sets ``tie_word_embeddings: true`` yet the weights hold an
    LM head that differs from the embedding: transformers then keeps both ("both are present in
    the checkpoints with different values, so we will NOT tie them"), and so does lmlab. A head
    equal to the embedding stays tied. For a family lmlab only loads tied (T5, BART)
    raises CheckpointError naming config.json's tie_word_embeddings and the tensor."""
    if not cfg.tie_embeddings:
        return cfg
    from safetensors import safe_open

    def read(name: str) -> torch.Tensor:
        with safe_open(str(stored[name].file), framework="pt") as f:
            return f.get_tensor(name)

    pairs = [(h, e, True) for h, e in UNTIEABLE_HEADS]
    pairs += [(h, e, False) for h, es in TIED_ONLY_HEADS.items() for e in es]
    for head, embed, can_untie in pairs:
        if head not in stored or embed not in stored:
            continue
        try:
            same = torch.equal(read(head), read(embed))
        except Exception as e:  # a corrupt file: shapes differ, bytes unreadable ...
            raise CheckpointError(f"{stored[head].file} is corrupt: {e}") from None
        if same:
            return cfg
        if not can_untie:
            raise CheckpointError(
                f"{config_path}: tie_word_embeddings is true but {stored[head].file} holds a "
                f"{head} that differs from {embed}; lmlab loads this family only with a tied "
                "head (set tie_word_embeddings to false only where the family supports it)"
            )
        untied = copy.deepcopy(cfg)
        untied.tie_embeddings = False
        return untied
    return cfg


def _model_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def not_a_model_file(p: Path) -> str:
    """Why a plain file is not something ``load`` takes (looks at its first bytes)."""
    with open(p, "rb") as fh:
        head = fh.read(9)
    if head[:4] == b"GGUF":
        kind = "a GGUF file lmlab cannot read"
    elif len(head) == 9 and head[8:9] == b"{":  # 8-byte header length, then the JSON header
        kind = (
            "a bare safetensors file: lmlab needs the folder holding it with its config.json "
            "(Hugging Face) or config.yaml (lmlab run)"
        )
    else:
        kind = "neither a model folder, a safetensors file nor a GGUF file"
    return (
        f"{p} is {kind}; lmlab loads an lmlab run folder, a Hugging Face model folder "
        "(config.json + model.safetensors) or a .gguf file"
    )


def load_hf_folder(folder: str | Path, device: str = "cpu") -> tuple[nn.Module, Tokenizer | None]:
    """Build the lmlab model of a Hugging Face folder and load its weights (strict).

    Checked before any tensor is allocated (the module docstring lists what). Raises LmlabError
    for an unsupported ``model_type``, a bad setting in config.json (naming the field) or a
    component lmlab lacks, and CheckpointError for missing, corrupt, misplaced or wrongly shaped
    weights (naming the tensor and both shapes) or a model too large for the memory available.
    """
    p = Path(folder)
    config_path = folder_file(p, "config.json", f"{p}")
    raw = read_json_object(config_path, "Hugging Face config")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        raise LmlabError(f"{config_path}: model_type is {model_type!r}, not a family name")
    family = family_for(model_type)
    check_hf_config(raw, config_path)
    if family.check_config is not None:
        family.check_config(raw, config_path)
    files = weight_files(p)
    stored = read_headers(files)
    meta = {k: t.meta() for k, t in stored.items()}
    cfg = _model_config(family, raw, config_path)
    if family.fit_config is not None:
        cfg = family.fit_config(cfg, meta)
    cfg = untie_stored_head(cfg, stored, config_path)
    _validate(cfg, config_path)
    with torch.device("meta"):  # shapes only: nothing is allocated
        skeleton = build_model(cfg)
    hf_expected = family.from_state(skeleton.state_dict(), cfg) if family.from_state else {}
    _check_shapes(meta, hf_expected, p)
    state = _to_state(family, meta, cfg, p)
    absent = sorted(k for k in hf_expected if k not in meta)
    if absent and set(skeleton.state_dict()) - set(state):  # name the tensor as the folder does
        raise CheckpointError(
            f"{p} lacks tensor {absent[0]} (shape {tuple(hf_expected[absent[0]].shape)}), which "
            "its config.json needs"
            + (f" ({len(absent) - 1} more missing)" if len(absent) > 1 else "")
        )
    check_state(skeleton, state, p)
    model_bytes = _model_bytes(skeleton)
    file_bytes = sum(t.nbytes for t in stored.values())
    check_load_memory(file_bytes + model_bytes, torch.device("cpu"), f"the model in {p}")
    if torch.device(device).type != "cpu":
        check_load_memory(model_bytes, torch.device(device), f"the model in {p}")
    tensors = read_hf_state_dict(p)
    model = build_model(cfg)
    model.load_state_dict(_to_state(family, tensors, cfg, p), strict=True)
    tokenizer = None
    if os.path.lexists(p / "tokenizer.json"):
        try:
            tokenizer = load_tokenizer(folder_file(p, "tokenizer.json", f"{p}"))
        except DataError as e:
            print(f"warning: {e}; loading the model without a tokenizer", file=sys.stderr)
    return model.to(device).eval(), tokenizer


def no_tokenizer(path: str | Path, use: str) -> LmlabError:
    """The error for a model at ``path`` that came without a tokenizer, needed to ``use`` text
    ("generated", "scored"): where a tokenizer.json is there but was refused (the warning above
    says why), the message says so rather than that there is none."""
    if os.path.lexists(Path(path) / "tokenizer.json"):
        return LmlabError(
            f"{path}: its tokenizer was refused (see the warning above), so text cannot be "
            f"{use} with it"
        )
    return LmlabError(f"{path} has no tokenizer, so text cannot be {use} with it")


def load(
    path: str | Path, device: str = "cpu", quantize: Any = None
) -> tuple[nn.Module, Tokenizer | None]:
    """Load ``(model, tokenizer)`` from an lmlab run folder (latest checkpoint), a Hugging Face
    model folder of a supported family (``lmlab list hf_family``) or a ``.gguf`` file of the
    llama or starcoder2 architecture (:mod:`lmlab.interop.gguf`: dequantized to float32,
    tokenizer and chat template from its metadata). The model is in eval mode;
    ``model(input_ids)`` returns an output whose ``.logits`` is (batch, seq, vocab).
    ``quantize`` (``"int8"``, ``"int4"``, ``"int4:64"``, with ``"+a8"`` for int8 activations,
    or a :class:`lmlab.nn.quant.QuantSpec`) then makes its linear layers weight-only quantized
    (:func:`lmlab.nn.quant.quantize_model`).

    Raises LmlabError (or a subclass) when the path is neither, or its files are damaged.
    """
    if quantize is not None:
        from lmlab.nn.quant import apply_quantization

        model, tokenizer = load(path, device)
        return apply_quantization(model, quantize), tokenizer
    p = Path(path)
    if (p / "config.yaml").is_file():
        from lmlab.run import load_run

        run = load_run(p, device)
        return run.model, run.tokenizer
    if p.exists():
        device = resolve_device(device).type  # "auto" -> cuda, mps or cpu
    if (p / "config.json").is_file():
        return load_hf_folder(p, device)
    if not p.exists():
        raise LmlabError(f"not found: {p}")
    if p.is_file():
        from lmlab.interop.gguf import is_gguf_file, load_gguf

        if is_gguf_file(p):
            return load_gguf(p, device)
        raise LmlabError(not_a_model_file(p))
    for name in ("config.yaml", "config.json"):
        if os.path.lexists(p / name):  # there, but not a regular file (FIFO, folder, link)
            raise LmlabError(
                f"{p / name} is not a regular file (a FIFO, folder, device or broken link); "
                "a model folder's config must be a plain file"
            )
    raise LmlabError(
        f"{p} is neither an lmlab run folder (config.yaml) nor a Hugging Face model folder "
        "(config.json + model.safetensors)"
    )
