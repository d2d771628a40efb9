"""``lmlab export MODEL --format gguf --out FILE.gguf [--quant f32|f16|q8_0|q4_0]``: one GGUF file
(llama.cpp's format) holding the model, its tokenizer and the metadata llama.cpp reads.

Architecture (``general.architecture``): the llama.cpp architecture whose forward pass is the
lmlab model's, chosen by :func:`gguf_architecture`:

- ``llama``: RMSNorm, SwiGLU without bias, no attention bias, Pre-Norm, RoPE over every channel,
  GQA (configs/llama.yaml). q/k rows are stored in llama.cpp's interleaved RoPE order
  (:func:`lmlab.interop.rope_layout.gguf_permute`, as its converter does).
- ``starcoder2``: LayerNorm, GELU MLP, sequential Pre-Norm, NeoX (half-split) RoPE over every
  channel, GQA: the default Mini-GPT (configs/minigpt.yaml). llama.cpp's starcoder2 requires a
  bias on every norm and linear layer, so the biases lmlab does not have (attention, and norms
  with ``model.norm.bias: false``) are written as zeros, which computes the same. llama.cpp
  computes its GELU with the tanh approximation: a model with the exact (erf) ``gelu`` is
  written as is, with ``lmlab.ffn.activation: gelu`` (lmlab's loader honours it, llama.cpp and
  transformers ignore it), and the logit gap llama.cpp's approximation makes is measured and
  reported (``tanh_gelu_max_abs_diff``).

Anything else (parallel blocks, partial rotary, learned positions, sliding windows, QK-norm,
MoE, other attention kinds ...) is refused by name: no llama.cpp architecture computes it.

Tokenizer: ``tokenizer.ggml.model: gpt2`` (byte-level BPE), which lmlab's own GGUF reader
(:mod:`lmlab.interop.gguf_tokenizer`) and llama.cpp both read. lmlab's ``bpe`` tokenizers are
written with their vocabulary and merges (``tokenizer.ggml.pre: gpt-2``, GPT-2's split, which
is what they were trained with) and <|endoftext|> as the end-of-text token. A character-level
tokenizer becomes the same vocabulary, each character written as its UTF-8 bytes in GPT-2's
byte characters; a character of several bytes is assembled by merges (:func:`char_merges`), an
ASCII one needs none (an all-ASCII vocabulary gets one placeholder merge that never applies,
since llama.cpp refuses a gpt2 vocabulary without merges). Every character then encodes to its
own id. ``lmlab.tokenizer.kind: char`` tells lmlab's reader to rebuild the character tokenizer.

Quantization (``--quant``): 2-D weights (embedding, projections) in the chosen type, 1-D tensors
(norms, biases) in F32, as llama.cpp's tools do; a weight whose rows are not a multiple of the
quantization block (32) is stored F16 instead (llama.cpp's converter does the same). Quantized
with the ``gguf`` library's reference quantizers (``gguf.quants.quantize``).

The file is written to a temporary file beside ``--out``, read back with lmlab's loader and its
logits compared with the model's (float32 files: max |diff| <= 1e-5, else nothing is written),
then renamed onto ``--out``; an existing ``--out`` is refused unless ``force``.
"""

from __future__ import annotations

import glob
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lmlab.config import ModelConfig
from lmlab.data.tokenizer import BPETokenizer, CharTokenizer, Tokenizer, _unicode_to_byte
from lmlab.errors import LmlabError
from lmlab.fsutil import check_free_space, check_out_path, fsync_path, write_error
from lmlab.interop.export import _umask_mode
from lmlab.interop.families_decoder import _Checks, _common_checks
from lmlab.interop.importer import model_config
from lmlab.interop.rope_layout import gguf_permute, interleaved_to_half_split
from lmlab.runlock import lock_beside

