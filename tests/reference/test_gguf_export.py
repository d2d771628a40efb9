"""lmlab export --format gguf: the file read back by the ``gguf`` library (architecture, keys,
tensor names, shapes and types), by lmlab's loader (logits equal to the model's: 1e-5 for f32;
for f16 / q8_0 / q4_0 equal to 1e-5 to the model with every 2-D weight rounded through the same
quantizer, and within a stated bound of the model itself), and by transformers' own GGUF reader
(its config and tensor map; Starcoder2 and Llama, logits equal to 1e-5). Tiny random models,
nothing downloaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lmlab.data.tokenizer import BPETokenizer, CharTokenizer, _unicode_to_byte
from lmlab.errors import LmlabError
from lmlab.interop import gguf_export
from lmlab.interop.gguf_export import PLACEHOLDER_MERGE, export_gguf
from lmlab.interop.importer import write_run
from lmlab.interop.load import load
from lmlab.models import build_model
from tests.helpers import assert_one_error, perturb_all, run_cli, tiny_model_config

gguf = pytest.importorskip("gguf")

CHARS = sorted(set("\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"))
EVERY_CHAR = "".join(CHARS) + "".join(reversed(CHARS)) + "ROMEO: But soft!\n"
LLAMA = {
    "norm": {"kind": "rmsnorm", "eps": 1e-6},
    "ffn": {"kind": "swiglu", "d_ff": 64, "bias": False},
    "attention": {"n_heads": 4, "n_kv_heads": 2},
    "tie_embeddings": False,
}
TANH_GQA = {
    "ffn": {"kind": "mlp", "activation": "gelu_tanh"},
    "attention": {"n_heads": 4, "n_kv_heads": 2},
}
# the logits of the file read back vs. the model's, max |diff| / max |logit| (tiny random model
# of d_model 32, weights N(0, 0.02) + N(0, 0.1); measured 8.6e-4, 1.8e-2, 2.8e-1)
REL_BOUND = {"f32": 1e-6, "f16": 5e-3, "q8_0": 5e-2, "q4_0": 0.5}


def _run(root: Path, name: str, tokenizer=None, **settings) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    tok = tokenizer or CharTokenizer(CHARS)
    model = perturb_all(build_model(tiny_model_config(tok.vocab_size, **settings))).eval()
    return write_run(model, tok, root / name), model


@pytest.fixture(scope="module")
def minigpt(tmp_path_factory) -> dict:
    """The default Mini-GPT shape (exact GELU) exported in every --quant."""
    root = tmp_path_factory.mktemp("gguf_export")
    run, model = _run(root, "minigpt")
    files = {q: export_gguf(run, root / f"minigpt-{q}.gguf", quant=q) for q in gguf_export.QUANTS}
    return {"root": root, "run": run, "model": model, "files": files}


def _ids(vocab: int, t: int = 24) -> torch.Tensor:
    return torch.randint(0, vocab, (2, t), generator=torch.Generator().manual_seed(1))


def _logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(x).logits.float()


def test_gguf_library_reads_the_architecture_keys_tensors_and_types(minigpt) -> None:
    reader = gguf.GGUFReader(minigpt["files"]["f32"].out)
    field = {k: f.contents() for k, f in reader.fields.items()}
    assert field["general.architecture"] == "starcoder2"
    expected = {
        "starcoder2.vocab_size": len(CHARS),
        "starcoder2.embedding_length": 32,
        "starcoder2.block_count": 2,
        "starcoder2.feed_forward_length": 128,
        "starcoder2.attention.head_count": 4,
        "starcoder2.attention.head_count_kv": 4,
        "starcoder2.rope.dimension_count": 8,
        "starcoder2.context_length": 32,
        "lmlab.ffn.activation": "gelu",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.merges": [PLACEHOLDER_MERGE],
        "general.file_type": 0,
    }
    assert {k: field[k] for k in expected} == expected
    assert field["starcoder2.rope.freq_base"] == 10000.0
    assert abs(field["starcoder2.attention.layer_norm_epsilon"] - 1e-5) < 1e-11
    assert field["tokenizer.ggml.tokens"][:3] == ["Ċ", "Ġ", "!"]  # GPT-2's byte characters
    assert reader.fields["tokenizer.ggml.token_type"].types[-1] == gguf.GGUFValueType.INT32
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_up",
                 "ffn_down"]  # fmt: skip
    names = {"token_embd.weight", "output_norm.weight", "output_norm.bias"} | {
        f"blk.{i}.{m}.{p}" for i in range(2) for m in per_layer for p in ("weight", "bias")
    }
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    assert set(shapes) == names  # tied: no output.weight
    assert shapes["token_embd.weight"] == (32, len(CHARS))  # GGML order: fastest dim first
    assert shapes["blk.0.ffn_up.weight"] == (32, 128) and shapes["blk.0.ffn_down.bias"] == (32,)
    for quant, qtype in [("f32", "F32"), ("f16", "F16"), ("q8_0", "Q8_0"), ("q4_0", "Q4_0")]:
        r = gguf.GGUFReader(minigpt["files"][quant].out)
        types = {t.name: t.tensor_type.name for t in r.tensors}
        assert {types[n] for n in names if n.endswith("bias") or "norm" in n} == {"F32"}
        assert {types[n] for n in names if not (n.endswith("bias") or "norm" in n)} == {qtype}


def _rounded(model: torch.nn.Module, quant: str) -> torch.nn.Module:
    """``model`` with every 2-D weight stored and read as ``quant`` (the gguf library's own
    quantizer and dequantizer, independent of lmlab's export)."""
    out = build_model(model.cfg)
    state = {}
    for k, v in model.state_dict().items():
        if v.ndim == 2 and quant == "f16":
            v = v.half().float()
        elif v.ndim == 2 and quant != "f32":
            qtype = gguf.GGMLQuantizationType[quant.upper()]
            q = gguf.quants.quantize(v.numpy(), qtype)
            v = torch.from_numpy(np.asarray(gguf.quants.dequantize(q, qtype), dtype=np.float32))
        state[k] = v
    out.load_state_dict(state)
    return out.eval()


@pytest.mark.parametrize("quant", gguf_export.QUANTS)
def test_lmlab_reads_back_the_model_within_the_quantization_error(minigpt, quant) -> None:
    res = minigpt["files"][quant]
    back, _ = load(res.out, "cpu")
    x = _ids(len(CHARS))
    ours, theirs = _logits(minigpt["model"], x), _logits(back, x)
    # exactly the quantized weights: the model rounded through gguf.quants gives the same logits
    assert float((_logits(_rounded(minigpt["model"], quant), x) - theirs).abs().max()) <= 1e-5
    rel = float((ours - theirs).abs().max() / ours.abs().max())
    assert rel <= REL_BOUND[quant], rel
    if quant == "f32":
        assert float((ours - theirs).abs().max()) <= 1e-5 and res.max_abs_diff <= 1e-5
        assert res.tanh_gelu_max_abs_diff is not None and res.tanh_gelu_max_abs_diff > 1e-5
    if quant in ("f16", "q8_0"):
        assert float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()) >= 0.9
    (note,) = [n for n in res.notes if "tanh approximation" in n]
    if quant != "f32":  # the note parts the file's rounding from the GELU's own gap
        assert f"{quant}'s rounding included (the tanh GELU alone: " in note
    else:
        assert "rounding" not in note


