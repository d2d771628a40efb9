"""lmlab never unpickles a user's file: a pickle planted in a run folder (beside the checkpoint,
or in place of one of its files) is ignored or refused by every command that reads the run, and
its payload never runs.

The payload creates a marker file when unpickled; the first test proves it is live (plain
``pickle.loads`` and ``torch.load(weights_only=False)`` do run it), so the marker's absence after
each command means the file was never unpickled.
"""

from __future__ import annotations

import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

import lmlab
from lmlab.errors import LmlabError
from tests.helpers import run_cli

SRC = Path(__file__).resolve().parents[2] / "src" / "lmlab"
CKPT = "checkpoints/step-000030"


class Payload:
    """Unpickling this runs code: it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def plant(path: Path, marker: Path, fmt: str) -> None:
    """Write a malicious file: a raw pickle, or torch.save's zip format (what .pt/.bin hold)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "pickle":
        path.write_bytes(pickle.dumps(Payload(marker)))
    else:
        torch.save({"state": Payload(marker)}, path)


def test_the_payload_is_live(tmp_path: Path):
    marker = tmp_path / "pwned"
    plant(tmp_path / "a.pkl", marker, "pickle")
    pickle.loads((tmp_path / "a.pkl").read_bytes())
    assert marker.exists()
    marker.unlink()
    plant(tmp_path / "b.pt", marker, "torch")
    with pytest.raises(pickle.UnpicklingError):  # weights_only=True refuses it ...
        torch.load(tmp_path / "b.pt", weights_only=True)
    assert not marker.exists()
    torch.load(tmp_path / "b.pt", weights_only=False)  # ... a plain load runs it
    assert marker.exists()


EXTRA = [  # files other tools keep beside weights; lmlab has no reason to open them
    (f"{CKPT}/optimizer.pt", "torch"),
    (f"{CKPT}/scheduler.pt", "torch"),
    (f"{CKPT}/rng_state.pth", "torch"),
    (f"{CKPT}/model.pt", "torch"),
    ("pytorch_model.bin", "torch"),
    ("training_args.bin", "torch"),
    ("data/train.pkl", "pickle"),
    ("checkpoints/state.pkl", "pickle"),
]


def test_planted_pickles_beside_a_run_are_never_opened(tiny_run: Path, tmp_path: Path, capsys):
    run, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(tiny_run, run)
    for name, fmt in EXTRA:
        plant(run / name, marker, fmt)
    planted = {name: (run / name).read_bytes() for name, _ in EXTRA}

    assert run_cli(capsys, "eval", str(run), "--max-tokens", "500")[0] == 0
    assert run_cli(capsys, "generate", str(run), "--max-new-tokens", "5", "--seed", "1")[0] == 0
    assert run_cli(capsys, "train", "--resume", str(run), "--max-steps", "31")[0] == 0
    model, tokenizer = lmlab.load(run)
    assert tokenizer is not None and model is not None

    assert not marker.exists()
    assert {name: (run / name).read_bytes() for name, _ in EXTRA} == planted  # left alone


REPLACED = [  # a pickle in place of each file lmlab does read: refused as corrupt, never run
    ("model.safetensors", "eval", "is corrupt"),
    ("model.safetensors", "generate", "is corrupt"),
    ("optimizer.safetensors", "train", "optimizer.safetensors is corrupt"),
    ("trainer_state.json", "eval", "trainer_state.json is not"),
    ("tokenizer.json", "generate", "is corrupt or not a tokenizer.json"),
    ("config.yaml", "eval", "not valid YAML"),
    ("latest", "generate", "is empty or damaged"),
]


@pytest.mark.parametrize("fmt", ["pickle", "torch"])
@pytest.mark.parametrize("name, command, message", REPLACED, ids=[r[0] for r in REPLACED])
def test_a_pickle_in_place_of_a_run_file_is_refused(
    tiny_run: Path, tmp_path: Path, capsys, name, command, message, fmt
):
    run, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(tiny_run, run)
    where = {
        "config.yaml": run,
        "tokenizer.json": run,
        "latest": run / "checkpoints",
    }.get(name, run / CKPT)
    plant(where / name, marker, fmt)
    argv = {"train": ["train", "--resume", str(run), "--max-steps", "31"]}.get(
        command, [command, str(run)]
    )
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not marker.exists()


