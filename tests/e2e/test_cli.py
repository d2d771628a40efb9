"""End-to-end: every subcommand in-process through lmlab.cli.main, on a tiny preset.

Bad inputs (one error line, no traceback, run folders untouched) are in tests/catalogue/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lmlab.cli import main
from lmlab.training.metrics import read_metrics
from tests.helpers import TINY_SET, run_cli


def test_trained_run_folder_has_everything(tiny_run: Path):
    assert (tiny_run / "config.yaml").is_file() and not (tiny_run / "config.json").exists()
    assert (tiny_run / "tokenizer.json").is_file()
    ckpt = tiny_run / "checkpoints" / "step-000030"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
    ]
    assert (tiny_run / "checkpoints" / "latest").read_text().strip() == "step-000030"
    assert list((tiny_run / "tb").glob("events.out.tfevents.*"))
    assert (tiny_run / "loss.png").read_bytes()[:4] == b"\x89PNG"
    cfg = yaml.safe_load((tiny_run / "config.yaml").read_text())
    assert cfg["model"]["vocab_size"] == 65 and cfg["train"]["lr_decay_steps"] == 30
    records = read_metrics(tiny_run)
    train = [r for r in records if "train_loss" in r]
    for key in (
        "step",
        "tokens",
        "elapsed_s",
        "lr",
        "tokens_per_s",
        "grad_norm",
        "clipped",
        "train_loss",
        "mfu",
    ):
        assert key in train[-1], key
    assert train[-1]["tokens"] == 30 * 4 * 32
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert val[0] > 4.0 and val[-1] < val[0] - 0.8  # starts near ln(65) = 4.17, then learns
    assert sum(r["train_loss"] for r in train[-5:]) < sum(r["train_loss"] for r in train[:5])


def test_resume_continues_the_same_trajectory(tmp_path: Path, capsys):
    common = [*TINY_SET, "--set", "train.lr_decay_steps=12", "--set", "train.checkpoint_every=6"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert run_cli(capsys, "train", "--out", str(full), "--max-steps", "12", *common)[0] == 0
    assert run_cli(capsys, "train", "--out", str(part), "--max-steps", "6", *common)[0] == 0
    code, _, err = run_cli(capsys, "train", "--resume", str(part), "--max-steps", "12")
    assert code == 0, err
    a = {r["step"]: r["train_loss"] for r in read_metrics(full) if "train_loss" in r}
    b = {r["step"]: r["train_loss"] for r in read_metrics(part) if "train_loss" in r}
    assert sorted(b) == list(range(1, 13))
    for step in range(7, 13):
        assert b[step] == pytest.approx(a[step], abs=1e-6), step
    state = json.loads((part / "checkpoints" / "step-000012" / "trainer_state.json").read_text())
    assert state["step"] == 12 and state["val_loss_step"] == 12
    # Resuming a finished run does nothing, rewrites nothing, and says so.
    before = sorted(p.name for p in part.rglob("*"))
    code, _, err = run_cli(capsys, "train", "--resume", str(part))
    assert code == 0 and "is already at step 12" in err and "nothing to do" in err
    assert sorted(p.name for p in part.rglob("*")) == before


def test_generate_streams_text(tiny_run: Path, capsys):
    argv = ["generate", str(tiny_run), "--prompt", "ROMEO:", "--max-new-tokens", "40"]
    argv += ["--seed", "1", "--top-k", "10"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert out.startswith("ROMEO:") and len(out) == len("ROMEO:") + 40 + 1
    again = run_cli(capsys, *argv)[1]
    assert again == out  # same seed, same sample
    greedy = run_cli(
        capsys,
        "generate",
        str(tiny_run),
        "--prompt",
        "A",
        "--temperature",
        "0",
        "--max-new-tokens",
        "20",
        "--stop",
        "e",
        "--no-prompt",
    )[1]
    assert "e" not in greedy


def test_a_prompt_longer_than_the_context_keeps_its_end(tiny_run: Path, capsys):
    # Not an error (see tests/catalogue/ for those): the last max_seq_len tokens are kept.
    code, out, err = run_cli(
        capsys, "generate", str(tiny_run), "--prompt", "x" * 100, "--max-new-tokens", "3"
    )
    assert code == 0 and "keeping its last 32 tokens" in err
    assert err.startswith("warning: the prompt has 100 tokens") and len(err.splitlines()) == 1


def test_eval_prints_loss_perplexity_bits_per_byte(tiny_run: Path, capsys):
    code, out, _ = run_cli(capsys, "eval", str(tiny_run), "--max-tokens", "2000")
    assert code == 0
    values = dict(line.split(": ") for line in out.strip().splitlines())
    assert {"loss", "perplexity", "bits_per_byte"} <= values.keys()
    code, out, _ = run_cli(
        capsys, "eval", str(tiny_run), "--max-tokens", "2000", "--json", "--stride", "16"
    )
    res = json.loads(out)
    assert res["perplexity"] == pytest.approx(2.718281828 ** res["loss"], rel=1e-6)
    assert res["tokens"] == 1999


def test_eval_test_split_and_data_file(tmp_path: Path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    line = "the quick brown fox jumps over the lazy dog\n"
    (corpus / "train.txt").write_text(line * 200)
    (corpus / "valid.txt").write_text(line * 20)
    (corpus / "test.txt").write_text(line * 20)
    run = tmp_path / "run"
    code, _, err = run_cli(
        capsys, "train", "--data", str(corpus), "--out", str(run), "--max-steps", "5", *TINY_SET
    )
    assert code == 0, err
    code, out, _ = run_cli(capsys, "eval", str(run), "--split", "test", "--json")
    assert code == 0 and json.loads(out)["tokens"] == len(line) * 20 - 1
    code, out, _ = run_cli(capsys, "eval", str(run), "--data", str(corpus / "valid.txt"))
    assert code == 0 and "loss:" in out


def test_help_documents_every_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    top = capsys.readouterr().out
    for cmd in ("train", "eval", "generate", "list"):
        assert cmd in top
    for cmd, flags in {
        "train": [
            "--config",
            "--data",
            "--out",
            "--max-steps",
            "--time-budget",
            "--set",
            "--resume",
            "--device",
        ],
        "eval": ["--split", "--data", "--stride", "--json", "--device"],
        "generate": [
            "--prompt",
            "--max-new-tokens",
            "--temperature",
            "--top-k",
            "--top-p",
            "--repetition-penalty",
            "--stop",
            "--seed",
            "--device",
        ],
    }.items():
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        text = capsys.readouterr().out
        for flag in flags:
            assert flag in text, (cmd, flag)


def test_list_shows_registered_components(capsys):
    code, out, _ = run_cli(capsys, "list")
    assert code == 0
    for name in (
        "position (model.position.kind):",
        "rope",
        "sinusoidal",
        "norm (model.norm.kind):",
        "rmsnorm",
        "block (model.block.kind):",
        "pre",
        "swiglu",
        "geglu",
    ):
        assert name in out


def _write(p: Path, data: bytes) -> Path:
    p.write_bytes(data)
    return p


def test_a_start_that_failed_before_any_checkpoint_can_be_redone(tmp_path: Path, capsys):
    short = _write(tmp_path / "short.txt", b"To be, or not to be: that is the question.\n" * 5)
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "--data", str(short), "--out", str(out), *TINY_SET)
    assert code == 2 and "the val split has" in err and "fewer than one training window" in err
    longer = _write(tmp_path / "long.txt", b"To be, or not to be: that is the question.\n" * 60)
    code, _, err = run_cli(
        capsys, "train", "--data", str(longer), "--out", str(out), "--max-steps", "2", *TINY_SET
    )
    assert code == 0, err
    code, _, err = run_cli(capsys, "train", "--resume", str(out), "--max-steps", "1")
    assert code == 2 and "is already at step 2; --max-steps 1 would not extend it" in err


def test_interrupt_saves_a_checkpoint_and_says_how_to_resume(tmp_path: Path, capsys, monkeypatch):
    import lmlab.training.objectives as objectives  # the clm objective draws the batches

    real, calls = objectives.sample_batch, []

    def interrupt_on_fifth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5 + trainer_eval_batches:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    trainer_eval_batches = 2  # the step-0 evaluation draws 2 batches first
    monkeypatch.setattr(objectives, "sample_batch", interrupt_on_fifth)
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "--out", str(out), "--max-steps", "20", *TINY_SET)
    assert code == 130
    assert "interrupted at step 4; checkpoint saved" in err and f"--resume {out}" in err
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000004"
    monkeypatch.setattr(objectives, "sample_batch", real)
    assert run_cli(capsys, "train", "--resume", str(out), "--max-steps", "6")[0] == 0


def test_list_one_family_shows_its_config_field(capsys):
    code, out, _ = run_cli(capsys, "list", "position")
    assert code == 0
    assert out.splitlines()[0] == "position (model.position.kind):"
    assert "norm" not in out and "Su et al. 2021" in out


PRESETS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_every_preset_trains(preset: Path, tmp_path: Path, capsys):
    small = [
        "--set",
        "train.batch_size=2",
        "--set",
        "train.eval_batches=1",
        "--set",
        "train.precision=fp32",
    ]
    code, _, err = run_cli(
        capsys,
        "train",
        "--config",
        str(preset),
        "--out",
        str(tmp_path / "r"),
        "--max-steps",
        "2",
        *small,
    )
    assert code == 0, err
    assert (tmp_path / "r" / "checkpoints" / "step-000002" / "model.safetensors").is_file()


def test_inspect_counts_a_real_size_model_without_building_it(capsys):
    root = Path(__file__).resolve().parents[2] / "configs"
    code, out, _ = run_cli(
        capsys,
        "inspect",
        str(root / "mixtral.yaml"),
        "--json",
        "--set",
        "model.d_model=4096",
        "--set",
        "model.n_layers=32",
        "--set",
        "model.attention.n_heads=32",
        "--set",
        "model.attention.n_kv_heads=8",
        "--set",
        "model.ffn.d_ff=14336",
        "--set",
        "model.max_seq_len=32768",
        "--set",
        "data.tokenizer.vocab_size=32000",
    )  # 46.7B parameters: building it would need 187 GB
    info = json.loads(out)
    assert code == 0 and info["params_total"] == 46_702_792_704
    assert sum(info["components"].values()) == info["params_total"]


def test_inspect_a_run_folder_uses_its_vocabulary(tiny_run: Path, capsys):
    code, out, _ = run_cli(capsys, "inspect", str(tiny_run))
    assert code == 0 and "note:" not in out
    assert out.startswith("tiny: ") and "parameters" in out