def test_char_tokenizer_round_trips_every_character(minigpt) -> None:
    out = minigpt["files"]["q8_0"].out
    _, tok = load(out, "cpu")
    ids = CharTokenizer(CHARS).encode(EVERY_CHAR)
    field = {k: f.contents() for k, f in gguf.GGUFReader(out).fields.items()}
    merges = field["tokenizer.ggml.merges"]
    assert llama_cpp_bpe(EVERY_CHAR, field["tokenizer.ggml.tokens"], merges) == ids
    assert tok.encode(EVERY_CHAR) == ids
    assert tok.decode(ids) == EVERY_CHAR and tok.vocab_size == len(CHARS)


def test_bpe_tokenizer_round_trips(tmp_path) -> None:
    from lmlab.config import TokenizerConfig

    text = "ROMEO: But soft, what light through yonder window breaks?\n" * 20
    bpe = BPETokenizer.train(text, TokenizerConfig(kind="bpe", vocab_size=300))
    run, model = _run(tmp_path, "bpe", tokenizer=bpe)
    res = export_gguf(run, tmp_path / "bpe.gguf")
    back, tok = load(res.out, "cpu")
    sample = "JULIET: soft light, what window? ROMEO!\n" + "".join(CHARS)
    assert tok.encode(sample) == bpe.encode(sample)
    assert tok.decode(bpe.encode(sample)) == sample
    assert tok.eos_id == bpe.eos_id is not None
    x = _ids(bpe.vocab_size)
    assert float((_logits(model, x) - _logits(back, x)).abs().max()) <= 1e-5


