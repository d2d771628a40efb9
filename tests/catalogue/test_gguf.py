"""GGUF metadata and tensors: a bad number, type or size is one error line naming the file and
the key, before any tensor is dequantized or any model built."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lmlab.training import memory
from tests.helpers import assert_one_error, run_cli, tiny_llama_hf, within, write_llama_gguf

pytest.importorskip("transformers")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return tiny_llama_hf()


def _run(capsys, tmp_path: Path, hf_model, meta: dict[str, Any]) -> tuple[int, str, str]:
    path = write_llama_gguf(tmp_path / "m.gguf", hf_model, meta=meta)
    with within(30):
        return run_cli(capsys, "generate", path, "--prompt", "a", "--max-new-tokens", "1")


BAD_METADATA = {
    # was "error: unexpected ValueError: invalid literal for int()"
    "width-a-string": ({"llama.embedding_length": "abc"}, "llama.embedding_length"),
    # was "error: unexpected ZeroDivisionError"
    "zero-heads": ({"llama.attention.head_count": 0}, "llama.attention.head_count"),
    # was 10**9 layers built on the meta device, one after another (a hang)
    "layers-1e9": ({"llama.block_count": 10**9}, "llama.block_count"),
    "width-1e9": ({"llama.embedding_length": 10**9}, "llama.embedding_length"),
    "zero-context": ({"llama.context_length": 0}, "llama.context_length"),
    "heads-do-not-divide": (
        {"llama.attention.head_count": 5, "llama.attention.head_count_kv": 5},
        "not divisible",
    ),
    "kv-heads-do-not-divide": ({"llama.attention.head_count_kv": 3}, "head_count_kv"),
    "theta-a-string": ({"llama.rope.freq_base": "fast"}, "llama.rope.freq_base"),
    "eos-a-string": ({"tokenizer.ggml.eos_token_id": "x"}, "tokenizer.ggml.eos_token_id"),
    "linear-factor-missing": ({"llama.rope.scaling.type": "linear"}, "rope.scaling.factor"),
}


@pytest.mark.parametrize(("meta", "needle"), BAD_METADATA.values(), ids=BAD_METADATA.keys())
def test_bad_metadata_is_one_error_naming_the_key(tmp_path, capsys, hf_model, meta, needle):
    code, _, err = _run(capsys, tmp_path, hf_model, meta)
    assert_one_error(code, err, "m.gguf", needle)


def test_loading_a_gguf_checks_the_cgroup_memory_limit_before_dequantizing(
    tmp_path, capsys, hf_model, monkeypatch
):
    root = tmp_path / "cgroup"
    (root / "memory").mkdir(parents=True)  # cgroup v1 layout
    (root / "memory" / "memory.limit_in_bytes").write_text("65536\n")
    (root / "memory" / "memory.usage_in_bytes").write_text("0\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text("4:memory:/\n")
    monkeypatch.setattr(memory, "CGROUP_ROOT", root)
    monkeypatch.setattr(memory, "PROC_CGROUP", proc)
    dequantized: list[str] = []
    import lmlab.interop.gguf as lmlab_gguf

    real = lmlab_gguf._dequantize
    monkeypatch.setattr(
        lmlab_gguf, "_dequantize", lambda t, p: dequantized.append(t.name) or real(t, p)
    )
    code, _, err = _run(capsys, tmp_path, hf_model, {})
    assert_one_error(code, err, "needs about", "memory.limit_in_bytes")
    assert dequantized == []


@pytest.mark.parametrize("key", ["eos_token_id", "bos_token_id"])
def test_a_special_token_id_outside_the_vocabulary_is_not_ignored_silently(
    tmp_path, capsys, hf_model, key
):
    """An end-of-text id beyond the vocabulary can never stop generation: it is ignored as
    llama.cpp ignores it, but with a warning naming the file and key (was: silently)."""
    code, _, err = _run(capsys, tmp_path, hf_model, {f"tokenizer.ggml.{key}": 2**31})
    assert code == 0, err
    assert f"warning: {tmp_path / 'm.gguf'}: tokenizer.ggml.{key} is 2,147,483,648" in err