ATOL = 1e-5  # float32 files: lmlab's logits from the file vs. the model's
QUANTS = ("f32", "f16", "q8_0", "q4_0")
ARCHITECTURES = ("llama", "starcoder2")
# A merge that never applies (its parts are no byte symbol and no merge makes them): llama.cpp
# refuses a gpt2 vocabulary without a merges list and the gguf library writes no empty array.
PLACEHOLDER_MERGE = "lmlab:character-vocabulary lmlab:no-merges"
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3


@dataclass
class GGUFExportResult:
    """What :func:`export_gguf` wrote. Logit numbers compare lmlab's model read back from the
    file with the source model on random ids (float32 arithmetic): ``max_abs_diff`` (logits),
    ``rel_diff`` (max |diff| / max |logit|), ``argmax_agree`` (share of positions whose greedy
    next token is the same); ``tanh_gelu_max_abs_diff``: for an exact-GELU model, the max
    |diff| of the logits llama.cpp's tanh GELU gives (None otherwise)."""

    out: Path
    architecture: str
    quant: str
    tensor_types: dict[str, int]
    n_bytes: int
    max_abs_diff: float
    rel_diff: float
    argmax_agree: float
    tanh_gelu_max_abs_diff: float | None = None
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ which architecture


def gguf_architecture(cfg: ModelConfig) -> str:
    """The llama.cpp architecture whose forward equals ``cfg``'s: ``llama`` or ``starcoder2``.

    Raises LmlabError naming every setting that keeps the model from the closer of the two.
    """
    llama, sc2 = _Checks("llama"), _Checks("starcoder2")
    a, p = cfg.attention, cfg.position
    for c in (llama, sc2):
        _common_checks(cfg, c)
        c.require(not cfg.block.parallel, "model.block.parallel")
        c.require(a.mask == "causal", f"model.attention.mask={a.mask}")
        c.require(not a.qk_norm, "model.attention.qk_norm")
        c.require(p.kind == "rope", f"model.position.kind={p.kind}")
        c.require(p.partial_rotary_factor == 1.0, "model.position.partial_rotary_factor")
        c.require(
            p.scaling.kind in ("none", "linear"), f"model.position.scaling.kind={p.scaling.kind}"
        )
    llama.require(cfg.norm.kind == "rmsnorm", f"model.norm.kind={cfg.norm.kind}")
    llama.require(cfg.ffn.kind == "swiglu", f"model.ffn.kind={cfg.ffn.kind}")
    llama.require(not cfg.ffn.bias, "model.ffn.bias")
    llama.require(not a.bias and not a.out_bias, "model.attention.bias")
    sc2.require(cfg.norm.kind == "layernorm", f"model.norm.kind={cfg.norm.kind}")
    sc2.require(cfg.ffn.kind == "mlp", f"model.ffn.kind={cfg.ffn.kind}")
    sc2.require(
        cfg.ffn.kind != "mlp" or cfg.ffn.activation in ("gelu", "gelu_tanh"),
        f"model.ffn.activation={cfg.ffn.activation}",
    )
    sc2.require(cfg.head_dim * a.n_heads == cfg.d_model, "model.attention.head_dim")
    if not llama.missing:
        return "llama"
    if not sc2.missing:
        return "starcoder2"
    closer = llama if len(llama.missing) < len(sc2.missing) else sc2
    raise LmlabError(
        "no llama.cpp architecture computes this model; the closest, "
        f"{closer.family}, lacks: {', '.join(closer.missing)}"
    )


# ------------------------------------------------------------------ metadata and tensors