@pytest.mark.parametrize(
    ("settings", "arch"),
    [
        (LLAMA, "llama"),
        ({**LLAMA, "position": {"kind": "rope", "interleaved": True}}, "llama"),
        ({"position": {"kind": "rope", "interleaved": True}, **TANH_GQA}, "starcoder2"),
        (
            {
                "norm": {"kind": "layernorm", "bias": False},
                "attention": {"n_heads": 4, "bias": True},
            },
            "starcoder2",
        ),
        (
            {
                **LLAMA,
                "attention": {"n_heads": 4, "n_kv_heads": 2, "head_dim": 16},
                "position": {"kind": "rope", "scaling": {"kind": "linear", "factor": 2.0}},
            },
            "llama",
        ),
    ],
    ids=[
        "llama",
        "llama-interleaved",
        "starcoder2-interleaved-gqa",
        "starcoder2-biases",
        "llama-head-dim-linear-rope",
    ],
)
def test_other_shapes_round_trip_exactly(tmp_path, settings, arch) -> None:
    run, model = _run(tmp_path, "run", **settings)
    res = export_gguf(run, tmp_path / "m.gguf")
    assert res.architecture == arch
    back, _ = load(res.out, "cpu")
    x = _ids(len(CHARS))
    assert float((_logits(model, x) - _logits(back, x)).abs().max()) <= 1e-5


