"""configs/minigpt.yaml, the default run (`make run`): the library's default model with a tuned
training recipe. The preset differs from the library defaults in exactly the recipe fields (the
defaults stay the tutorial Mini-GPT: AdamW, cosine, tied embeddings), and training it goes
through Muon and an untied head while the log keeps the line formats scripts parse."""

import re
from pathlib import Path

import pytest
from safetensors import safe_open

from lmlab.cli import main
from lmlab.config import diff_configs, load_config
from lmlab.training.optim import muon_param_names

ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "configs" / "minigpt.yaml"

# The fields the default run sets away from the library defaults, and their values.
RECIPE = {
    "model.tie_embeddings": False,
    "train.optimizer": "muon",
    "train.lr": 3e-3,
    "train.schedule": "wsd",
    "train.decay_fraction": 0.3,
    "train.warmup_steps": 50,
    "train.max_steps": 575,
}


def _get(cfg, dotted):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def test_preset_is_the_default_model_and_data_with_the_recipe_fields_only():
    preset, defaults = load_config(PRESET), load_config(None)
    assert diff_configs(defaults, preset) == sorted(RECIPE)
    assert {k: _get(preset, k) for k in RECIPE} == RECIPE
    assert preset.train.muon_lr == 0.02  # measured best of 0.02 / 0.03 / 0.05 (the default)
    # the library defaults stay the tutorial Mini-GPT
    assert defaults.model.tie_embeddings is True
    assert (defaults.train.optimizer, defaults.train.schedule) == ("adamw", "cosine")


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    """The first 12,000 characters of tinyshakespeare."""
    from lmlab.data.corpus import load_corpus

    path = tmp_path_factory.mktemp("corpus") / "slice.txt"
    path.write_text(load_corpus("tinyshakespeare").splits["train"][:12_000], encoding="utf-8")
    return path


def test_preset_trains_with_muon_and_an_untied_head_and_keeps_the_log_lines(
    tmp_path, tiny_corpus, capsys
):
    run = tmp_path / "run"
    small = ["model.d_model=32", "model.n_layers=2", "model.max_seq_len=32"]
    small += ["train.max_steps=4", "train.eval_every=2", "train.eval_batches=2"]
    small += ["train.warmup_steps=1", "train.precision=fp32", f"data.corpus={tiny_corpus}"]
    argv = ["train", "--config", str(PRESET), "--out", str(run)]
    assert main([*argv, *(a for s in small for a in ("--set", s))]) == 0
    err = capsys.readouterr().err
    steps = re.findall(r"^step (\d+)/4  val_loss (\d+\.\d{4})  [\d,]+ tokens/s$", err, re.M)
    assert [s for s, _ in steps] == ["0", "2", "4"], err
    assert float(steps[-1][1]) < float(steps[0][1])  # it learns
    assert re.search(
        rf"^trained {re.escape(str(run))} to step 4: val_loss \d+\.\d{{4}} ", err, re.M
    )
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        weights = set(f.keys())
    with safe_open(str(ckpt / "optimizer.safetensors"), "pt") as f:
        state = set(f.keys())
    assert {"embed.weight", "lm_head.weight"} <= weights  # untied: a head of its own
    from lmlab.models import build_model

    cfg = load_config(PRESET, small[:3])
    cfg.model.vocab_size = 65
    hidden = muon_param_names(build_model(cfg.model))
    assert len(hidden) == 2 * 6  # q, k, v, o, up, down per layer
    assert {f"{n}::momentum_buffer" for n in hidden} <= state  # Muon holds the matrices
    assert not any(n.startswith(("embed.", "lm_head.")) and "momentum" in n for n in state)
    assert "lm_head.weight::exp_avg" in state  # AdamW holds the head