def model_metadata(cfg: ModelConfig, arch: str, name: str) -> dict[str, Any]:
    """``general.*`` and ``{arch}.*`` keys (llama.cpp's names) for ``cfg``; values are Python
    ints (written uint32), floats (float32) and strings."""
    a = arch + "."
    meta: dict[str, Any] = {
        "general.name": name,
        a + "vocab_size": cfg.vocab_size,
        a + "context_length": cfg.max_seq_len,
        a + "embedding_length": cfg.d_model,
        a + "block_count": cfg.n_layers,
        a + "feed_forward_length": cfg.d_ff,
        a + "attention.head_count": cfg.attention.n_heads,
        a + "attention.head_count_kv": cfg.n_kv_heads,
        a + "rope.dimension_count": cfg.head_dim,
        a + "rope.freq_base": float(cfg.position.rope_theta),
    }
    if cfg.head_dim * cfg.attention.n_heads != cfg.d_model:
        meta[a + "attention.key_length"] = cfg.head_dim
        meta[a + "attention.value_length"] = cfg.head_dim
    if cfg.position.scaling.kind == "linear":
        meta[a + "rope.scaling.type"] = "linear"
        meta[a + "rope.scaling.factor"] = float(cfg.position.scaling.factor)
    if arch == "llama":
        meta[a + "attention.layer_norm_rms_epsilon"] = float(cfg.norm.eps)
    else:
        meta[a + "attention.layer_norm_epsilon"] = float(cfg.norm.eps)
        meta["lmlab.ffn.activation"] = cfg.ffn.activation
    return meta


def _qk_rows(w: torch.Tensor, n_heads: int, cfg: ModelConfig, arch: str) -> torch.Tensor:
    """q/k rows in the RoPE layout ``arch`` expects: interleaved for llama, half-split for
    starcoder2 (NeoX)."""
    if arch == "llama":
        return w if cfg.position.interleaved else gguf_permute(w, n_heads)
    return interleaved_to_half_split(w, n_heads) if cfg.position.interleaved else w


def gguf_tensors(
    sd: dict[str, torch.Tensor], cfg: ModelConfig, arch: str
) -> dict[str, torch.Tensor]:
    """lmlab state dict -> GGUF tensor name -> float32 tensor (PyTorch order). Tied models leave
    ``output.weight`` out (llama.cpp reuses ``token_embd``); starcoder2 gets zero biases where
    the model has none."""
    out: dict[str, torch.Tensor] = {"token_embd.weight": sd["embed.weight"]}
    out["output_norm.weight"] = sd["final_norm.weight"]
    if not cfg.tie_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    names = {
        "attn_norm": "attn_norm",
        "ffn_norm": "ffn_norm",
        "attn_q": "attn.q_proj",
        "attn_k": "attn.k_proj",
        "attn_v": "attn.v_proj",
        "attn_output": "attn.o_proj",
    }
    if arch == "llama":
        names |= {"ffn_gate": "ffn.gate_proj", "ffn_up": "ffn.up_proj", "ffn_down": "ffn.down_proj"}
    else:
        names |= {"ffn_up": "ffn.up_proj", "ffn_down": "ffn.down_proj"}
    heads = {"attn_q": cfg.attention.n_heads, "attn_k": cfg.n_kv_heads}
    for i in range(cfg.n_layers):
        for gguf_name, lmlab_name in names.items():
            w = sd[f"layers.{i}.{lmlab_name}.weight"]
            b = sd.get(f"layers.{i}.{lmlab_name}.bias")
            if gguf_name in heads:
                w = _qk_rows(w, heads[gguf_name], cfg, arch)
                b = None if b is None else _qk_rows(b, heads[gguf_name], cfg, arch)
            out[f"blk.{i}.{gguf_name}.weight"] = w
            if arch == "starcoder2":
                out[f"blk.{i}.{gguf_name}.bias"] = torch.zeros(w.shape[0]) if b is None else b
    if arch == "starcoder2":
        b = sd.get("final_norm.bias")
        out["output_norm.bias"] = torch.zeros(cfg.d_model) if b is None else b
    return {k: v.detach().float().cpu().contiguous() for k, v in out.items()}


# ------------------------------------------------------------------ tokenizer