@pytest.mark.parametrize("settings", [TANH_GQA, LLAMA], ids=["starcoder2", "llama"])
def test_transformers_gguf_reader_computes_the_same_logits(tmp_path, settings) -> None:
    """transformers' own GGUF reader (its config map and tensor processors, what
    from_pretrained(gguf_file=...) runs; that entry point also needs accelerate)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    run, model = _run(tmp_path, "run", **settings)
    out = export_gguf(run, tmp_path / "m.gguf").out
    cfg = transformers.AutoConfig.from_pretrained(str(tmp_path), gguf_file=out.name)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = load_gguf_checkpoint(str(out), return_tensors=True, model_to_load=hf)["tensors"]
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= (
        {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    )
    hf.tie_weights()
    x = _ids(len(CHARS))
    assert float((_logits(model, x) - _logits(hf, x)).abs().max()) <= 1e-5


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"position": {"kind": "learned"}}, "model.position.kind=learned"),
        ({"block": {"parallel": True}}, "model.block.parallel"),
        ({"position": {"kind": "rope", "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"ffn": {"kind": "mlp", "activation": "relu"}}, "model.ffn.activation=relu"),
    ],
)
def test_shapes_no_architecture_computes_are_refused_by_name(tmp_path, settings, needle) -> None:
    run, _ = _run(tmp_path, "run", **settings)
    with pytest.raises(LmlabError, match="no llama.cpp architecture") as e:
        export_gguf(run, tmp_path / "m.gguf")
    assert needle in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def llama_cpp_bpe(text: str, tokens: list[str], merges: list[str]) -> list[int]:
    """A reference of llama.cpp's byte-level BPE (llm_tokenizer_bpe_session): the text's bytes
    as GPT-2 byte characters, the adjacent pair of lowest merge rank merged until none is left
    (a merged string need not be a token), then each symbol's id (a symbol not in the vocabulary
    falls back to its single-byte tokens). No pre-tokenizer split: none of the merges here spans
    two characters, so splitting words first cannot change the result."""
    by_byte = {b: c for c, b in _unicode_to_byte().items()}
    rank = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
    syms = [by_byte[b] for b in text.encode("utf-8")]
    while True:
        pairs = [(rank.get((syms[i], syms[i + 1]), 1 << 30), i) for i in range(len(syms) - 1)]
        best, i = min(pairs, default=(1 << 30, -1))
        if best == 1 << 30:
            break
        syms[i : i + 2] = [syms[i] + syms[i + 1]]
    ids = {t: i for i, t in enumerate(tokens)}
    return [ids[s] if s in ids else ids[c] for s in syms for c in ([s] if s in ids else s)]


def test_multibyte_characters_round_trip_in_lmlab_and_llama_cpps_bpe(tmp_path) -> None:
    chars = sorted({*CHARS, "é", "’", "红", "楼", "梦", "🙂"})  # 2, 3 and 4 UTF-8 bytes
    run, model = _run(tmp_path, "run", tokenizer=CharTokenizer(chars))
    res = export_gguf(run, tmp_path / "m.gguf")
    field = {k: f.contents() for k, f in gguf.GGUFReader(res.out).fields.items()}
    text = "".join(chars) + " 红楼梦 café’s 🙂!\n"
    ids = CharTokenizer(chars).encode(text)
    merges = field["tokenizer.ggml.merges"]
    assert llama_cpp_bpe(text, field["tokenizer.ggml.tokens"], merges) == ids
    back, tok = load(res.out, "cpu")
    assert isinstance(tok, CharTokenizer) and tok.chars == chars
    assert tok.encode(text) == ids and tok.decode(ids) == text
    x = _ids(len(chars))
    assert float((_logits(model, x) - _logits(back, x)).abs().max()) <= 1e-5


def test_cli_refuses_existing_out_and_bad_quant_and_force_replaces(minigpt, capsys) -> None:
    root, run = minigpt["root"], str(minigpt["run"])
    out = root / "cli.gguf"
    (root / ".cli.gguf.tmp-1").write_bytes(b"left by a killed writer")
    code, stdout, _ = run_cli(capsys, "export", run, "--format", "gguf", "--out", str(out),
                              "--quant", "q8_0")  # fmt: skip
    assert code == 0 and "starcoder2, q8_0" in stdout and "max |logit diff|" in stdout
    before = out.read_bytes()
    code, _, err = run_cli(capsys, "export", run, "--format", "gguf", "--out", str(out))
    assert_one_error(code, err, "exists", "--force")
    assert out.read_bytes() == before
    code, _, err = run_cli(capsys, "export", run, "--format", "gguf", "--out", str(out),
                           "--quant", "q5_k")  # fmt: skip
    assert_one_error(code, err, "--quant", "q5_k")
    code, _, err = run_cli(capsys, "export", run, "--format", "gguf", "--out", str(root))
    assert_one_error(code, err, "is a folder")
    code, _, err = run_cli(capsys, "export", run, "--out", str(root / "hf"), "--quant", "f16")
    assert_one_error(code, err, "--quant applies to --format gguf only")
    code, _, _ = run_cli(capsys, "export", run, "--format", "gguf", "--out", str(out), "--force")
    assert code == 0 and out.read_bytes() != before
    assert not list(root.glob(".*tmp*"))


def test_force_never_replaces_a_fifo_or_device(minigpt, capsys) -> None:
    """--force onto /dev/full (as root) used to rename a plain file over the device node."""
    import os
    import stat

    fifo = minigpt["root"] / "pipe.gguf"
    os.mkfifo(fifo)
    code, _, err = run_cli(capsys, "export", str(minigpt["run"]), "--format", "gguf", "--out",
                           str(fifo), "--force")  # fmt: skip
    assert_one_error(code, err, "--out", "not a regular file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    fifo.unlink()
    assert not list(minigpt["root"].glob(".*tmp*"))


def test_a_failed_check_leaves_nothing(minigpt, monkeypatch) -> None:
    monkeypatch.setattr(gguf_export, "_compare", lambda *a: (1.0, 1.0, 0.0))
    out = minigpt["root"] / "bad.gguf"
    with pytest.raises(LmlabError, match="nothing was written"):
        export_gguf(minigpt["run"], out)
    assert not out.exists() and not list(minigpt["root"].glob(".bad.gguf*"))
    with pytest.raises(LmlabError, match="unknown --quant"):
        export_gguf(minigpt["run"], out, quant="q2_k")


def test_a_setting_the_architecture_lacks_is_caught_before_writing(tmp_path, monkeypatch) -> None:
    """The structural check (the file's model with the float weights == the model) does not
    rely on gguf_architecture's list: a parallel block let through is still refused."""
    run, _ = _run(tmp_path, "run", block={"parallel": True})
    monkeypatch.setattr(gguf_export, "gguf_architecture", lambda cfg: "starcoder2")
    with pytest.raises(LmlabError, match="setting starcoder2 lacks; nothing was written"):
        export_gguf(run, tmp_path / "m.gguf", quant="q4_0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_lmlab_import_of_the_file_gives_a_char_run(minigpt) -> None:
    from lmlab.interop.importer import import_model

    res = import_model(minigpt["files"]["f32"].out, minigpt["root"] / "imported")
    assert res.tokenizer_kind == "char" and res.vocab_size == len(CHARS)
    back, tok = load(res.out, "cpu")
    x = _ids(len(CHARS))
    assert tok.encode(EVERY_CHAR) == CharTokenizer(CHARS).encode(EVERY_CHAR)
    assert float((_logits(minigpt["model"], x) - _logits(back, x)).abs().max()) <= 1e-5


def _bad_file(minigpt, path: Path, meta: dict, drop: str | None = None) -> Path:
    """The Mini-GPT's starcoder2 file with metadata overrides (None removes a key) and one tensor
    left out, written with the export's own writer."""
    model = minigpt["model"]
    cfg = model.cfg
    kv = gguf_export.model_metadata(cfg, "starcoder2", "bad")
    kv |= gguf_export.tokenizer_metadata(CharTokenizer(CHARS), len(CHARS))
    kv = {k: v for k, v in (kv | meta).items() if v is not None}
    tensors = gguf_export.gguf_tensors(model.state_dict(), cfg, "starcoder2")
    tensors.pop(drop or "", None)
    gguf_export.write_gguf_file(path, "starcoder2", kv, tensors, "f32")
    return path


@pytest.mark.parametrize(
    ("meta", "drop", "needle"),
    [
        ({"starcoder2.attention.layer_norm_epsilon": None}, None, "layer_norm_epsilon"),
        ({"lmlab.ffn.activation": "relu"}, None, "lmlab.ffn.activation is 'relu'"),
        ({}, "blk.1.attn_q.bias", "layers.1.attn.q_proj.bias"),
        ({"tokenizer.ggml.tokens": ["ab", *CHARS[1:]]}, None, "token 'ab'"),
        ({"tokenizer.ggml.tokens": ["Ġ", "Ġ", *CHARS[2:]]}, None, "a character twice"),
    ],
    ids=["no-eps", "bad-activation", "missing-bias", "two-char-token", "duplicate-char"],
)
def test_bad_starcoder2_files_are_refused_by_name(minigpt, tmp_path, meta, drop, needle) -> None:
    from lmlab.errors import CheckpointError

    path = _bad_file(minigpt, tmp_path / "bad.gguf", meta, drop)
    with pytest.raises((LmlabError, CheckpointError)) as e:
        load(path, "cpu")
    assert needle in str(e.value) and str(path) in str(e.value)


def test_rows_off_the_quant_block_fall_back_to_f16(tmp_path) -> None:
    """ffn_down reads d_ff = 40 features: not a multiple of Q8_0's 32-value block, so F16."""
    ffn = {"kind": "swiglu", "d_ff": 40, "bias": False}
    run, model = _run(tmp_path, "run", **{**LLAMA, "ffn": ffn})
    res = export_gguf(run, tmp_path / "m.gguf", quant="q8_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(res.out).tensors}
    assert types["blk.0.ffn_down.weight"] == "F16" and types["blk.0.ffn_up.weight"] == "Q8_0"
    assert res.tensor_types == {"F32": 5, "F16": 2, "Q8_0": 14}  # 2 norms x 2 layers + final
    back, _ = load(res.out, "cpu")
    x = _ids(len(CHARS))
    assert float((_logits(model, x) - _logits(back, x)).abs().max()) <= 0.05 * float(
        _logits(model, x).abs().max()
    )
