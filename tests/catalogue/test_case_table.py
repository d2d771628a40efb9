"""A catalogue of bad inputs: each one gives one clear ``error:`` line, a non-zero exit, no
traceback, and leaves every existing run folder exactly as it was.

Every case runs in-process through ``lmlab.cli.main``. ``{run}`` is the shared tiny run (never
modified: its files are hashed before and after each case), ``{copy}`` a fresh copy of it that the
case's ``setup`` may damage first (hashed after the damage, before the command), ``{tmp}`` the
case's own temporary folder.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lmlab.cli import main
from tests.helpers import MODEL_KEYS, tiny_set

# ---------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Case:
    argv: tuple[str, ...]
    message: str  # must appear in the one stderr line ({run}, {copy}, {tmp} filled in)
    setup: Callable[[Path, Path], None] | None = None  # (tmp, copy) -> None: writes the inputs


TINY = tuple(tiny_set(*MODEL_KEYS, "train.batch_size", "train.precision"))


def train(*extra: str) -> tuple[str, ...]:
    """A new run into {tmp}/new (never the default runs/ folder)."""
    return ("train", "--out", "{tmp}/new", *extra)


def write(name: str, data: str | bytes) -> Callable[[Path, Path], None]:
    def setup(tmp: Path, copy: Path) -> None:
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)

    return setup


def in_copy(name: str, edit: Callable[[Path], None]) -> Callable[[Path, Path], None]:
    """Apply ``edit`` to the file ``name`` inside the run copy."""
    return lambda tmp, copy: edit(copy / name)


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def replace_text(old: str, new: str) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        text = path.read_text()
        assert old in text, (old, path)
        path.write_text(text.replace(old, new))

    return edit


def nan_weight(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    tensors["final_norm.weight"][0] = float("nan")
    save_file(tensors, str(path))


def other_tokenizer(tmp: Path, copy: Path) -> None:
    from lmlab.data.tokenizer import CharTokenizer

    CharTokenizer(list("abc\n ")).save(copy / "tokenizer.json")


def hf_incomplete(tmp: Path, copy: Path) -> None:
    hf_folder(tmp, copy)
    (tmp / "hf" / "config.json").write_text('{"model_type": "llama", "hidden_size": 32}')


def hf_folder(tmp: Path, copy: Path) -> None:
    from safetensors.torch import save_file

    hf = tmp / "hf"
    hf.mkdir()
    config = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1, "vocab_size": 50}
    (hf / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(50, 32)}, str(hf / "model.safetensors"))


def corpus_folder(files: dict[str, str]) -> Callable[[Path, Path], None]:
    def setup(tmp: Path, copy: Path) -> None:
        (tmp / "corpus").mkdir()
        for name, text in files.items():
            (tmp / "corpus" / name).write_text(text)

    return setup


CKPT = "checkpoints/step-000030"
LINE = "the quick brown fox jumps over the lazy dog\n"
# An ELF header and a PNG header: binary files; the first is even valid UTF-8.
ELF = b"\x7fELF\x02\x01\x01\x00" + b"\x00" * 56 + b"text after the header " * 20
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4
EVIL_YAML = "model: !!python/object/apply:os.system ['touch {tmp}/pwned']\n"

CASES: dict[str, Case] = {
    # -------------------------------------------------------------- config files and --set
    "config-unknown-key": Case(
        train("--set", "model.attention.n_head=8"),
        "unknown config field 'model.attention.n_head' (did you mean 'n_heads'?)",
    ),
    "config-unknown-section": Case(
        train("--config", "{tmp}/c.yaml"),
        "unknown config field 'modle' (did you mean 'model'?)",
        write("c.yaml", "modle:\n  d_model: 64\n"),
    ),
    "config-unknown-kind": Case(
        train("--config", "{tmp}/c.yaml"),
        "model.norm.kind: unknown norm kind 'batchnorm'; allowed: layernorm, rmsnorm",
        write("c.yaml", "model:\n  norm:\n    kind: batchnorm\n"),
    ),
    "config-wrong-type-int": Case(
        train("--set", "model.d_model=big"), "model.d_model: expected int, got 'big'"
    ),
    "config-wrong-type-float": Case(
        train("--set", "train.lr=[1, 2]"), "train.lr: expected float, got [1, 2]"
    ),
    "config-wrong-type-bool": Case(
        train("--set", "model.tie_embeddings=maybe"),
        "model.tie_embeddings: expected bool, got 'maybe'",
    ),
    "config-section-not-a-mapping": Case(
        train("--set", "model=5"), "model: expected a section (mapping), got 5"
    ),
    "config-heads-do-not-divide-d_model": Case(
        train("--set", "model.d_model=30"),
        "model.d_model (30) must be divisible by model.attention.n_heads (4)",
    ),
    "config-kv-heads-do-not-divide-heads": Case(
        train("--set", "model.attention.n_kv_heads=3"),
        "model.attention.n_heads (4) must be a multiple of model.attention.n_kv_heads (3)",
    ),
    "config-window-larger-than-context": Case(
        train(
            "--set", "model.attention.mask=sliding_window", "--set", "model.attention.window=512"
        ),
        "model.attention.window must be in [1, model.max_seq_len=256], got 512",
    ),
    "config-window-without-sliding-mask": Case(
        train("--set", "model.attention.window=16"),
        "model.attention.window applies to masks sliding_window, local_global, streaming only, "
        "not causal",
    ),
    "config-seq-len-beyond-context": Case(
        train("--set", "train.seq_len=512"),
        "train.seq_len (512) must not exceed model.max_seq_len (256)",
    ),
    "config-zero-batch": Case(
        train("--set", "train.batch_size=0"), "train.batch_size must be > 0, got 0"
    ),
    "config-min-lr-above-lr": Case(
        train("--set", "train.min_lr=0.1"), "train.min_lr (0.1) must not exceed train.lr (0.002)"
    ),
    "config-dropout-one": Case(
        train("--set", "model.dropout=1.0"), "model.dropout must be in [0, 1), got 1.0"
    ),
    "config-moe-top-k-above-experts": Case(
        train("--set", "model.ffn.kind=moe", "--set", "model.ffn.top_k=9"),
        "model.ffn.top_k (9) must not exceed model.ffn.n_experts (8)",
    ),
    "config-precision-fp16": Case(
        train("--set", "train.precision=fp16"),
        "train.precision: 'fp16' is not allowed; allowed: bf16, fp32",
    ),
    "config-max-skipped-steps-negative": Case(
        train("--set", "train.max_skipped_steps=-1"), "train.max_skipped_steps must be >= 0, got -1"
    ),
    "config-rope-option-on-learned-positions": Case(
        train("--set", "model.position.kind=learned", "--set", "model.position.interleaved=true"),
        "model.position.interleaved applies to kind=rope only, not learned",
    ),
    "config-activation-on-swiglu": Case(
        train(*TINY, "--set", "model.ffn.kind=swiglu", "--set", "model.ffn.activation=relu"),
        "model.ffn.activation applies to kinds mlp, gated only, not swiglu (activation=relu has "
        "no effect with model.ffn.kind=swiglu, whose gate activation is silu)",
    ),
    "config-activation-on-swiglu-experts": Case(
        train(*TINY, "--set", "model.ffn.kind=moe", "--set", "model.ffn.activation=relu2"),
        "model.ffn.activation applies to experts mlp, gated only, not swiglu (activation=relu2 "
        "has no effect with model.ffn.expert=swiglu",
    ),
    "config-parallel-post-norm": Case(
        train("--set", "model.block.parallel=true", "--set", "model.block.kind=post"),
        "model.block.parallel needs model.block.kind=pre",
    ),
    "config-bpe-vocab-too-small": Case(
        train("--set", "data.tokenizer.kind=bpe", "--set", "data.tokenizer.vocab_size=100"),
        "data.tokenizer.vocab_size must be >= 258 for bpe",
    ),
    "config-val-fraction-above-one": Case(
        train("--set", "data.val_fraction=1.5"), "data.val_fraction must be in (0, 1), got 1.5"
    ),
    "config-name-escapes-runs": Case(
        ("train", "--set", "name=../escape"), "name: '../escape' must be a plain folder name"
    ),
    "config-file-missing": Case(
        train("--config", "{tmp}/nope.yaml"), "config file not found: {tmp}/nope.yaml"
    ),
    "config-file-not-yaml": Case(
        train("--config", "{tmp}/c.yaml"),
        "is not valid YAML: expected ',' or ']', but got '<stream end>' at line 2, column 1",
        write("c.yaml", "model: [unclosed\n"),
    ),
    "config-file-a-list": Case(
        train("--config", "{tmp}/c.yaml"),
        "must hold a mapping with model/data/train sections",
        write("c.yaml", "- 1\n- 2\n"),
    ),
    "config-file-binary": Case(
        train("--config", "{tmp}/c.yaml"),
        "is not valid YAML: not UTF-8 text (invalid byte at offset 0)",
        write("c.yaml", PNG),
    ),
    "config-file-python-tag": Case(  # YAML's way to run code; safe_load refuses it
        train("--config", "{tmp}/c.yaml"),
        "could not determine a constructor for the tag "
        "'tag:yaml.org,2002:python/object/apply:os.system'",
        lambda tmp, copy: (tmp / "c.yaml").write_text(EVIL_YAML.format(tmp=tmp)),
    ),
    "config-set-without-equals": Case(
        train("--set", "model.d_model"), "--set expects dotted.key=value, got 'model.d_model'"
    ),
    "config-set-into-a-value": Case(
        train("--set", "model.d_model.x=1"), "model.d_model: expected int, got {{'x': 1}}"
    ),
    "config-too-big-for-memory": Case(  # about 10 TB: estimated, refused, never allocated
        train(
            "--set",
            "model.d_model=16384",
            "--set",
            "model.n_layers=200",
            "--set",
            "model.attention.n_heads=128",
        ),  # fmt: skip
        "more than the",
    ),
    # -------------------------------------------------------------- corpora
    "corpus-missing": Case(
        train("--data", "{tmp}/missing.txt", *TINY), "corpus file not found: {tmp}/missing.txt"
    ),
    "corpus-empty": Case(
        train("--data", "{tmp}/empty.txt", *TINY),
        "corpus file {tmp}/empty.txt is empty",
        write("empty.txt", b""),
    ),
    "corpus-whitespace-only": Case(
        train("--data", "{tmp}/blank.txt", *TINY),
        "corpus file {tmp}/blank.txt is empty",
        write("blank.txt", " \n\t\n" * 100),
    ),
    "corpus-not-utf8": Case(
        train("--data", "{tmp}/latin.txt", *TINY),
        "{tmp}/latin.txt is not UTF-8 text (invalid byte 0xef at byte offset 2)",
        write("latin.txt", "na\xefve text".encode("latin-1")),
    ),
    "corpus-binary-valid-utf8": Case(
        train("--data", "{tmp}/program", *TINY),
        "{tmp}/program looks like a binary file, not text (NUL byte at byte offset 7)",
        write("program", ELF),
    ),
    "corpus-binary-image": Case(
        train("--data", "{tmp}/image.png", *TINY),
        "{tmp}/image.png looks like a binary file, not text (NUL byte at byte offset 8)",
        write("image.png", PNG),
    ),
    "corpus-utf16": Case(
        train("--data", "{tmp}/utf16.txt", *TINY),
        "iconv -f utf-16 -t utf-8",
        write("utf16.txt", (LINE * 50).encode("utf-16")),
    ),
    "corpus-shorter-than-one-window": Case(
        train("--data", "{tmp}/short.txt", *TINY),
        "the val split has 21 tokens, fewer than one training window of seq_len + 1 = 33",
        write("short.txt", "To be, or not to be.\n" * 10),
    ),
    "corpus-train-split-shorter-than-one-window": Case(
        train("--data", "{tmp}/corpus", *TINY),
        "the train split has 3 tokens, fewer than one training window",
        corpus_folder({"train.txt": "ab\n", "valid.txt": LINE * 10}),
    ),
    "corpus-too-short-to-split": Case(
        train("--data", "{tmp}/one.txt", *TINY),
        "text of 1 characters is too short to split into train and val",
        write("one.txt", "a"),
    ),
    "corpus-folder-without-train": Case(
        train("--data", "{tmp}/corpus", *TINY),
        "corpus folder {tmp}/corpus has no train.txt",
        corpus_folder({"valid.txt": LINE}),
    ),
    "corpus-unknown-name": Case(
        train("--data", "wikitext", *TINY),
        "corpus 'wikitext' is neither a bundled corpus (tinyshakespeare) nor an existing file",
    ),
    "eval-data-is-a-folder": Case(
        ("eval", "{run}", "--data", "{tmp}"), "{tmp} is a folder, not a text file"
    ),
    "eval-data-not-utf8": Case(
        ("eval", "{run}", "--data", "{tmp}/latin.txt"),
        "is not UTF-8 text",
        write("latin.txt", "caf\xe9".encode("latin-1")),
    ),
    "eval-data-outside-vocabulary": Case(
        ("eval", "{run}", "--data", "{tmp}/greek.txt"),
        "1 character(s) outside this character-level vocabulary (65 characters): 'Ω'",
        write("greek.txt", "Ωmega " * 20),
    ),
    "eval-data-one-token": Case(
        ("eval", "{run}", "--data", "{tmp}/a.txt"),
        "need at least 2 tokens to score, got 1",
        write("a.txt", "a"),
    ),
    # -------------------------------------------------------------- prompts and sampling
    "prompt-empty": Case(("generate", "{run}", "--prompt", ""), "the prompt is empty"),
    "prompt-outside-vocabulary": Case(
        ("generate", "{run}", "--prompt", "Ωmega"),
        "text has 1 character(s) outside this character-level vocabulary (65 characters): 'Ω'",
    ),
    "generate-temperature-nan": Case(
        ("generate", "{run}", "--temperature", "nan"), "--temperature must be a finite number"
    ),
    "generate-temperature-negative": Case(
        ("generate", "{run}", "--temperature", "-1"), "--temperature must be >= 0, got -1.0"
    ),
    "generate-top-p-above-one": Case(
        ("generate", "{run}", "--top-p", "1.5"), "--top-p must be in (0, 1], got 1.5"
    ),
    "generate-top-k-negative": Case(
        ("generate", "{run}", "--top-k", "-3"), "--top-k must be >= 0, got -3"
    ),
    "generate-repetition-penalty-zero": Case(
        ("generate", "{run}", "--repetition-penalty", "0"), "--repetition-penalty must be > 0"
    ),
    "generate-max-new-tokens-negative": Case(
        ("generate", "{run}", "--max-new-tokens", "-1"), "--max-new-tokens must be >= 0, got -1"
    ),
    # -------------------------------------------------------------- run folders
    "run-missing": Case(("eval", "{tmp}/nowhere"), "not found: {tmp}/nowhere"),
    "run-without-checkpoint": Case(
        ("generate", "{copy}"),
        "{copy} has no checkpoint yet",
        lambda tmp, copy: shutil.rmtree(copy / "checkpoints"),
    ),
    "run-truncated-safetensors": Case(
        ("generate", "{copy}"),
        f"checkpoint file {{copy}}/{CKPT}/model.safetensors is corrupt",
        in_copy(f"{CKPT}/model.safetensors", truncate),
    ),
    "run-garbage-safetensors": Case(
        ("eval", "{copy}"),
        f"checkpoint file {{copy}}/{CKPT}/model.safetensors is corrupt",
        in_copy(f"{CKPT}/model.safetensors", lambda p: p.write_bytes(b"\x00garbage" * 10)),
    ),
    "run-non-finite-weights": Case(
        ("eval", "{copy}"),
        "is corrupt: non-finite values in final_norm.weight",
        in_copy(f"{CKPT}/model.safetensors", nan_weight),
    ),
    "run-incomplete-hugging-face-folder-to-generate": Case(
        ("generate", "{tmp}/hf"), "{tmp}/hf/config.json lacks ", hf_folder
    ),
    "run-config-does-not-match-weights": Case(
        ("generate", "{copy}"),
        "has no tensor layers.2.attn_norm.weight, which the model needs: was model.n_layers",
        in_copy("config.yaml", replace_text("n_layers: 2", "n_layers: 3")),
    ),
    "run-config-yaml-corrupt": Case(
        ("eval", "{copy}"),
        "config file {copy}/config.yaml is not valid YAML",
        in_copy("config.yaml", lambda p: p.write_text("model: [\n")),
    ),
    "run-config-yaml-unknown-field": Case(
        ("eval", "{copy}"),
        "unknown config field 'model.n_layer' (did you mean 'n_layers'?)",
        in_copy("config.yaml", replace_text("n_layers: 2", "n_layer: 2")),
    ),
    "run-latest-names-a-missing-checkpoint": Case(
        ("eval", "{copy}"),
        "{copy}/checkpoints/latest names step-000099, which does not exist",
        in_copy("checkpoints/latest", lambda p: p.write_text("step-000099\n")),
    ),
    "run-latest-damaged": Case(
        ("generate", "{copy}"),
        "{copy}/checkpoints/latest is empty or damaged",
        in_copy("checkpoints/latest", lambda p: p.write_text("../../etc\n")),
    ),
    "run-latest-binary": Case(
        ("eval", "{copy}"),
        "{copy}/checkpoints/latest is empty or damaged",
        in_copy("checkpoints/latest", lambda p: p.write_bytes(PNG)),
    ),
    "run-latest-names-the-parent-folder": Case(
        ("eval", "{copy}"),
        "{copy}/checkpoints/latest is empty or damaged",
        in_copy("checkpoints/latest", lambda p: p.write_text("..\n")),
    ),
    "run-tokenizer-missing": Case(
        ("generate", "{copy}"),
        "tokenizer file not found: {copy}/tokenizer.json",
        in_copy("tokenizer.json", Path.unlink),
    ),
    "run-tokenizer-corrupt": Case(
        ("eval", "{copy}"),
        "tokenizer file {copy}/tokenizer.json is corrupt or not a tokenizer.json",
        in_copy("tokenizer.json", lambda p: p.write_text('{"model": ')),
    ),
    "run-tokenizer-from-another-run": Case(
        ("generate", "{copy}"),
        "{copy}/tokenizer.json has 5 tokens but config.yaml says model.vocab_size is 65",
        other_tokenizer,
    ),
    "run-trainer-state-corrupt": Case(
        ("eval", "{copy}"),
        f"trainer state {{copy}}/{CKPT}/trainer_state.json is not valid JSON",
        in_copy(f"{CKPT}/trainer_state.json", truncate),
    ),
    "run-optimizer-truncated": Case(
        ("train", "--resume", "{copy}", "--max-steps", "31"),
        f"checkpoint file {{copy}}/{CKPT}/optimizer.safetensors is corrupt",
        in_copy(f"{CKPT}/optimizer.safetensors", truncate),
    ),
    "run-optimizer-missing": Case(
        ("train", "--resume", "{copy}", "--max-steps", "31"),
        "is incomplete: optimizer.safetensors is missing",
        in_copy(f"{CKPT}/optimizer.safetensors", Path.unlink),
    ),
    "resume-not-a-run": Case(("train", "--resume", "{tmp}"), "is not an lmlab run folder"),
    "resume-changed-setting": Case(
        ("train", "--resume", "{copy}", "--set", "model.n_layers=4"),
        "these settings differ from it: model.n_layers",
    ),
    "resume-other-corpus": Case(
        ("train", "--resume", "{copy}", "--data", "{tmp}/x.txt"), "differ from it: data.corpus"
    ),
    "resume-with-out": Case(
        ("train", "--resume", "{copy}", "--out", "{tmp}/x"), "--out cannot be combined"
    ),
    "resume-to-an-earlier-step": Case(
        ("train", "--resume", "{copy}", "--max-steps", "10"),
        "is already at step 30; --max-steps 10 would not extend it",
    ),
    "train-into-an-existing-run": Case(
        ("train", "--out", "{copy}", *TINY), "already holds a run; continue it with --resume"
    ),
    "train-out-is-a-file": Case(
        ("train", "--out", "{copy}/config.yaml"), "is a file; give a folder for the run"
    ),
    "eval-split-missing": Case(
        ("eval", "{run}", "--split", "test"), "has no 'test' split; it has: train, val"
    ),
    # -------------------------------------------------------------- command-line arguments
    "cli-unknown-command": Case(("frobnicate",), "invalid choice: 'frobnicate'"),
    "cli-unknown-flag": Case(("eval", "{run}", "--bogus"), "unrecognized arguments: --bogus"),
    "cli-not-an-int": Case(
        ("train", "--max-steps", "ten"), "argument --max-steps: invalid int value: 'ten'"
    ),
    "cli-unknown-device": Case(
        ("eval", "{run}", "--device", "tpu"), "argument --device: invalid choice: 'tpu'"
    ),
    "cli-missing-run-dir": Case(("eval",), "the following arguments are required: MODEL"),
    "cli-time-budget-zero": Case(
        train("--time-budget", "0"), "--time-budget must be a positive number of seconds"
    ),
    "cli-time-budget-nan": Case(
        train("--time-budget", "nan"), "--time-budget must be a positive number of seconds"
    ),
    "cli-max-steps-zero": Case(
        train("--max-steps", "0", *TINY), "train.max_steps must be > 0, got 0"
    ),
    "cli-eval-batch-size-zero": Case(
        ("eval", "{run}", "--batch-size", "0"), "--batch-size must be >= 1"
    ),
    "cli-eval-max-tokens-negative": Case(
        ("eval", "{run}", "--max-tokens", "-5"), "--max-tokens must be >= 2"
    ),
    "cli-eval-stride-zero": Case(
        ("eval", "{run}", "--stride", "0"), "--stride must be between 1 and the context length 32"
    ),
    "cli-eval-stride-beyond-context": Case(
        ("eval", "{run}", "--stride", "33"), "--stride must be between 1 and the context length"
    ),
    "cli-list-unknown-family": Case(("list", "positions"), "unknown family 'positions'"),
    "cli-verify-missing-config": Case(
        ("verify", "--config", "{tmp}/nope.yaml"), "config file not found"
    ),
}

# Only where torch sees no GPU (everywhere the suite normally runs).
if not torch.cuda.is_available():
    CASES["cli-device-cuda-absent"] = Case(
        ("generate", "{run}", "--device", "cuda"), "torch sees no CUDA GPU"
    )


# ---------------------------------------------------------------------------- the runner


def folder_hashes(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under ``folder`` (relative path -> hex digest)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def checkpoint_folders(root: Path) -> set[Path]:
    return {p for p in root.rglob("checkpoints") if p.is_dir()}


def test_the_catalogue_has_at_least_40_cases():
    assert len(CASES) >= 40, len(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name: str, tiny_run: Path, tmp_path: Path, capsys, monkeypatch):
    case = CASES[name]
    monkeypatch.chdir(tmp_path)  # a case that still used the default runs/ would land here
    tmp, copy = tmp_path / "tmp", tmp_path / "copy"
    tmp.mkdir()
    uses_copy = any("{copy}" in a for a in case.argv) or case.setup is not None
    if uses_copy:
        shutil.copytree(tiny_run, copy)
    if case.setup is not None:
        case.setup(tmp, copy)
    fill = {"run": str(tiny_run), "copy": str(copy), "tmp": str(tmp)}
    argv = [a.format(**fill) for a in case.argv]
    runs = {tiny_run: folder_hashes(tiny_run)}
    if uses_copy:
        runs[copy] = folder_hashes(copy)
    checkpoints_before = checkpoint_folders(tmp_path)
    capsys.readouterr()

    try:
        code = main(argv)
    except SystemExit as e:  # argparse's errors
        code = e.code
    out, err = capsys.readouterr()

    assert code != 0 and code == 2, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one message ...
    assert lines[0].startswith("error: "), err
    assert case.message.format(**fill) in lines[0], err  # ... that names the fault
    assert "Traceback" not in err and "error: unexpected" not in err  # not a bug's one-liner
    assert out == ""
    for folder, before in runs.items():  # no existing run folder was touched
        assert folder_hashes(folder) == before, folder
    assert checkpoint_folders(tmp_path) == checkpoints_before  # and no new run came to life
    assert not (tmp / "pwned").exists()


@pytest.mark.parametrize(
    "setup, message",
    [
        (hf_incomplete, "hf/config.json lacks "),
        (lambda tmp, copy: (tmp / "hf").mkdir(), "is neither an lmlab run folder (config.yaml)"),
        (lambda tmp, copy: None, "not found: "),
    ],
    ids=["hf-config-incomplete", "empty-folder", "missing"],
)
def test_lmlab_load_refuses_bad_folders(tmp_path: Path, setup, message):
    """The library entry point (no CLI command reads Hugging Face folders) fails the same way."""
    import lmlab
    from lmlab.errors import LmlabError

    setup(tmp_path, tmp_path / "unused")
    with pytest.raises(LmlabError, match=re.escape(message)):
        lmlab.load(tmp_path / "hf")


def test_no_checkpoint_hint_trains_the_folders_own_config(tmp_path: Path, capsys):
    """The command the "no checkpoint yet" error suggests trains the config in the folder
    (here d_model 24, 1 layer), not lmlab's default model."""
    import shlex

    from lmlab.config import save_config
    from lmlab.run import load_run
    from lmlab.runlock import LOCK_FILE
    from tests.helpers import tiny_config

    cfg = tiny_config(model={"d_model": 24, "n_layers": 1}, train={"max_steps": 2})
    # A folder lmlab made (its marker) is trained in place; a user's folder holding a config is
    # never written into, so the hint trains into a new folder beside it.
    for made_by_lmlab, trained_into in ((True, "planned"), (False, "planned-run")):
        run = tmp_path / str(made_by_lmlab) / "planned"
        run.mkdir(parents=True)
        if made_by_lmlab:
            (run / LOCK_FILE).touch()
        save_config(cfg, run / "config.yaml")
        code = main(["generate", str(run), "--prompt", "To"])
        err = capsys.readouterr().err
        assert code == 2 and "has no checkpoint yet" in err
        command = shlex.split(err.split(": lmlab ", 1)[1].strip())
        assert command[0] == "train" and str(run / "config.yaml") in command
        assert main([*command, "--no-progress"]) == 0, capsys.readouterr().err
        trained = load_run(run.parent / trained_into, "cpu")
        got = (trained.config.model.d_model, trained.config.model.n_layers, trained.step)
        assert got == (24, 1, 2)