def test_a_hugging_face_folder_with_only_a_pickled_checkpoint_is_refused(tmp_path: Path, capsys):
    hf, marker = tmp_path / "hf", tmp_path / "pwned"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama", "hidden_size": 32}')
    plant(hf / "pytorch_model.bin", marker, "torch")
    with pytest.raises(LmlabError, match="no model.safetensors .pytorch_model.bin is a pickle"):
        lmlab.load(hf)
    code, _, err = run_cli(capsys, "generate", str(hf))
    assert code == 2 and "pytorch_model.bin is a pickle, which lmlab never loads" in err
    assert not marker.exists()


UNSAFE = [
    (r"\bpickle\.loads?\(", "pickle.load"),
    (r"\btorch\.load\((?![^)]*weights_only\s*=\s*True)", "torch.load without weights_only=True"),
    (r"allow_pickle\s*=\s*True", "numpy allow_pickle=True"),
    (r"\byaml\.(unsafe_)?load\(", "yaml.load (not safe_load)"),
    (r"\b(dill|joblib|cloudpickle|shelve|marshal)\b", "another unpickler"),
    (r"\btorch\.load\(", "torch.load (weights_only is no design guarantee: refuse pickles)"),
    (
        r"(import|from) torch\.distributed\.checkpoint\b|\bdcp\.load\(",
        "DCP (its metadata: a pickle)",
    ),
    (r"\bFileSystemReader\(", "DCP's reader"),
]


def test_no_unpickling_loader_anywhere_in_lmlab():
    """No unpickling reader in lmlab's source, and none reached through torch: no
    torch.distributed.checkpoint load (its .metadata is a pickle), no torch.load at all."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        for pattern, what in UNSAFE:
            for m in re.finditer(pattern, text):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{path.relative_to(SRC)}:{line}: {what}")
    assert found == []


def _legacy_sharded_checkpoint(ckpt: Path, marker: Path, keep_optimizer: bool) -> None:
    """Craft the torch.distributed.checkpoint layout earlier lmlab wrote: ``sharded/.metadata``
    (a pickle, here one whose payload creates ``marker``), a shard file, and a manifest whose
    SHA-256 sums are recomputed to match, as anyone crafting the folder can."""
    import hashlib
    import json

    plant(ckpt / "sharded" / ".metadata", marker, "pickle")
    plant(ckpt / "sharded" / "__0_0.distcp", marker, "torch")
    if not keep_optimizer:
        (ckpt / "optimizer.safetensors").unlink()
    files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    sums = {
        p.relative_to(ckpt).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files
    }
    manifest = {"format": "lmlab-sharded-checkpoint-1", "sha256": sums}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def test_a_crafted_sharded_checkpoint_is_never_unpickled(tiny_run: Path, tmp_path: Path, capsys):
    """The old DCP layout with a matching manifest: resume refuses it in one line, unchanged;
    eval reads only model.safetensors. The .metadata payload never runs."""
    from tests.helpers import assert_one_error, assert_unchanged, snapshot

    run, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(tiny_run, run)
    _legacy_sharded_checkpoint(run / CKPT, marker, keep_optimizer=False)
    before = snapshot(run)
    code, _, err = run_cli(capsys, "train", "--resume", str(run), "--max-steps", "31")
    assert_one_error(code, err, f"{run / CKPT} keeps its optimizer state in sharded/", "pickle")
    assert_unchanged(run, before)
    assert run_cli(capsys, "eval", str(run), "--max-tokens", "200")[0] == 0
    assert not marker.exists()


def test_a_sharded_folder_beside_the_safetensors_is_never_opened(
    tiny_run: Path, tmp_path: Path, capsys
):
    run, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(tiny_run, run)
    _legacy_sharded_checkpoint(run / CKPT, marker, keep_optimizer=True)
    assert run_cli(capsys, "train", "--resume", str(run), "--max-steps", "31")[0] == 0
    assert not marker.exists()