def tokenizer_metadata(tokenizer: Tokenizer | None, vocab_size: int) -> dict[str, Any]:
    """``tokenizer.ggml.*`` keys for lmlab's ``char`` and ``bpe`` tokenizers (byte-level BPE,
    see the module docstring). Raises LmlabError for another kind, no tokenizer, a character
    vocabulary with multi-byte characters, or a vocabulary whose size is not the model's."""
    if tokenizer is None:
        raise LmlabError("the model has no tokenizer; a GGUF file needs one (llama.cpp reads it)")
    by_byte = {b: c for c, b in _unicode_to_byte().items()}
    if isinstance(tokenizer, CharTokenizer):
        symbols = [[by_byte[b] for b in c.encode("utf-8")] for c in tokenizer.chars]
        tokens = ["".join(s) for s in symbols]
        meta: dict[str, Any] = {
            "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.merges": char_merges(symbols) or [PLACEHOLDER_MERGE],
            "tokenizer.ggml.token_type": [TOKEN_NORMAL] * len(tokens),
            "lmlab.tokenizer.kind": "char",
        }
    elif type(tokenizer) is BPETokenizer:
        vocab = tokenizer.hf.get_vocab(with_added_tokens=True)
        tokens = [""] * len(vocab)
        for tok, i in vocab.items():
            tokens[i] = tok
        merges = _bpe_merges(tokenizer)
        special = tokenizer.special_ids()
        meta = {
            "tokenizer.ggml.pre": "gpt-2",
            "tokenizer.ggml.merges": merges or [PLACEHOLDER_MERGE],
            "tokenizer.ggml.token_type": [
                TOKEN_CONTROL if i in special else TOKEN_NORMAL for i in range(len(tokens))
            ],
        }
        if tokenizer.eos_id is not None:
            meta["tokenizer.ggml.eos_token_id"] = tokenizer.eos_id
    elif isinstance(tokenizer, BPETokenizer):  # GGUFTokenizer: its pre-tokenizer is not kept
        raise LmlabError(
            "a tokenizer read from a GGUF file cannot be written to GGUF again; supported: "
            "lmlab's own char and bpe tokenizers"
        )
    else:
        raise LmlabError(
            f"a {tokenizer.kind!r} tokenizer cannot be written to GGUF; supported: lmlab's own "
            "char and bpe tokenizers"
        )
    if len(tokens) != vocab_size:
        raise LmlabError(
            f"the tokenizer has {len(tokens)} tokens but the model's vocabulary is {vocab_size}; "
            "llama.cpp needs them equal"
        )
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        **meta,
        "tokenizer.ggml.add_bos_token": False,
    }


def char_merges(symbols: list[list[str]]) -> list[str]:
    """The merges that assemble each multi-byte character from its byte symbols, left to right:
    for the bytes A B C, "A B" then "AB C". In llama.cpp's BPE (merges applied by rank, any
    merged string allowed) they rebuild exactly the characters of the vocabulary: every merge
    starts with a lead byte, so none crosses a character boundary, and within a character only
    the next prefix can merge. Single-byte characters need none."""
    merges: dict[str, None] = {}
    for s in symbols:
        for k in range(1, len(s)):
            merges["".join(s[:k]) + " " + s[k]] = None
    return list(merges)


def _bpe_merges(tokenizer: BPETokenizer) -> list[str]:
    """The merges of a ``tokenizers`` BPE model as "a b" strings, in priority order."""
    import json

    model = json.loads(tokenizer.hf.to_str())["model"]
    return [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]


# ------------------------------------------------------------------ writing


def _qtype(quant: str, shape: tuple[int, ...]) -> Any:
    """The GGML type of a tensor of PyTorch ``shape`` under ``--quant``: 1-D F32; 2-D the chosen
    type, or F16 when its rows are not a multiple of the quantization block."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if len(shape) == 1 or quant == "f32":
        return GGMLQuantizationType.F32
    qtype = GGMLQuantizationType[quant.upper()]
    block = GGML_QUANT_SIZES[qtype][0]
    return qtype if shape[-1] % block == 0 else GGMLQuantizationType.F16


FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7}  # gguf.LlamaFileType


def write_gguf_file(
    path: Path, arch: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor], quant: str
) -> dict[str, int]:
    """Write one GGUF file at ``path``: metadata (ints uint32, floats float32, lists of str or
    int32 arrays) and every tensor in the type :func:`_qtype` gives. Returns type name -> count."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_file_type(FILE_TYPES[quant])
    if quant in ("q8_0", "q4_0"):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value in meta.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif value and isinstance(value[0], int):
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
        else:
            w.add_array(key, value)
    counts: dict[str, int] = {}
    for name, t in tensors.items():
        qtype = _qtype(quant, tuple(t.shape))
        arr = t.numpy()
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, arr)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        counts[qtype.name] = counts.get(qtype.name, 0) + 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return counts


