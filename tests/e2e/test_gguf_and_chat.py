"""GGUF loading, chat and eval on tiny GGUF files (tests/helpers/gguf_files.py), and their bad
inputs: one clear ``error: ...`` line each, never a traceback."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import lmlab.interop.load as lmlab_load  # noqa: E402
from lmlab.errors import LmlabError  # noqa: E402
from lmlab.generation.chat import (  # noqa: E402
    ChatSession,
    chat_prompt_ids,
    chat_repl,
    render_chat,
)
from lmlab.generation.generate import SamplingParams  # noqa: E402
from tests.helpers import CHATML, run_cli, tiny_llama_hf, write_llama_gguf  # noqa: E402


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return tiny_llama_hf(n_layers=2)


@pytest.fixture(scope="module")
def tiny_gguf(hf_model, tmp_path_factory) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", hf_model)


# ------------------------------------------------------------------ working paths


def test_tokenizer_from_gguf_round_trips_bytes_and_matches_specials(tiny_gguf):
    _, tok = lmlab_load.load(tiny_gguf)
    for text in ["plain English.", "中文和日本語", "🎉👍🏽 mixed\n\ttext"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert len(ids) == len(text.encode("utf-8"))  # no merges: one token per byte
    assert tok.encode("<|im_start|>a<|im_end|>") == [256, ord("a"), 257]
    assert (tok.bos_id, tok.eos_id, tok.stop_ids) == (256, 257, {257})
    assert tok.chat_template == CHATML


def test_render_chat_is_chatml_with_generation_prompt():
    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat(CHATML, msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert not render_chat(CHATML, msgs, add_generation_prompt=False).endswith("assistant\n")


def test_render_chat_is_sandboxed():
    with pytest.raises(LmlabError, match="chat template failed"):
        render_chat("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", [])
    with pytest.raises(LmlabError, match="refused the conversation: no system"):
        render_chat("{{ raise_exception('no system') }}", [])


def test_chat_session_drops_oldest_turns_to_fit_the_budget(tiny_gguf):
    model, tok = lmlab_load.load(tiny_gguf)
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    session = ChatSession(model, tok, params, max_context=128, system="sys")
    for i in range(6):
        "".join(session.reply(f"message number {i}"))
    prompt = tok.decode(session.prompt_for("last"))
    assert len(session.prompt_for("last")) <= 128 - 4
    assert session.dropped > 0 and "message number 0" not in prompt
    assert prompt.startswith("<|im_start|>system\nsys")  # the system message is always kept
    assert "message number 5" in prompt  # the newest turn is kept


def test_chat_repl_reads_stdin_keeps_history_resets_and_exits(tiny_gguf):
    model, tok = lmlab_load.load(tiny_gguf)
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    out, err = io.StringIO(), io.StringIO()
    stdin = io.StringIO("hello\n/reset\n/bogus\nagain\n/exit\nnever read\n")
    assert chat_repl(model, tok, params, 64, stdin=stdin, stdout=out, stderr=err) == 0

    def alone(message: str) -> str:  # the reply of a fresh session
        return "".join(ChatSession(model, tok, params, 64).reply(message))

    assert out.getvalue() == alone("hello") + "\n" + alone("again") + "\n"  # reset: no history
    kept = ChatSession(model, tok, params, 64)
    "".join(kept.reply("hello"))
    assert "hello" in tok.decode(kept.prompt_for("again"))  # without /reset, history is kept
    assert "(history cleared)" in err.getvalue() and "unknown command /bogus" in err.getvalue()
    # end of input (Ctrl-D) ends cleanly too
    assert chat_repl(model, tok, params, 64, stdin=io.StringIO("hi\n"), stdout=out, stderr=err) == 0


def test_cli_chat_and_generate_chat_on_gguf(tiny_gguf, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    code, out, err = run_cli(
        capsys, "chat", str(tiny_gguf), "--temperature", "0", "--max-new-tokens", "3"
    )
    assert code == 0 and "/reset" in err
    code, out2, _ = run_cli(
        capsys,
        "generate",
        str(tiny_gguf),
        "--chat",
        "hello",
        "--temperature",
        "0",
        "--max-new-tokens",
        "3",
    )
    assert code == 0 and out2 == out  # the same greedy reply to the same first message


def test_cli_eval_gguf_prints_perplexity(tiny_gguf, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("hello there, general kenobi. " * 5)
    code, out, _ = run_cli(
        capsys, "eval", str(tiny_gguf), "--data", str(text), "--max-tokens", "100"
    )
    assert code == 0
    ppl = float(out.split("perplexity: ")[1].split()[0])
    assert 100 < ppl < 1000  # random weights over a 258-token vocabulary: near 258
    assert "tokens: 99" in out


# ------------------------------------------------------------------ bad inputs


def _bad(tmp: Path, hf_model, **kw) -> Path:
    return write_llama_gguf(tmp / "bad.gguf", hf_model, **kw)


CASES = {
    "unsupported-quant": (
        lambda tmp, hf: _bad(tmp, hf, quant=gguf.GGMLQuantizationType.Q8_1),
        "uses the quantization type Q8_1, which the gguf library cannot dequantize",
    ),
    "unknown-architecture": (
        lambda tmp, hf: _bad(tmp, hf, meta={"general.architecture": "mamba"}),
        "GGUF architecture 'mamba' is not supported; supported: llama",
    ),
    "missing-tensor": (
        lambda tmp, hf: _bad(tmp, hf, drop=("blk.1.ffn_up.weight",)),
        "lacks the tensor for layers.1.ffn.up_proj.weight",
    ),
    "shape-mismatch": (
        lambda tmp, hf: _bad(tmp, hf, meta={"llama.feed_forward_length": 32}),
        "tensor layers.0.ffn.gate_proj.weight has shape (64, 32) but the model expects (32, 32)",
    ),
    "missing-metadata": (
        lambda tmp, hf: _bad(tmp, hf, meta={"llama.block_count": None}),
        "lacks the metadata key 'llama.block_count'",
    ),
    "tokenizer-kind": (
        lambda tmp, hf: _bad(tmp, hf, meta={"tokenizer.ggml.model": "llama"}),
        "tokenizer.ggml.model 'llama' is not supported; supported: gpt2",
    ),
    "pre-tokenizer": (
        lambda tmp, hf: _bad(tmp, hf, meta={"tokenizer.ggml.pre": "qwen2"}),
        "pre-tokenizer 'qwen2' (tokenizer.ggml.pre) is not supported",
    ),
    "truncated-gguf": (
        lambda tmp, hf: _truncate(_bad(tmp, hf)),
        "is not a readable GGUF file",
    ),
    "neither-folder-safetensors-nor-gguf": (
        lambda tmp, hf: _write(tmp / "notes.txt", b"hello"),
        "neither a model folder, a safetensors file nor a GGUF file",
    ),
    "no-chat-template": (
        lambda tmp, hf: _bad(tmp, hf, meta={"tokenizer.chat_template": None}),
        "has no chat template",
    ),
}


def _truncate(p: Path) -> Path:
    p.write_bytes(p.read_bytes()[:2000])
    return p


def _write(p: Path, data: bytes) -> Path:
    p.write_bytes(data)
    return p


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_gguf_inputs_give_one_error_line(name, hf_model, tmp_path, capsys):
    setup, message = CASES[name]
    path = setup(tmp_path, hf_model)
    argv = ["generate", str(path), "--max-new-tokens", "2"]
    if name == "no-chat-template":
        argv += ["--chat", "hi"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert message in lines[0], err
    assert out == ""


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--chat", "hi", "--prompt", "x"], "give either --chat or --prompt, not both"),
        (["--system", "s"], "--system needs --chat"),
    ],
)
def test_bad_chat_flags(tiny_gguf, capsys, argv, message):
    code, _, err = run_cli(capsys, "generate", str(tiny_gguf), *argv)
    assert code == 2 and message in err


def test_chat_message_too_long_for_budget(tiny_gguf, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("x" * 200 + "\n"))
    code, _, err = run_cli(capsys, "chat", str(tiny_gguf), "--max-context", "32")
    assert code == 2 and "more than the" in err and "--max-context" in err


def test_eval_split_needs_a_run_folder(tiny_gguf, capsys):
    code, _, err = run_cli(capsys, "eval", str(tiny_gguf))
    assert code == 2 and "is not an lmlab run folder, so it has no corpus split: give --data" in err


# ------------------------------------------------------------------ the template carried along


def _greedy_chat(path: Path, capsys) -> str:
    code, out, err = run_cli(
        capsys,
        "generate",
        str(path),
        "--chat",
        "hello",
        "--temperature",
        "0",
        "--max-new-tokens",
        "4",
    )
    assert code == 0, err
    return out


def test_chat_template_survives_import_init_from_and_export(tiny_gguf, tmp_path, capsys):
    """import keeps the template and the end-of-turn token (<|im_end|>, not <|endoftext|>);
    a --init-from run keeps them; export writes them where transformers reads them."""
    reply = _greedy_chat(tiny_gguf, capsys)
    run = tmp_path / "imported"
    assert run_cli(capsys, "import", str(tiny_gguf), "--out", str(run))[0] == 0
    _, tok = lmlab_load.load(run)
    assert (tok.chat_template, tok.eos_id, tok.bos_id, tok.stop_ids) == (CHATML, 257, 256, {257})
    assert _greedy_chat(run, capsys) == reply  # the same prompt ids, the same stop token
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello there, how are you?\n" * 40, encoding="utf-8")
    tuned = tmp_path / "tuned"
    argv = ["train", "--init-from", str(run), "--data", str(corpus), "--out", str(tuned)]
    argv += ["--max-steps", "1", "--no-progress", "--set", "train.batch_size=2"]
    argv += ["--set", "train.seq_len=32", "--set", "train.device=cpu"]
    code, _, err = run_cli(capsys, *argv)
    assert code == 0, err
    _, tuned_tok = lmlab_load.load(tuned)
    assert (tuned_tok.chat_template, tuned_tok.eos_id) == (CHATML, 257)
    _greedy_chat(tuned, capsys)  # a template: no "has no chat template" refusal
    folder = tmp_path / "hf"
    code, _, err = run_cli(capsys, "export", str(run), "--out", str(folder))
    assert code == 0, err
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": "user", "content": "hello"}]
    text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == render_chat(CHATML, messages)
    ids = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert list(ids) == chat_prompt_ids(tok, messages)
    assert (hf_tok.eos_token, hf_tok.bos_token) == ("<|im_end|>", "<|im_start|>")
