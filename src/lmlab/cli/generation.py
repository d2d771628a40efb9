"""``lmlab generate`` and ``lmlab chat``: sample from a model.

Their sampling flags are declared once, in :data:`lmlab.cli.common.SAMPLING_FLAGS`.
"""

from __future__ import annotations

import argparse
import sys
import typing

from lmlab.cli.common import Command, add_sampling_flags, sampling_params
from lmlab.errors import LmlabError
from lmlab.textsafe import for_terminal


def _generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="MODEL", help="run folder, Hugging Face folder or .gguf file")
    p.add_argument(
        "--chat",
        metavar="MESSAGE",
        help="ask a chat model: apply its chat template to MESSAGE, print the reply (stops at "
        "the template's end-of-turn token)",
    )
    p.add_argument("--system", help="with --chat: a system message")
    p.add_argument(
        "--prompt",
        action="append",
        help="text to continue (default: a newline); repeat it to continue several prompts as "
        "one batch, printed as blocks separated by a line ---",
    )
    p.add_argument(
        "--source",
        action="append",
        help="encoder-decoder (seq2seq) models: the source to transform, e.g. --source "
        '"abcdefgh" --temperature 0 (repeatable: one batch); RUN may be any model lmlab.load '
        "accepts (a T5/BART folder too)",
    )
    add_sampling_flags(p)  # generate's defaults are SAMPLING_FLAGS'
    p.add_argument("--no-prompt", action="store_true", help="print only the continuation")


