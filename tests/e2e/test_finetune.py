"""lmlab train --init-from: fine-tuning starts from a loaded model's weights, with its own
tokenizer and config, lowers the loss, and resumes like any run.

The models are tiny Hugging Face GPT-2 / Llama folders with random weights built in tmp (nothing
downloaded), with a character tokenizer.json covering the corpus.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from lmlab.cli import main  # noqa: E402
from lmlab.config import config_to_yaml  # noqa: E402
from lmlab.data.corpus import load_corpus  # noqa: E402
from lmlab.data.dataset import batch_rng, sample_batch  # noqa: E402
from lmlab.data.tokenizer import CharTokenizer  # noqa: E402
from lmlab.run import load_run  # noqa: E402
from lmlab.training.checkpoint import latest_checkpoint  # noqa: E402
from lmlab.training.metrics import read_metrics  # noqa: E402
from lmlab.training.trainer import train  # noqa: E402
from tests.helpers import tiny_config, write_hf_folder  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first 20,000 characters of tinyshakespeare."""
    text = "".join(load_corpus("tinyshakespeare").splits.values())[:20_000]
    path = tmp_path_factory.mktemp("corpus") / "shakespeare.txt"
    path.write_text(text, encoding="utf-8")
    return path


def _hf_folder(tmp_path: Path, corpus: Path, family: str) -> tuple[Path, torch.nn.Module]:
    chars = sorted(set(corpus.read_text(encoding="utf-8")))
    v = len(chars)
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=v, n_positions=32, n_embd=32, n_layer=2, n_head=4, n_inner=64
        )
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=v,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            tie_word_embeddings=False,
        )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(cfg, key, None)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    folder = tmp_path / f"hf-{family}"
    return write_hf_folder(folder, hf, CharTokenizer(chars)), hf


def _config(corpus: Path, max_steps: int):
    return tiny_config(
        data={"corpus": str(corpus)},
        train={"max_steps": max_steps, "eval_every": 100, "lr_decay_steps": 4},
    )


def test_finetuning_starts_from_the_loaded_weights_and_lowers_the_loss(tmp_path, corpus):
    folder, hf = _hf_folder(tmp_path, corpus, "gpt2")
    cfg = _config(corpus, 12)
    cfg.train.lr_decay_steps = 12
    res = train(cfg, out=tmp_path / "ft", progress=False, init_from=folder)
    run = load_run(tmp_path / "ft", "cpu")
    # the run is the loaded model: its config and its own tokenizer, not a fitted one
    assert run.config.model.d_model == 32 and run.config.model.position.kind == "learned"
    assert run.tokenizer.encode("ROMEO:") == CharTokenizer.train(
        corpus.read_text(encoding="utf-8"), cfg.data.tokenizer
    ).encode("ROMEO:")
    # step-0 val loss = transformers' loss of the loaded model on the same windows
    val = np.asarray(run.tokenizer.encode(load_corpus(str(corpus)).split("val")))
    losses = []
    for i in range(cfg.train.eval_batches):
        x, y = sample_batch(
            val, cfg.train.batch_size, 32, batch_rng(cfg.train.seed, 0, i, stream=1)
        )
        with torch.no_grad():
            losses.append(float(F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten())))
    step0 = next(r["val_loss"] for r in read_metrics(tmp_path / "ft") if "val_loss" in r)
    assert math.isclose(step0, sum(losses) / len(losses), rel_tol=1e-5)
    assert step0 > 3.5  # a random model: about ln(vocab) nats
    assert res.val_loss is not None and res.val_loss < step0 - 0.3


def test_a_finetuning_run_resumes_like_any_run(tmp_path, corpus):
    """2 steps via the CLI, resumed to 4, give exactly the weights of 4 uninterrupted steps."""
    folder, _ = _hf_folder(tmp_path, corpus, "llama")
    train(_config(corpus, 4), out=tmp_path / "whole", progress=False, init_from=folder)
    yaml = tmp_path / "ft.yaml"
    yaml.write_text(config_to_yaml(_config(corpus, 4)))
    split = str(tmp_path / "split")
    common = ["--config", str(yaml), "--out", split, "--no-progress"]
    assert main(["train", "--init-from", str(folder), "--max-steps", "2", *common]) == 0
    assert main(["train", "--resume", split, "--max-steps", "4", "--no-progress"]) == 0
    whole = load_file(str(latest_checkpoint(tmp_path / "whole") / "model.safetensors"))
    resumed = load_file(str(latest_checkpoint(split) / "model.safetensors"))
    assert whole.keys() == resumed.keys()
    for key, value in whole.items():
        assert torch.equal(resumed[key], value), key
    assert load_run(split, "cpu").step == 4
