"""End-to-end: every subcommand in-process through lmlab.cli.main, on a tiny preset."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from lmlab.cli import main
from lmlab.training.metrics import read_metrics

TINY_SET = [
    "--set",
    "model.d_model=32",
    "--set",
    "model.n_layers=2",
    "--set",
    "model.max_seq_len=32",
    "--set",
    "model.attention.n_heads=4",
    "--set",
    "train.batch_size=4",
    "--set",
    "train.eval_every=10",
    "--set",
    "train.eval_batches=2",
    "--set",
    "train.log_every=1",
    "--set",
    "train.warmup_steps=3",
    "--set",
    "train.lr=3e-3",
    "--set",
    "train.precision=fp32",
]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


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


def test_resume_refuses_changed_settings(tiny_run: Path, tmp_path: Path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_run, copy)
    code, _, err = run_cli(capsys, "train", "--resume", str(copy), "--set", "model.n_layers=4")
    assert code == 2
    assert "these settings differ from it: model.n_layers" in err
    assert "Traceback" not in err


def test_existing_run_folder_is_not_overwritten(tiny_run: Path, capsys):
    code, _, err = run_cli(capsys, "train", "--out", str(tiny_run), *TINY_SET)
    assert code == 2 and "already holds a run; continue it with --resume" in err


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


def test_generate_bad_inputs(tiny_run: Path, tmp_path: Path, capsys):
    code, _, err = run_cli(capsys, "generate", str(tiny_run), "--prompt", "Ωmega")
    assert code == 2 and "outside this character-level vocabulary" in err and "'Ω'" in err
    code, out, err = run_cli(
        capsys, "generate", str(tiny_run), "--prompt", "x" * 100, "--max-new-tokens", "3"
    )
    assert code == 0 and "keeping its last 32 tokens" in err
    empty_run = tmp_path / "empty"
    shutil.copytree(tiny_run, empty_run, ignore=shutil.ignore_patterns("checkpoints"))
    code, _, err = run_cli(capsys, "generate", str(empty_run))
    assert code == 2 and "has no checkpoint yet" in err
    code, _, err = run_cli(capsys, "eval", str(tmp_path / "nowhere"))
    assert code == 2 and "run folder not found" in err


def test_corrupt_checkpoint_gives_one_line(tiny_run: Path, tmp_path: Path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_run, bad)
    weights = bad / "checkpoints" / "step-000030" / "model.safetensors"
    weights.write_bytes(b"\x00garbage" * 10)
    code, _, err = run_cli(capsys, "generate", str(bad))
    assert code == 2
    assert err.startswith("error: checkpoint file") and "is corrupt" in err
    assert len(err.strip().splitlines()) == 1


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
    code, _, err = run_cli(capsys, "eval", str(tiny_run), "--split", "test")
    assert code == 2 and "has no 'test' split; it has: train, val" in err


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


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "missing.txt", "corpus file not found: {p}"),
        (lambda d: _write(d / "empty.txt", b""), "corpus file {p} is empty"),
        (lambda d: _write(d / "latin.txt", "na\xefve".encode("latin-1")), "is not UTF-8 text"),
    ],
    ids=["missing", "empty", "not-utf8"],
)
def test_bad_corpus_is_one_clear_error(tmp_path: Path, capsys, make, message):
    p = make(tmp_path)
    code, _, err = run_cli(
        capsys, "train", "--data", str(p), "--out", str(tmp_path / "r"), *TINY_SET
    )
    assert code == 2
    assert message.format(p=p) in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_bad_config_is_one_clear_error(tmp_path: Path, capsys):
    code, _, err = run_cli(capsys, "train", "--set", "model.attention.n_head=8")
    assert code == 2
    assert "unknown config field 'model.attention.n_head' (did you mean 'n_heads'?)" in err
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  norm:\n    kind: batchnorm\n")
    code, _, err = run_cli(capsys, "train", "--config", str(cfg))
    assert code == 2 and "model.norm.kind: unknown norm kind 'batchnorm'" in err
    assert "allowed: layernorm, rmsnorm" in err


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
    import lmlab.training.trainer as trainer

    real, calls = trainer.sample_batch, []

    def interrupt_on_fifth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5 + trainer_eval_batches:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    trainer_eval_batches = 2  # the step-0 evaluation draws 2 batches first
    monkeypatch.setattr(trainer, "sample_batch", interrupt_on_fifth)
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "--out", str(out), "--max-steps", "20", *TINY_SET)
    assert code == 130
    assert "interrupted at step 4; checkpoint saved" in err and f"--resume {out}" in err
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000004"
    monkeypatch.setattr(trainer, "sample_batch", real)
    assert run_cli(capsys, "train", "--resume", str(out), "--max-steps", "6")[0] == 0


def test_non_finite_weights_are_a_corrupt_checkpoint(tiny_run: Path, tmp_path: Path, capsys):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "nan"
    shutil.copytree(tiny_run, bad)
    path = bad / "checkpoints" / "step-000030" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["final_norm.weight"][0] = float("nan")
    save_file(tensors, str(path))
    code, out, err = run_cli(capsys, "eval", str(bad))
    assert code == 2 and "is corrupt: non-finite values in final_norm.weight" in err
    assert out == ""


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "{run}", "--batch-size", "0"], "--batch-size must be >= 1"),
        (["eval", "{run}", "--max-tokens", "-5"], "--max-tokens must be >= 2"),
        (["eval", "{run}", "--stride", "0"], "--stride must be between 1 and the context length"),
        (["eval", "{run}", "--stride", "33"], "--stride must be between 1 and the context length"),
        (["eval", "{run}", "--data", "{tmp}"], "is a folder, not a text file"),
        (["generate", "{run}", "--temperature", "nan"], "--temperature must be a finite number"),
        (["generate", "{run}", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["generate", "{run}", "--prompt", ""], "the prompt is empty"),
        (["generate", "{run}", "--device", "cuda"], "torch sees no CUDA GPU"),
        (["train", "--resume", "{run}", "--out", "{tmp}/x"], "--out cannot be combined"),
        (["train", "--resume", "{run}", "--data", "{tmp}/x.txt"], "differ from it: data.corpus"),
        (["train", "--resume", "{tmp}"], "is not an lmlab run folder"),
        (["train", "--time-budget", "0"], "--time-budget must be a positive number"),
        (["train", "--set", "name=../escape"], "must be a plain folder name"),
        (["train", "--out", "{run}/config.yaml"], "is a file; give a folder"),
    ],
)
def test_catalogue_of_bad_inputs(tiny_run: Path, tmp_path: Path, capsys, argv, message):
    argv = [a.format(run=tiny_run, tmp=tmp_path) for a in argv]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, err
    assert message in err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert out == ""  # nothing half-printed (a generate prompt is echoed only once accepted)


def test_list_one_family_shows_its_config_field(capsys):
    code, out, _ = run_cli(capsys, "list", "position")
    assert code == 0
    assert out.splitlines()[0] == "position (model.position.kind):"
    assert "norm" not in out and "Su et al. 2021" in out
    code, _, err = run_cli(capsys, "list", "positions")
    assert code == 2 and "unknown family 'positions'" in err


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
