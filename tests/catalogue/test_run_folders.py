"""Run folders: trainer_state.json, metrics.jsonl, data/, checkpoints and ``latest``.

Each case damages one file of a copy of the tiny run and runs the command that reads it
(``train --resume`` reads them all; ``eval`` the config, pointer, state and weights). The promise:
one ``error:`` line naming the file and the field, exit 2, and the run folder byte-identical
afterwards (a failed resume never truncates or deletes anything).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import assert_one_error, assert_unchanged, run_cli, snapshot, within

CKPT = "checkpoints/step-000030"
STATE = f"{CKPT}/trainer_state.json"
MODEL = f"{CKPT}/model.safetensors"
OPTIMIZER = f"{CKPT}/optimizer.safetensors"


@pytest.fixture
def run(tiny_run: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny 30-step run."""
    copy = tmp_path / "run"
    shutil.copytree(tiny_run, copy)
    return copy


def resume(capsys, run: Path) -> tuple[int, str, str]:
    return run_cli(capsys, "train", "--resume", run, "--max-steps", "31", "--no-progress")


def refused(capsys, run: Path, command: str, *needles: str) -> str:
    """Run ``command`` on ``run``; assert one error holding the needles and nothing changed."""
    before = snapshot(run)
    argv = ["eval", run, "--max-tokens", "200"] if command == "eval" else None
    code, _, err = run_cli(capsys, *argv) if argv else resume(capsys, run)
    line = assert_one_error(code, err, *needles)
    assert_unchanged(run, before)
    assert snapshot(run) == before  # nothing added either
    return line


