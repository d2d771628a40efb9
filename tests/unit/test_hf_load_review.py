"""Hostile folders for ``lmlab.load``: what a damaged Hugging Face or GGUF model gives.

Each folder is a tiny random transformers model written with ``save_pretrained`` (nothing
downloaded, HF_HUB_OFFLINE=1), then one file edited: a NaN/inf weight, a distinct ``lm_head``
under ``tie_word_embeddings: true``, conflicting or incomplete RoPE settings. lmlab either loads
exactly what transformers computes (logits to 1e-5) or refuses with one ``error:`` line naming
the file and the field or tensor (exit 2).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from lmlab import load  # noqa: E402
from lmlab.errors import LmlabError  # noqa: E402
from tests.helpers import assert_one_error, redraw, run_cli, write_hf_folder  # noqa: E402
from tests.helpers.hf_models import hf_config  # noqa: E402
from tests.unit.test_hf_deepseek_v3 import hf_model as deepseek_model  # noqa: E402


def llama_model(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return redraw(transformers.LlamaForCausalLM(hf_config("llama", **overrides)))


def edit_weights(folder: Path, **changes: torch.Tensor) -> None:
    """Rewrite ``folder/model.safetensors`` with ``changes`` (tensor name -> new value)."""
    path = folder / "model.safetensors"
    sd = load_file(str(path))
    sd.update(changes)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_hf_folder_with_non_finite_weight_is_refused(tmp_path, capsys, family, bad):
    model = llama_model() if family == "llama" else deepseek_model()
    folder = write_hf_folder(tmp_path / family, model)
    name = "model.layers.0.self_attn.o_proj.weight"
    w = load_file(str(folder / "model.safetensors"))[name].clone()
    w[0, 1] = bad
    edit_weights(folder, **{name: w})
    with pytest.raises(LmlabError, match=f"non-finite values in {name}"):
        load(folder)
    code, _, err = run_cli(capsys, "generate", folder, "--prompt", "ab")
    assert_one_error(code, err, str(folder / "model.safetensors"), "non-finite", name)


def test_gguf_with_non_finite_weight_is_refused(tmp_path, capsys):
    pytest.importorskip("gguf")
    from tests.helpers.gguf_files import tiny_llama_hf, write_llama_gguf

    model = tiny_llama_hf()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    path = write_llama_gguf(tmp_path / "bad.gguf", model)
    code, _, err = run_cli(capsys, "generate", path, "--prompt", "ab")
    assert_one_error(code, err, str(path), "non-finite values in blk.0.ffn_down.weight")