def _chat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="MODEL", help="run folder, Hugging Face folder or .gguf file")
    p.add_argument("--system", help="a system message kept at the start of the conversation")
    p.add_argument(
        "--max-context",
        type=int,
        metavar="TOKENS",
        help="token budget of the conversation + reply (default: the model's context)",
    )
    add_sampling_flags(  # where chat differs from generate
        p,
        omit=("stop",),
        max_new_tokens={"default": 512, "help": "at most this many tokens per reply"},
        temperature={"default": 0.7},
        repetition_penalty={"help": "> 1 discourages repeats (1 = off)"},
        seed={"help": "random seed for reproducible replies"},
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from lmlab.generation.generate import generate_text, generate_texts

    params = sampling_params(args)
    if args.source is not None:
        return _generate_seq2seq(args, params)
    if args.chat is not None and args.prompt:
        raise LmlabError("give either --chat or --prompt, not both")
    if args.system is not None and args.chat is None:
        raise LmlabError("--system needs --chat")
    model, tokenizer = load_with_tokenizer(args.run, args.device, args.quantize)
    max_seq_len = model.cfg.max_seq_len
    if model.cfg.kind != "decoder":
        if model.cfg.kind == "encoder" and model.cfg.mlm_head:
            hint = f"lmlab fill-mask {args.run} --text '... [MASK] ...'"
        elif model.cfg.kind == "encoder":  # no masked-LM head: a sentence-embedding model
            hint = f"lmlab embed {args.run} --text '...'"
        else:
            hint = f"lmlab generate {args.run} --source '...'"
        raise LmlabError(
            f"generate needs a decoder model (--prompt, --chat); {args.run} is model.kind="
            f"{model.cfg.kind}: use {hint}"
        )
    out = for_terminal(sys.stdout)  # a model's control characters are escaped on a terminal
    if args.chat is not None:
        from lmlab.generation.chat import ChatSession

        session = ChatSession(model, tokenizer, params, max_seq_len, args.system)
        for piece in session.reply(args.chat):
            out.write(piece)
            out.flush()
        out.write("\n")
        return 0
    prompts = args.prompt or ["\n"]
    if len(prompts) > 1:  # one batch; each completion printed as its own block
        texts = generate_texts(model, tokenizer, prompts, params, max_seq_len)
        blocks = [t if args.no_prompt else p + t for p, t in zip(prompts, texts, strict=True)]
        out.write("\n---\n".join(blocks) + "\n")
        return 0
    pieces = generate_text(model, tokenizer, prompts[0], params, max_seq_len)
    if not args.no_prompt:  # the prompt is written only once it has been accepted
        out.write(prompts[0])
    for piece in pieces:
        out.write(piece)
        out.flush()
    out.write("\n")
    return 0


def _generate_seq2seq(args: argparse.Namespace, params: typing.Any) -> int:
    from lmlab.generation.seq2seq import generate_from_sources

    if args.prompt or args.chat is not None:
        raise LmlabError(
            "give --source (encoder-decoder models) or --prompt / --chat (decoders), not both"
        )
    model, tokenizer = load_with_tokenizer(args.run, args.device, args.quantize)
    texts = generate_from_sources(model, tokenizer, args.source, params)
    for_terminal(sys.stdout).write("\n---\n".join(texts) + "\n")
    return 0


def load_with_tokenizer(
    path: str, device: str | None, quantize: str | None = None
) -> tuple[typing.Any, typing.Any]:
    """``lmlab.load(path, quantize=...)``; LmlabError when the model comes without a tokenizer."""
    from lmlab.interop.load import load, no_tokenizer

    if quantize is not None:  # a bad spec fails before the load
        from lmlab.nn.quant import parse_spec

        parse_spec(quantize)
    model, tokenizer = load(path, device or "auto", quantize)
    if tokenizer is None:
        raise no_tokenizer(path, "generated")
    if quantize is not None:  # build (or load) the kernels now: a fallback warning then prints
        from lmlab.nn import quant_kernel  # before the streamed text, not inside its first line

        quant_kernel.available()
    return model, tokenizer


def cmd_chat(args: argparse.Namespace) -> int:
    from lmlab.generation.chat import chat_repl

    params = sampling_params(args)
    if args.max_context is not None and args.max_context < 2:
        raise LmlabError(f"--max-context must be >= 2 tokens, got {args.max_context}")
    model, tokenizer = load_with_tokenizer(args.run, args.device, args.quantize)
    if model.cfg.kind != "decoder":  # else: a misleading "no chat template, use --prompt"
        raise LmlabError(
            f"lmlab chat needs a decoder model; {args.run} is model.kind={model.cfg.kind}"
        )
    limit = model.cfg.max_seq_len
    return chat_repl(model, tokenizer, params, min(args.max_context or limit, limit), args.system)


GENERATE = Command(
    help="sample text from a model (streams to stdout)",
    description="Continue a prompt with a model (run folder, Hugging Face folder or .gguf "
    "file), using the KV cache. Stops at max-new-tokens, the tokenizer's end-of-sequence "
    "token or a stop string. --chat wraps the text in the model's own chat template and "
    "prints only the answer. After the prompt, each token of a plain pre-norm decoder (Llama, "
    "the default Mini-GPT) runs as one C++ call through every layer, the forward's logits to "
    "float32 rounding (LMLAB_NO_CPP_KERNELS=1: a Python step, bit for bit on one thread; "
    "docs/generation.md, 'Decoding speed'). Outside that step, float32 linears of 2^22 "
    "multiply-adds or more (the prompt's layers, the LM head) run through oneDNN's matmul "
    "rather than MKL's (1.15x transformers' prefill on an AMD Zen 4; LMLAB_NO_ONEDNN=1, any "
    "value but empty/0/false/no/off, read at import: F.linear).",
    arguments=_generate_arguments,
    run=cmd_generate,
    common=("device", "debug", "plugin", "quantize"),
)


CHAT = Command(
    help="talk to a chat model in the terminal (streams replies)",
    description="A read-reply loop with a model's own chat template: each line is a "
    "message; the history is kept, oldest turns dropped to fit the context. /reset clears "
    "the history, /exit or Ctrl-D quits. Example: lmlab chat model.gguf --temperature 0.7",
    arguments=_chat_arguments,
    run=cmd_chat,
    common=("device", "debug", "quantize"),
)