def edit_json(path: Path, change: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


# ---------------------------------------------------------------- trainer_state.json

STATES = {
    "step-nan": ('{"step": NaN, "tokens": 0}', "trainer_state.json is not valid JSON", "NaN"),
    "step-string": ('{"step": "30", "tokens": 0}', "step must be an integer", "'30'"),
    "step-negative": ('{"step": -1, "tokens": 0}', "step must be an integer", "-1"),
    "step-huge": ('{"step": 1000000000000000, "tokens": 0}', "step must be an integer"),
    "step-fraction": ('{"step": 30.5, "tokens": 0}', "step must be an integer", "30.5"),
    "step-bool": ('{"step": true, "tokens": 0}', "step must be an integer", "True"),
    "tokens-missing": ('{"step": 30}', "trainer_state.json has no tokens"),
    "loss-infinite": ('{"step": 30, "tokens": 0, "train_loss": 1e999}', "train_loss must be"),
    "world-size-zero": ('{"step": 30, "tokens": 0, "world_size": 0}', "world_size must be"),
    "not-an-object": ("[30, 0]", "must hold a JSON object"),
    "imported-from-number": (
        '{"step": 30, "tokens": 0, "imported_from": 5}',
        "imported_from must be a string or null",
    ),
    "duplicate-step": ('{"step": 30, "step": 2, "tokens": 0}', "duplicate key 'step'"),
}


@pytest.mark.parametrize(
    "text, needles", [(v[0], v[1:]) for v in STATES.values()], ids=STATES.keys()
)
def test_a_bad_trainer_state_is_refused_on_resume(run, capsys, text, needles):
    (run / STATE).write_text(text)
    refused(capsys, run, "train", "trainer_state.json", *needles)


def test_a_bad_trainer_state_is_refused_by_eval(run, capsys):
    edit_json(run / STATE, lambda s: s.update(step="thirty"))
    refused(capsys, run, "eval", f"{run / STATE}: step must be an integer")


# ---------------------------------------------------------------- metrics.jsonl


def _lines(run: Path) -> list[str]:
    return (run / "metrics.jsonl").read_text().splitlines()


def _replace_line(run: Path, index: int, text: str | bytes) -> None:
    lines = [line.encode() for line in _lines(run)]
    lines[index] = text if isinstance(text, bytes) else text.encode()
    (run / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n")


METRICS = {
    "not-an-object": ("[1, 2]", "line 2 is not a JSON object"),
    "not-json": ("garbage", "line 2 is not valid JSON"),
    "not-utf8": (b'{"step": 1, "x": "\xff\xfe"}', "is not UTF-8 text"),
    "step-missing": ('{"tokens": 0, "elapsed_s": 0.1}', "line 2: step must be an integer"),
    "step-string": ('{"step": "1", "tokens": 0, "elapsed_s": 0.1}', "line 2: step must be"),
    "loss-string": (
        '{"step": 1, "tokens": 0, "elapsed_s": 0.1, "train_loss": "low"}',
        "line 2: train_loss must be a finite number or null",
    ),
}


@pytest.mark.parametrize("text, needle", METRICS.values(), ids=METRICS.keys())
def test_a_damaged_metrics_line_is_refused_and_nothing_is_truncated(run, capsys, text, needle):
    # the resume would drop the records after step 30 from the file: first it reads every line
    _replace_line(run, 1, text)
    refused(capsys, run, "train", "metrics.jsonl", needle)


def test_a_metrics_file_that_is_a_fifo_is_refused_on_resume(run, capsys):
    """A FIFO as metrics.jsonl: the resume refuses it (was: skipped by the check, then the
    append-open blocked forever waiting for a reader)."""
    (run / "metrics.jsonl").unlink()
    os.mkfifo(run / "metrics.jsonl")
    with within(20):
        refused(capsys, run, "train", "metrics.jsonl", "FIFO")


def test_a_metrics_file_that_links_outside_the_run_is_refused(run, capsys, tmp_path):
    """metrics.jsonl a symlink to a file outside the run: refused, never read or rewritten."""
    outside = tmp_path / "elsewhere.jsonl"
    shutil.copy(run / "metrics.jsonl", outside)
    kept = outside.read_bytes()
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(outside)
    refused(capsys, run, "train", "metrics.jsonl", "leads outside")
    assert outside.read_bytes() == kept


def test_a_torn_last_metrics_line_is_dropped_on_resume(run, capsys):
    """A crash mid-write leaves a last line without its end: resume drops it, keeps the rest."""
    kept = _lines(run)
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 31, "tok')
    code, _, err = resume(capsys, run)
    assert code == 0, err
    lines = _lines(run)
    assert lines[: len(kept)] == kept
    assert [json.loads(line)["step"] for line in lines[len(kept) :]] == [31, 31]  # train, val


# ---------------------------------------------------------------- data/: meta.json, token cache


def _truncate_by_one_token(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-2])


def _out_of_vocabulary_id(path: Path) -> None:
    ids = np.fromfile(path, dtype=np.uint16)
    ids[7] = 65535
    ids.tofile(path)


DATA = {
    "meta-not-json": ("meta.json", lambda p: p.write_text("{"), "meta.json is not valid JSON"),
    "meta-tokens-negative": (
        "meta.json",
        lambda p: edit_json(p, lambda m: m["tokens"].update(train=-5)),
        "tokens must be non-negative token counts",
    ),
    "meta-dtype-object": (
        "meta.json",
        lambda p: edit_json(p, lambda m: m.update(dtype="object")),
        "dtype must be 'uint16' for vocab_size 65",
    ),
    "meta-split-outside": (
        "meta.json",
        lambda p: edit_json(p, lambda m: m["tokens"].update({"../../x": 0})),
        "keyed by split names",
    ),
    "meta-vocab-string": (
        "meta.json",
        lambda p: edit_json(p, lambda m: m.update(vocab_size="65")),
        "vocab_size must be a positive integer",
    ),
    "bin-truncated": ("train.bin", _truncate_by_one_token, "train.bin is ", "but", "tokens.train"),
    "bin-id-out-of-vocabulary": (
        "train.bin",
        _out_of_vocabulary_id,
        "train.bin holds id 65535, outside the vocabulary of 65",
    ),
}


@pytest.mark.parametrize(
    "name, damage, needles", [(v[0], v[1], v[2:]) for v in DATA.values()], ids=DATA.keys()
)
def test_a_damaged_token_cache_is_refused_on_resume(run, capsys, name, damage, needles):
    damage(run / "data" / name)
    refused(capsys, run, "train", f"{run / 'data' / name}", *needles)


# ---------------------------------------------------------------- paths out of the run folder


def _elsewhere(run: Path) -> Path:
    out = run.parent / "elsewhere"
    out.mkdir(exist_ok=True)
    return out


def _move_out(run: Path, rel: str) -> None:
    """Move ``rel`` out of the run and leave a symlink to it in its place."""
    target = _elsewhere(run) / Path(rel).name
    shutil.move(run / rel, target)
    (run / rel).symlink_to(target)


LINKS = {
    "latest": ("checkpoints/latest", "checkpoints/latest leads outside"),
    "checkpoint-folder": (CKPT, "step-000030 leads outside"),
    "checkpoints-folder": ("checkpoints", "checkpoints leads outside"),
    "model-weights": (MODEL, "model.safetensors leads outside"),
    "optimizer-state": (OPTIMIZER, "optimizer.safetensors leads outside"),
    "trainer-state": (STATE, "trainer_state.json leads outside"),
    "config": ("config.yaml", "config.yaml leads outside the run folder"),
    "tokenizer": ("tokenizer.json", "tokenizer.json leads outside the run folder"),
    "meta": ("data/meta.json", "which leads outside"),
}


@pytest.mark.parametrize("rel, needle", LINKS.values(), ids=LINKS.keys())
def test_a_symlink_out_of_the_run_folder_is_refused(run, capsys, rel, needle):
    _move_out(run, rel)
    refused(capsys, run, "train", needle)


# ---------------------------------------------------------------- weights and optimizer state


def test_a_config_edited_against_its_checkpoint_names_the_field(run, capsys):
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(text.replace("d_model: 32", "d_model: 64"))
    line = refused(
        capsys,
        run,
        "eval",
        f"{run / MODEL} has embed.weight of shape (65, 32) but the model built from the config "
        "has (65, 64): was model.d_model changed?",
    )
    assert "corrupt" not in line


def test_a_config_with_more_layers_names_the_missing_tensor(run, capsys):
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(text.replace("n_layers: 2", "n_layers: 3"))
    refused(capsys, run, "eval", "has no tensor layers.2.", "was model.n_layers changed?")


def test_a_weight_of_another_dtype_is_named(run, capsys):
    tensors = load_file(str(run / MODEL))
    tensors["final_norm.weight"] = tensors["final_norm.weight"].half()  # was cast silently
    save_file(tensors, str(run / MODEL))
    refused(capsys, run, "eval", "final_norm.weight as F16 but the model holds it as torch.float32")


def _edit_optimizer(run: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(run / OPTIMIZER))
    change(tensors)
    save_file(tensors, str(run / OPTIMIZER))


OPTIMIZER_CASES = {
    "moment-of-another-shape": (
        lambda t: t.update({"final_norm.weight::exp_avg": torch.zeros(3)}),
        "has final_norm.weight::exp_avg of shape (3,), but parameter final_norm.weight needs (32,)",
    ),
    "moment-missing": (
        lambda t: t.pop("final_norm.weight::exp_avg_sq"),
        "lacks final_norm.weight::exp_avg_sq",
    ),
    "moment-non-finite": (
        lambda t: t["final_norm.weight::exp_avg_sq"].fill_(float("nan")),
        "non-finite values (inf or NaN) in final_norm.weight::exp_avg_sq",
    ),
    "step-not-a-scalar": (
        lambda t: t.update({"final_norm.weight::step": torch.zeros(2)}),
        "final_norm.weight::step of shape (2,)",
    ),
    "moment-integer": (
        lambda t: t.update({"final_norm.weight::exp_avg": torch.zeros(32, dtype=torch.int64)}),
        "final_norm.weight::exp_avg as torch.int64, not floating point",
    ),
}


@pytest.mark.parametrize("change, needle", OPTIMIZER_CASES.values(), ids=OPTIMIZER_CASES.keys())
def test_bad_optimizer_state_is_refused_before_the_optimizer_uses_it(run, capsys, change, needle):
    _edit_optimizer(run, change)
    refused(capsys, run, "train", f"optimizer state {run / OPTIMIZER}", needle)


# ---------------------------------------------------------------- the corpus under a run


def test_a_corpus_changed_since_the_run_started_is_refused_on_resume(run: Path, capsys):
    """The corpus the run's config names now holds other text: resume used to rebuild data/
    from it silently (and train on it); it is refused, and data/ stays as it was."""
    import yaml

    from lmlab.data.corpus import load_corpus

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    text = load_corpus(cfg["data"]["corpus"], cfg["data"]["val_fraction"]).splits
    changed = run.parent / "changed.txt"
    changed.write_text(("".join(text.values()))[::-1], encoding="utf-8")  # same characters
    cfg["data"]["corpus"] = str(changed)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    refused(capsys, run, "resume", "is not the text this run started with", str(changed))


def test_a_data_folder_that_links_outside_the_run_is_refused(run, capsys, tmp_path):
    """data/ a symlink to an empty folder outside the run: the resume refuses it (was: the token
    cache was rebuilt into the folder outside, and read from there)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.rmtree(run / "data")
    (run / "data").symlink_to(elsewhere)
    refused(capsys, run, "train", f"token cache folder {run / 'data'} leads outside {run}")
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("entry", ["loss.png", "tb"])
def test_a_run_entry_that_links_outside_the_run_is_refused_on_resume(run, capsys, tmp_path, entry):
    """loss.png or tb/ a symlink to a file or folder outside the run: the resume refuses it (was:
    loss.png outside overwritten with the plot, TensorBoard events written into the folder
    outside)."""
    target = tmp_path / "elsewhere"
    if entry == "tb":
        target.mkdir()
        shutil.rmtree(run / entry)
    else:
        target.write_text("keep me")
        (run / entry).unlink()
    (run / entry).symlink_to(target)
    before = snapshot(tmp_path / "elsewhere") if entry == "tb" else None
    refused(capsys, run, "train", f"{run / entry} leads outside {run}")
    if entry == "tb":
        assert snapshot(target) == before == {}
    else:
        assert target.read_text() == "keep me"


def test_optimizer_state_that_lost_a_whole_parameter_is_refused(run, capsys):
    """A parameter with no state at all (every key of it gone) passed: AdamW may hold no state
    for a parameter that never got a gradient, so the file's header now lists the parameters
    that had state when it was written."""
    from safetensors import safe_open

    path = run / OPTIMIZER
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    assert metadata and "lmlab.params_with_state" in metadata
    tensors = load_file(str(path))
    for key in [k for k in tensors if k.startswith("final_norm.weight::")]:
        del tensors[key]
    save_file(tensors, str(path), metadata=metadata)
    refused(capsys, run, "train", f"optimizer state {path}", "lacks the state of final_norm.weight")


@pytest.mark.parametrize(
    "listed",
    ["{oops", '{"a": 1}', "[1, 2]", "[" * 5000 + "]" * 5000],
    ids=["not-json", "object", "numbers", "nested-5000"],
)
def test_optimizer_state_with_a_malformed_parameter_list_is_refused(run, capsys, listed):
    """The header's list of parameters with state: not JSON, not a list of names, or nested
    5000 deep (json.loads raised RecursionError: 'error: unexpected RecursionError')."""
    path = run / OPTIMIZER
    save_file(load_file(str(path)), str(path), metadata={"lmlab.params_with_state": listed})
    refused(capsys, run, "train", f"optimizer state {path}", "malformed lmlab.params_with_state")