def check_structure(
    model: nn.Module, cfg: ModelConfig, arch: str, meta: dict[str, Any], tensors: dict[str, Any]
) -> None:
    """Before anything is written or quantized: the model lmlab's GGUF loader builds from
    ``meta`` and the float32 ``tensors`` (:func:`lmlab.interop.gguf.gguf_model_config`,
    ``gguf_state_dict``) computes ``model``'s logits to 1e-5, so no setting the architecture
    lacks slips through unchecked, whatever ``--quant``. Raises LmlabError otherwise."""
    from lmlab.interop.gguf import gguf_model_config, gguf_state_dict
    from lmlab.models.build import build_model

    file_cfg = gguf_model_config({"general.architecture": arch, **meta}, set(tensors), Path("-"))
    twin = build_model(file_cfg)
    twin.load_state_dict(gguf_state_dict(dict(tensors), file_cfg))
    diff = _compare(model, twin, cfg)[0]
    if not diff <= ATOL:
        raise LmlabError(
            f"the {arch} model the GGUF file describes computes different logits from this "
            f"model (max |diff| {diff:.2e} > {ATOL:g}): it has a setting {arch} lacks; nothing "
            "was written"
        )


def _compare(ours: nn.Module, theirs: nn.Module, cfg: ModelConfig) -> tuple[float, float, float]:
    """(max |logit diff|, that / max |logit|, share of equal argmax) on two random sequences of
    min(max_seq_len, 32) ids, float32, seed 0."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size or 2, (2, min(cfg.max_seq_len, 32)), generator=gen)
    with torch.no_grad():
        a, b = ours.eval()(x).logits.float(), theirs.eval()(x).logits.float()
    diff = float((a - b).abs().max())
    rel = diff / max(float(a.abs().max()), 1e-30)
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    return diff, rel, agree


def _check_replaceable(final: Path) -> None:
    """Refuse an ``--out`` that is there but is neither a regular file nor a symbolic link (a
    device such as /dev/full, a FIFO, a socket): even --force never replaces one (renaming onto
    it would put a plain file where the device node was)."""
    try:
        st = os.lstat(final)
    except OSError:
        return
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise LmlabError(
            f"--out {final} is not a regular file (a device, FIFO or socket); --force replaces "
            "only a file: give another file name"
        )


def export_gguf(
    source: str | Path,
    out: str | Path,
    quant: str = "f32",
    force: bool = False,
    name: str | None = None,
) -> GGUFExportResult:
    """Write the model at ``source`` (a run folder, a Hugging Face folder, a GGUF file ...) as
    the GGUF file ``out`` (see the module docstring), checked by reading it back.

    Raises LmlabError, before anything is written, for an unknown ``quant``, an ``out`` that
    exists (unless ``force``), is a folder or is the source, a model no llama.cpp architecture
    computes (naming each setting) or a tokenizer GGUF cannot hold; and, with nothing left
    behind, when the file read back gives logits more than 1e-5 from the model's (f32).
    """
    from lmlab.interop.gguf import load_gguf
    from lmlab.interop.load import load
    from lmlab.interop.outdir import check_not_source

    if quant not in QUANTS:
        raise LmlabError(f"unknown --quant {quant!r}; supported: {', '.join(QUANTS)}")
    final = Path(out)
    check_out_path(final, folder=False, what="the GGUF file")
    check_not_source(final, source)
    _check_replaceable(final)
    if final.exists() and not force:
        raise LmlabError(f"--out {final} exists; choose another file name or pass --force")
    model, tokenizer = load(source, "cpu")
    model = model.float().eval()
    cfg = model_config(model)
    arch = gguf_architecture(cfg)
    assert cfg.vocab_size is not None
    meta = model_metadata(cfg, arch, name or Path(str(source)).name or "lmlab")
    meta |= tokenizer_metadata(tokenizer, cfg.vocab_size)
    tensors = gguf_tensors(model.state_dict(), cfg, arch)
    check_structure(model, cfg, arch, meta, tensors)
    needed = sum(t.numel() * 4 for t in tensors.values()) + (1 << 20)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LmlabError(f"cannot write beside --out {final}: {e.strerror or e}") from None
    with lock_beside(final):
        _check_replaceable(final)
        if final.exists() and not force:
            raise LmlabError(f"--out {final} exists; choose another file name or pass --force")
        check_free_space(final.parent, needed, f"--out {final}")
        for stale in final.parent.glob(f".{glob.escape(final.name)}.tmp-*"):
            if stale.is_file() and not stale.is_symlink():  # left by a killed writer
                stale.unlink()
        tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
        try:
            counts = write_gguf_file(tmp, arch, meta, tensors, quant)
            os.chmod(tmp, _umask_mode())
            fsync_path(tmp)
            back, _ = load_gguf(tmp, "cpu")
            diff, rel, agree = _compare(model, back, cfg)
            if quant == "f32" and not diff <= ATOL:
                raise LmlabError(
                    f"the GGUF file read back computes different logits from the model (max "
                    f"|diff| {diff:.2e} > {ATOL:g}); nothing was written"
                )
            gap = tanh_gap = None
            if arch == "starcoder2" and cfg.ffn.activation == "gelu":
                approx, _ = load_gguf(tmp, "cpu", lmlab_keys=False)
                gap = _compare(model, approx, cfg)[0]
                if quant != "f32":  # back has the file's rounded weights: the GELU alone
                    tanh_gap = _compare(back, approx, cfg)[0]
            n_bytes = tmp.stat().st_size
            if force:
                os.replace(tmp, final)
            else:  # a link fails if --out appeared meanwhile: nothing is overwritten
                try:
                    os.link(tmp, final)
                except FileExistsError:
                    raise LmlabError(
                        f"--out {final} exists; choose another file name or pass --force"
                    ) from None
                except OSError:  # no hard links here: rename (--out was checked under the lock)
                    os.replace(tmp, final)
                else:
                    tmp.unlink()
            fsync_path(final.parent)
        except OSError as e:
            err = write_error(e, tmp, needed)
            raise (err or e) from None
        finally:
            if tmp.exists():
                tmp.unlink()
    notes = []
    if gap is not None:
        rounding = (
            ""
            if tanh_gap is None
            else f", {quant}'s rounding included (the tanh GELU alone: {tanh_gap:.1e})"
        )
        notes.append(
            "llama.cpp computes starcoder2's GELU with the tanh approximation: its logits "
            f"from this file differ from the model's by up to {gap:.1e}{rounding} (lmlab reads "
            "the exact GELU back)"
        )
    if tokenizer is not None and tokenizer.eos_id is None and cfg.vocab_size > 11:
        notes.append(
            "the tokenizer has no end-of-text token: llama.cpp then treats id 11 as the end "
            "of a generation (its gpt2 default); pass --ignore-eos to llama-cli"
        )
    return GGUFExportResult(final, arch, quant, counts, n_bytes, diff, rel, agree, gap, notes)


def format_result(res: GGUFExportResult) -> str:
    """The lines ``lmlab export --format gguf`` prints."""
    types = ", ".join(f"{n} {t}" for t, n in sorted(res.tensor_types.items()))
    lines = [
        f"wrote {res.out} ({res.architecture}, {res.quant}, {res.n_bytes:,} bytes; tensors: "
        f"{types})",
        f"check: lmlab reads it back: max |logit diff| {res.max_abs_diff:.1e} (relative "
        f"{res.rel_diff:.1e}), greedy next token equal at {res.argmax_agree:.1%} of positions",
    ]
    return "\n".join(lines + [f"note: {n}" for n in res.notes])
