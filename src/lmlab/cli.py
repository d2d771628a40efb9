"""The ``lmlab`` command line: each subcommand calls exactly one library function.

Errors a user can cause are printed as one ``error: ...`` line on stderr with exit code 2; any
other exception prints one line too (exit 1) unless ``--debug`` asks for the traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing
from collections.abc import Sequence
from pathlib import Path

from lmlab.errors import Interrupted, LmlabError

DESCRIPTION = """\
lmlab: build, train, probe and compare Transformer language models.

  lmlab train                         train the default Mini-GPT on tinyshakespeare
  lmlab generate runs/minigpt --prompt "ROMEO:"
  lmlab eval runs/minigpt             loss, perplexity and bits per byte on the val split
  lmlab generate model.gguf --chat "What is the capital of France?" --temperature 0
  lmlab chat model.gguf               talk to a chat model (its own template, history kept)
  lmlab train --config configs/llama.yaml --nproc 2     a preset, on 2 processes (DDP)
  lmlab verify --config my.yaml       prove a model config correct (and equal to Hugging Face's)
  lmlab inspect configs/mixtral.yaml  parameters per component, without building the model
  lmlab list                          every component variant a config can name
"""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``error: ...``, exit 2), like every other lmlab error."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        default=None,
        choices=["auto", "cpu", "cuda", "mps"],
        help="where to run (default: the config's train.device, 'auto': cuda, mps, then cpu)",
    )
    p.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="lmlab", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    t = sub.add_parser(
        "train",
        help="train a model and write a run folder",
        description="Train a language model. Writes RUN/config.yaml, tokenizer.json, "
        "checkpoints/step-NNNNNN/ (+ latest), metrics.jsonl, tb/ (TensorBoard) and loss.png.",
    )
    t.add_argument(
        "--config",
        help="YAML config (sections model, data, train); default: the "
        "built-in Mini-GPT (same as configs/minigpt.yaml)",
    )
    t.add_argument(
        "--data",
        help="train on this UTF-8 text file (last data.val_fraction is "
        "validation) or folder with train.txt/valid.txt/test.txt; same as "
        "--set data.corpus=PATH",
    )
    t.add_argument("--out", help="run folder (default: runs/<config name>)")
    t.add_argument(
        "--max-steps", type=int, help="optimizer steps to train to (extends a resumed run)"
    )
    t.add_argument(
        "--time-budget",
        type=float,
        metavar="SECONDS",
        help="stop (with a checkpoint) after this many seconds of training",
    )
    t.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set model.position.kind=rope "
        "--set model.attention.n_heads=8 (repeatable; values are YAML)",
    )
    t.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a run from its latest "
        "checkpoint; only --max-steps, --time-budget and --device may change",
    )
    t.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="train in N processes on this machine through torchrun (DDP; FSDP2 with --set "
        "train.parallel=fsdp), each with cores/N threads; the global batch is N x batch_size x "
        "grad_accum_steps",
    )
    t.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: when stderr is a terminal)",
    )
    _add_common(t)

    e = sub.add_parser(
        "eval",
        help="loss, perplexity and bits per byte of a model on a text",
        description="Score a model: a run folder (latest checkpoint), a Hugging Face folder or a "
        ".gguf file. Text longer than the context is scored in non-overlapping windows unless "
        "--stride is given. Prints name: value lines (loss in nats/token, perplexity = "
        "exp(loss), bits_per_byte). Example: lmlab eval model.gguf --data input.txt "
        "--max-tokens 4096",
    )
    e.add_argument("run", metavar="MODEL", help="run folder, Hugging Face folder or .gguf file")
    e.add_argument(
        "--split",
        default="val",
        choices=["train", "val", "test"],
        help="corpus split to score (default: val; test only where the corpus has one)",
    )
    e.add_argument("--data", help="score this UTF-8 text file instead of a split")
    e.add_argument(
        "--stride",
        type=int,
        help="sliding-window stride in tokens (each window "
        "scores only its last STRIDE tokens); default: the context length",
    )
    e.add_argument("--max-tokens", type=int, help="score only the first N tokens")
    e.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    _add_common(e)

    g = sub.add_parser(
        "generate",
        help="sample text from a model (streams to stdout)",
        description="Continue a prompt with a model (run folder, Hugging Face folder or .gguf "
        "file), using the KV cache. Stops at max-new-tokens, the tokenizer's end-of-sequence "
        "token or a stop string. --chat wraps the text in the model's own chat template and "
        "prints only the answer.",
    )
    g.add_argument("run", metavar="MODEL", help="run folder, Hugging Face folder or .gguf file")
    g.add_argument(
        "--chat",
        metavar="MESSAGE",
        help="ask a chat model: apply its chat template to MESSAGE, print the reply (stops at "
        "the template's end-of-turn token)",
    )
    g.add_argument("--system", help="with --chat: a system message")
    g.add_argument(
        "--prompt",
        action="append",
        help="text to continue (default: a newline); repeat it to continue several prompts as "
        "one batch, printed as blocks separated by a line ---",
    )
    g.add_argument(
        "--max-new-tokens", type=int, default=200, help="at most this many new tokens (default 200)"
    )
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    g.add_argument(
        "--top-k", type=int, default=0, help="sample among the K most likely tokens (0 = off)"
    )
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="> 1 discourages tokens already present (1 = off)",
    )
    g.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="STR",
        help="stop when this string appears (repeatable; not printed; \\n and \\t are "
        "newline and tab)",
    )
    g.add_argument("--seed", type=int, help="random seed for reproducible samples")
    g.add_argument("--no-prompt", action="store_true", help="print only the continuation")
    _add_common(g)

    c = sub.add_parser(
        "chat",
        help="talk to a chat model in the terminal (streams replies)",
        description="A read-reply loop with a model's own chat template: each line is a "
        "message; the history is kept, oldest turns dropped to fit the context. /reset clears "
        "the history, /exit or Ctrl-D quits. Example: lmlab chat model.gguf --temperature 0.7",
    )
    c.add_argument("run", metavar="MODEL", help="run folder, Hugging Face folder or .gguf file")
    c.add_argument("--system", help="a system message kept at the start of the conversation")
    c.add_argument(
        "--max-context",
        type=int,
        metavar="TOKENS",
        help="token budget of the conversation + reply (default: the model's context)",
    )
    c.add_argument(
        "--max-new-tokens", type=int, default=512, help="at most this many tokens per reply"
    )
    c.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    c.add_argument(
        "--top-k", type=int, default=0, help="sample among the K most likely tokens (0 = off)"
    )
    c.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    c.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (1 = off)"
    )
    c.add_argument("--seed", type=int, help="random seed for reproducible replies")
    _add_common(c)

    v = sub.add_parser(
        "verify",
        help="prove a model config correct: causality, KV cache, gradients, reference",
        description="Run lmlab's correctness proofs on a model configuration with random "
        "weights: causality, cached decoding == full forward, finite gradients, safetensors "
        "round trip, and equality with the Hugging Face reference model where the config has "
        "an exact counterpart (needs transformers). Prints a table; exits 1 on any failure.",
    )
    v.add_argument("--config", help="a config YAML (default: every preset in configs/)")
    v.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")

    ins = sub.add_parser(
        "inspect",
        help="parameter counts of a config or run, without building it",
        description="Parameters per component (tied weights counted once), total and "
        "non-embedding, computed in closed form from the config: real-size models (e.g. "
        "configs/llama.yaml with the overrides in its header) are inspected without being built.",
    )
    ins.add_argument("path", metavar="CONFIG_OR_RUN")
    ins.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field (repeatable)",
    )
    ins.add_argument("--json", action="store_true", help="print one JSON object")
    ins.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")

    ls = sub.add_parser(
        "list",
        help="list the component variants a config can choose",
        description="Every registered variant, by family, with the config field that selects "
        "it and a one-line description citing its source.",
    )
    ls.add_argument("family", nargs="?", help="only this family (e.g. position, ffn)")
    ls.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    return parser


def _version() -> str:
    from lmlab import __version__

    return f"lmlab {__version__}"


def cmd_train(args: argparse.Namespace) -> int:
    from lmlab.config import load_config
    from lmlab.training.trainer import train

    overrides = list(args.set)
    if args.data:
        overrides.append(f"data.corpus={json.dumps(args.data)}")
    cfg = None
    if not args.resume:
        cfg = load_config(args.config, overrides)
    elif args.config or overrides:  # checked against the run's own config by train()
        cfg = load_config(args.config or Path(args.resume) / "config.yaml", overrides)
    if args.nproc is not None:  # torchrun starts N copies of this command without --nproc
        from lmlab.training.distributed import launch

        return launch(args.nproc, _without_nproc(args.argv))
    res = train(
        cfg,
        out=args.out,
        resume=args.resume,
        max_steps=args.max_steps,
        time_budget=args.time_budget,
        device=args.device,
        progress=args.progress,
    )
    if os.environ.get("RANK", "0") != "0":  # under torchrun rank 0 reports
        return 0
    val = f"{res.val_loss:.4f}" if res.val_loss is not None else "n/a"
    if res.steps_run == 0:
        print(
            f"{res.run_dir} is already at step {res.step} (val_loss {val}); nothing to do. "
            "Extend it with --max-steps N",
            file=sys.stderr,
        )
        return 0
    mfu = f", MFU {100 * res.mfu:.1f}%" if res.mfu is not None else ""
    note = " (stopped by --time-budget)" if res.stopped_early else ""
    print(
        f"trained {res.run_dir} to step {res.step}{note}: val_loss {val} nats/token, "
        f"{res.tokens_per_s:,.0f} tokens/s on average{mfu}, {res.elapsed_s:.0f} s of training",
        file=sys.stderr,
    )
    return 0


def _without_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--nproc N`` / ``--nproc=N`` (or an abbreviation argparse accepted;
    argparse never takes a value that looks like an option, so such a token is the option)."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if len(name) >= 4 and "--nproc".startswith(name):
            skip = "=" not in token
            continue
        out.append(token)
    return out


def cmd_eval(args: argparse.Namespace) -> int:
    from lmlab.evaluation.evaluate import evaluate

    res = evaluate(
        args.run,
        split=args.split,
        data=args.data,
        stride=args.stride,
        max_tokens=args.max_tokens,
        device=args.device or "auto",
        batch_size=args.batch_size,
    )
    if args.json:
        print(json.dumps(res.as_dict()))
    else:
        for k, v in res.as_dict().items():
            print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from lmlab.generation.generate import SamplingParams, generate_text, generate_texts
    from lmlab.generation.stream import unescape

    params = SamplingParams(
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.top_p,
        args.repetition_penalty,
        [unescape(s) for s in args.stop],
        args.seed,
    )
    params.validate()
    if args.chat is not None and args.prompt:
        raise LmlabError("give either --chat or --prompt, not both")
    if args.system is not None and args.chat is None:
        raise LmlabError("--system needs --chat")
    model, tokenizer = _load_with_tokenizer(args.run, args.device)
    max_seq_len = model.cfg.max_seq_len
    out = sys.stdout
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


def _load_with_tokenizer(path: str, device: str | None) -> tuple[typing.Any, typing.Any]:
    """``lmlab.load(path)``; LmlabError when the model comes without a tokenizer."""
    from lmlab.interop.load import load

    model, tokenizer = load(path, device or "auto")
    if tokenizer is None:
        raise LmlabError(f"{path} has no tokenizer, so text cannot be generated with it")
    return model, tokenizer


def cmd_chat(args: argparse.Namespace) -> int:
    from lmlab.generation.chat import chat_repl
    from lmlab.generation.generate import SamplingParams

    params = SamplingParams(
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.top_p,
        args.repetition_penalty,
        [],
        args.seed,
    )
    params.validate()
    if args.max_context is not None and args.max_context < 2:
        raise LmlabError(f"--max-context must be >= 2 tokens, got {args.max_context}")
    model, tokenizer = _load_with_tokenizer(args.run, args.device)
    limit = model.cfg.max_seq_len
    return chat_repl(model, tokenizer, params, min(args.max_context or limit, limit), args.system)


def cmd_verify(args: argparse.Namespace) -> int:
    from lmlab.analysis.verify import format_table, verify

    checks = verify(args.config)
    print(format_table(checks))
    failed = [c for c in checks if c.status == "FAIL"]
    print(f"{len(checks) - len(failed)} passed or skipped, {len(failed)} failed")
    return 1 if failed else 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from lmlab.analysis.params import inspect_config

    info = inspect_config(args.path, args.set)
    if args.json:
        print(json.dumps(info))
        return 0
    total = int(info["params_total"])
    print(
        f"{info['name']}: {total:,} parameters "
        f"({int(info['params_non_embedding']):,} non-embedding)"
    )
    for name, n in info["components"].items():
        print(f"  {name:<10} {n:>16,}  {100 * n / total:5.1f}%")
    if info["vocab_note"]:
        print(f"note: {info['vocab_note']}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    import lmlab.data.tokenizer  # noqa: F401  (registers tokenizers)
    import lmlab.interop.families  # noqa: F401
    import lmlab.models  # noqa: F401
    import lmlab.models.init  # noqa: F401
    import lmlab.nn  # noqa: F401
    from lmlab.registry import families

    regs = families()
    if args.family is not None and args.family not in regs:
        raise LmlabError(f"unknown family {args.family!r}; families: {', '.join(sorted(regs))}")
    for family, reg in regs.items():
        if args.family in (None, family):
            print(f"{family} ({reg.field}):" if reg.field else f"{family}:")
            for name, doc in reg.describe().items():
                print(f"  {name:<12} {doc}")
    return 0


COMMANDS = {
    "train": cmd_train,
    "eval": cmd_eval,
    "generate": cmd_generate,
    "chat": cmd_chat,
    "verify": cmd_verify,
    "inspect": cmd_inspect,
    "list": cmd_list,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    if args.command is None:
        parser.print_help()
        return 0
    debug = getattr(args, "debug", False) or bool(os.environ.get("LMLAB_DEBUG"))
    try:
        return COMMANDS[args.command](args)
    except Interrupted as e:
        print(str(e), file=sys.stderr)
        return e.exit_code
    except LmlabError as e:
        if debug:
            raise
        rank = os.environ.get("RANK", "0")  # under torchrun every rank may report the same
        print(f"error{'' if rank == '0' else f' (rank {rank})'}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # a bug: one line unless --debug
        if debug:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(
            f"error: unexpected {type(e).__name__}: {first} (run with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
