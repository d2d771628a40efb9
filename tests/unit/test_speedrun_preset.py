"""configs/speedrun.yaml and benchmarks/time_to_loss.py: the preset loads, validates, builds and
trains (through ``lmlab.train`` and through the benchmark's lmlab path) on a tiny slice; the
benchmark's nanoGPT reimplementation has the parameter count nanoGPT reports for its README CPU
shape, an init loss of ln(vocab), and nanoGPT's learning-rate schedule."""

import math
from pathlib import Path

import pytest
import torch

from lmlab.config import load_config
from lmlab.models import build_model
from lmlab.training.trainer import train
from tests.helpers.benchmarks import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "configs" / "speedrun.yaml"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("time_to_loss")


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    """The first 12,000 characters of tinyshakespeare (its val tenth: 1,200)."""
    from lmlab.data.corpus import load_corpus

    path = tmp_path_factory.mktemp("corpus") / "slice.txt"
    path.write_text(load_corpus("tinyshakespeare").splits["train"][:12_000], encoding="utf-8")
    return path


def test_preset_loads_validates_and_builds_its_model():
    cfg = load_config(PRESET)
    cfg.model.vocab_size = 65
    cfg.validate()
    assert cfg.name == "speedrun"
    model = build_model(cfg.model)
    n = sum(p.numel() for p in model.parameters())
    assert 100_000 < n < 5_000_000, n
    assert load_config(None).train.optimizer == "adamw"  # library defaults untouched


def test_preset_trains_two_steps_through_lmlab_train(tmp_path, tiny_corpus):
    cfg = load_config(
        PRESET,
        [f"data.corpus={tiny_corpus}", "train.eval_batches=2", "train.precision=fp32"],
    )
    result = train(cfg, out=tmp_path / "run", max_steps=2, progress=False)
    assert result.step == 2
    assert result.val_loss is not None and math.isfinite(result.val_loss)
    assert result.tokens == 2 * cfg.train.batch_size * cfg.model.max_seq_len


def test_benchmark_lmlab_path_takes_steps_and_stops_at_target(bench, tiny_corpus):
    base = ["--quick", "--only", "lmlab", "--set", f"data.corpus={tiny_corpus}"]
    base += ["--set", "train.precision=fp32", "--set", "train.max_steps=3"]
    base += ["--set", "train.eval_every=2"]
    (r,) = bench.main(base)
    assert not r.reached and r.steps == 3 and [s for s, _ in r.history] == [0, 2, 3]
    assert r.train_s > 0 and r.eval_s > 0 and r.wall_s == r.train_s + r.eval_s
    (hit,) = bench.main([*base, "--target", "100"])  # any loss reaches it: stops at step 0
    assert hit.reached and hit.steps == 0 and hit.tokens == 0 and len(hit.history) == 1


def test_nanogpt_model_has_nanogpts_reported_parameter_count_and_uniform_init_loss(bench):
    c = bench.NanoConfig()  # 4 layers, 4 heads, d 128, block 64, vocab 65, bias False
    torch.manual_seed(1337)
    model = bench.NanoGPT(c)
    # nanoGPT's get_num_params: 4 x 12 x 128^2 (attention 4 d^2, MLP 8 d^2) + 9 x 128 LayerNorm
    # weights + 65 x 128 tied embedding = 795,904 ("number of parameters: 0.80M")
    assert bench.nanogpt_param_formula(c) == 4 * 12 * 128**2 + 9 * 128 + 65 * 128 == 795_904
    assert model.num_params() == 795_904
    assert model.num_params(non_embedding=False) == 795_904 + 64 * 128  # + wpe
    assert model.lm_head.weight is model.wte.weight
    assert not any(n.endswith("bias") for n, _ in model.named_parameters())
    idx = torch.randint(0, 65, (12, 64))
    with torch.no_grad():
        loss = float(model(idx, torch.roll(idx, -1, 1)))
    assert abs(loss - math.log(65)) < 0.1, loss  # std-0.02 weights: near-uniform logits


def test_nanogpt_schedule_is_train_py_get_lr(bench):
    lr = lambda it: bench.nanogpt_lr(it, 1e-3, 1e-4, 100, 2000)  # noqa: E731
    assert lr(0) == pytest.approx(1e-3 / 101)
    assert lr(99) == pytest.approx(1e-3 * 100 / 101)
    assert lr(100) == pytest.approx(1e-3)
    assert lr(1050) == pytest.approx(1e-4 + 0.5 * 9e-4)  # halfway through the cosine
    assert lr(2000) == pytest.approx(1e-4)
    assert lr(2001) == 1e-4
