"""``train.precision: auto``: bf16 autocast only where the device has bf16 units (else fp32).

On a CPU without bf16 arithmetic (an AMD EPYC with AVX2 only) the default Mini-GPT trained at
98 characters/s in bf16 against 2,400 in fp32, so ``auto`` must pick fp32 there, and a run must
save the precision it actually used (a resumed run keeps it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmlab.config import RunConfig, TrainConfig, diff_configs, load_config
from lmlab.errors import ConfigError
from lmlab.training import hardware
from lmlab.training.resolve import FILLED_IN, SEQ2SEQ_IDS, FillIns, fill_in
from tests.helpers import tiny_config

CPU = torch.device("cpu")


def _cpuinfo(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cpuinfo"
    p.write_text(text)
    return p


def test_cpu_flags_read_the_first_cpus_flags_or_features(tmp_path: Path):
    x86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 fma\n\n"
    x86 += "processor\t: 1\nflags\t\t: fpu avx512_bf16\n"
    assert hardware.cpu_flags(_cpuinfo(tmp_path, x86)) == {"fpu", "sse2", "avx2", "fma"}
    arm = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\nCPU implementer\t: 0x41\n"
    assert "bf16" in hardware.cpu_flags(_cpuinfo(tmp_path, arm))
    assert hardware.cpu_flags(tmp_path / "absent") == set()
    assert hardware.cpu_flags(_cpuinfo(tmp_path, "model name : x\n")) == set()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"avx2", "fma"}, "fp32"),  # the AVX2-only EPYC: bf16 is emulated, ~25x slower
        ({"avx512f", "avx512bw"}, "fp32"),  # AVX-512 without BF16 units
        ({"avx512f", "avx512_bf16"}, "bf16"),
        ({"amx_bf16", "amx_tile"}, "bf16"),
        ({"asimd", "bf16"}, "bf16"),  # Arm
        (set(), "fp32"),  # unknown (no /proc/cpuinfo)
    ],
)
def test_auto_is_bf16_only_on_cpus_with_bf16_units(monkeypatch, flags, expected):
    assert hardware.has_fast_bf16(CPU, flags) is (expected == "bf16")
    monkeypatch.setattr(hardware, "_this_cpu_flags", lambda: frozenset(flags))
    assert hardware.resolve_precision("auto", CPU) == expected
    for given in ("bf16", "fp32"):  # an explicit choice is never second-guessed
        assert hardware.resolve_precision(given, CPU) == given
    assert hardware.planned_precision(TrainConfig(precision="auto", device="cpu")) == expected


def test_mps_never_resolves_to_bf16():
    assert hardware.resolve_precision("auto", torch.device("mps")) == "fp32"


def test_auto_is_the_default_and_a_validated_choice():
    assert TrainConfig().precision == "auto"
    assert load_config("configs/minigpt.yaml").train.precision == "auto"
    cfg = tiny_config(train={"precision": "auto"})
    assert cfg.train.precision == "auto"
    with pytest.raises(ConfigError, match=r"train\.precision: 'fp16' is not allowed"):
        tiny_config(train={"precision": "fp16"})


def test_fill_in_replaces_auto_and_nothing_else():
    assert "train.precision" in FILLED_IN
    fills = FillIns(50, dict.fromkeys(SEQ2SEQ_IDS), 32, 10, precision="bf16")
    assert fill_in(tiny_config(train={"precision": "auto"}), fills).train.precision == "bf16"
    assert fill_in(tiny_config(train={"precision": "fp32"}), fills).train.precision == "fp32"
    saved: RunConfig = fill_in(tiny_config(train={"precision": "auto"}), fills)
    probe = fill_in(tiny_config(train={"precision": "auto"}), FillIns.of_run(saved))
    assert "train.precision" not in diff_configs(saved, probe)  # resume with auto: no change
    other = fill_in(tiny_config(train={"precision": "fp32"}), FillIns.of_run(saved))
    assert "train.precision" in diff_configs(saved, other)  # an explicit change is one


@pytest.mark.parametrize("flags", [frozenset({"avx2"}), frozenset({"avx512_bf16"})])
def test_a_run_saves_the_precision_auto_chose(tmp_path: Path, monkeypatch, flags):
    from lmlab.training import trainer

    monkeypatch.setattr(hardware, "_this_cpu_flags", lambda: flags)
    want = "bf16" if "avx512_bf16" in flags else "fp32"
    cfg = tiny_config(train={"precision": "auto", "max_steps": 1, "eval_every": 1})
    trainer.train(cfg, out=tmp_path / "run", progress=False)
    saved = load_config(tmp_path / "run" / "config.yaml")
    assert saved.train.precision == want


def test_the_log_says_what_auto_chose(tmp_path: Path, monkeypatch, capsys):
    from lmlab.training import trainer

    monkeypatch.setattr(hardware, "_this_cpu_flags", lambda: frozenset({"avx2"}))
    cfg = tiny_config(train={"precision": "auto", "max_steps": 1, "eval_every": 1})
    trainer.train(cfg, out=tmp_path / "run", progress=None)
    assert "precision: auto -> fp32 (cpu has no bf16 units)" in capsys.readouterr().err
    explicit = tiny_config(train={"precision": "fp32", "max_steps": 1, "eval_every": 1})
    trainer.train(explicit, out=tmp_path / "run2", progress=None)
    assert "precision: auto" not in capsys.readouterr().err


def test_the_log_notes_a_warmup_longer_than_the_run(tmp_path: Path, capsys):
    from lmlab.training import trainer

    cfg = tiny_config(train={"max_steps": 2, "eval_every": 2, "warmup_steps": 8})
    trainer.train(cfg, out=tmp_path / "run", progress=None)
    err = capsys.readouterr().err
    assert "note: train.warmup_steps 8 > max_steps 2: the learning rate ends at 25% of" in err
    ok = tiny_config(train={"max_steps": 2, "eval_every": 2, "warmup_steps": 2})
    trainer.train(ok, out=tmp_path / "run2", progress=None)
    assert "warmup_steps" not in capsys.readouterr().err
