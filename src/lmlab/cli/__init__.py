"""The ``lmlab`` command line: each subcommand calls exactly one library function.

:data:`COMMANDS` is the table: subcommand -> :class:`lmlab.cli.common.Command` (its flags and the
function it runs), the functions living by area in lmlab.cli.training (train, compare),
generation (generate, chat), scoring (eval, fill-mask, embed), models (verify, inspect,
attention, export, import) and listing (list). Flags several subcommands share are added in one
place, :func:`lmlab.cli.common.add_common`.

Errors a user can cause are printed as one ``error: ...`` line on stderr with exit code 2; any
other exception prints one line too (exit 1) unless ``--debug`` asks for the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence

from lmlab.cli import (
    generation,
    interp_heads,
    interp_lens,
    interp_patch,
    listing,
    models,
    scoring,
    training,
)
from lmlab.cli.common import Command, _Parser, add_common
from lmlab.cli.training import _without_nproc
from lmlab.errors import Interrupted, LmlabError
from lmlab.plugins import plugins
from lmlab.textsafe import one_line

__all__ = ["COMMANDS", "build_parser", "main", "_without_nproc"]

DESCRIPTION = """\
lmlab: build, train, probe and compare Transformer language models.

  lmlab train                         train the default Mini-GPT on tinyshakespeare
  lmlab generate runs/minigpt --prompt "ROMEO:"
  lmlab eval runs/minigpt             loss, perplexity and bits per byte on the val split
  lmlab generate model.gguf --chat "What is the capital of France?" --temperature 0
  lmlab chat model.gguf               talk to a chat model (its own template, history kept)
  lmlab train --config configs/llama.yaml --nproc 2     a preset, on 2 processes (DDP)
  lmlab verify --config my.yaml       prove a model config correct (and equal to Hugging Face's)
  lmlab inspect configs/mixtral.yaml  parameters, FLOPs, KV cache and memory, without building it
  lmlab attention runs/minigpt --text "ROMEO:"   attention heatmaps and per-head diagnostics
  lmlab lens runs/minigpt --text "ROMEO: But" --target " "   logit lens + logit attribution
  lmlab heads model.gguf --html heads.html  previous-token, induction, duplicate and sink heads
  lmlab patch runs/minigpt --clean "Enter ROMEO an" --corrupted "Enter ROMEO on" --target d
                                      activation patching: which layers and heads carry it
  lmlab train --config configs/seq2seq-reverse.yaml     an encoder-decoder on a reverse task
  lmlab generate runs/seq2seq-reverse --source "abcdefgh" --temperature 0
  lmlab compare experiments/positions.yaml   train variants x seeds, report.md + plots
  lmlab eval runs/minigpt --lengths 128,256,512 --set model.position.scaling.kind=ntk
      --set model.position.scaling.factor=4   loss per context length, RoPE scaled 4x (NTK)
  lmlab list                          every component variant a config can name
  lmlab export runs/minigpt --format hf --out hf/minigpt    a Hugging Face folder (checked)
  lmlab import hf/minigpt --out runs/imported               any loadable model as a run
  lmlab train --init-from hf/minigpt --data my.txt          fine-tune a model on your text
  lmlab train --config configs/bert-mini.yaml           a BERT (masked LM) on the same corpus
  lmlab fill-mask runs/bert-mini --text "To be, or not to be, that is the [MASK]."
  lmlab embed MODEL_DIR --text "A man plays a guitar." --text "Someone plays music." --json
"""


# subcommand -> what it adds to the parser and runs; ``lmlab --help`` lists them in this order
COMMANDS: dict[str, Command] = {
    "train": training.TRAIN,
    "eval": scoring.EVAL,
    "generate": generation.GENERATE,
    "chat": generation.CHAT,
    "verify": models.VERIFY,
    "inspect": models.INSPECT,
    "attention": models.ATTENTION,
    "lens": interp_lens.LENS,
    "heads": interp_heads.HEADS,
    "patch": interp_patch.PATCH,
    "export": models.EXPORT,
    "import": models.IMPORT,
    "compare": training.COMPARE,
    "fill-mask": scoring.FILL_MASK,
    "embed": scoring.EMBED,
    "list": listing.LIST,
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="lmlab", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in COMMANDS.items():
        p = sub.add_parser(
            name, help=command.help, description=command.description, epilog=command.epilog
        )
        command.arguments(p)
        add_common(p, command.common)
    return parser


def _version() -> str:
    from lmlab import __version__

    return f"lmlab {__version__}"


# flags whose value is text to encode
TEXT_ARGS = (
    "prompt",
    "chat",
    "system",
    "text",
    "stop",
    "clean",
    "corrupted",
    "target",
    "versus",
    "source",  # generate, attention, lens: an encoder-decoder's source text
    "clean_source",  # patch
    "corrupted_source",
)


def _check_text_args(args: argparse.Namespace) -> None:
    """Refuse text flags holding bytes that are not UTF-8 (Python passes them on as lone
    surrogates, which the tokenizers library rejects with a TypeError)."""
    for name in TEXT_ARGS:
        value = getattr(args, name, None)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str):
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as e:
                    bad = item[e.start].encode("utf-8", "surrogateescape")
                    flag = "--" + name.replace("_", "-")
                    raise LmlabError(
                        f"{flag} is not UTF-8 text (byte 0x{bad.hex()} at character {e.start}); "
                        "give UTF-8 text"
                    ) from None


POSITIONAL_ARGS = ("run", "model", "path", "experiment", "family")  # argparse dests, no "--"


def _check_path_args(args: argparse.Namespace) -> None:
    """Refuse every other string argument (paths, names) holding bytes that are not UTF-8: the
    file formats lmlab writes and reads through Rust libraries (safetensors, tokenizers) and
    YAML take UTF-8 names only, so such a path failed later, after work was done, with
    'unexpected UnicodeEncodeError' or a checkpoint called corrupt."""
    for name, value in vars(args).items():
        if name in TEXT_ARGS or name in ("argv", "command"):
            continue
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, str):
                continue
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                bad = item[e.start].encode("utf-8", "surrogateescape")
                flag = name.upper() if name in POSITIONAL_ARGS else "--" + name.replace("_", "-")
                raise LmlabError(
                    f"{flag} {item!r} is not UTF-8 (byte 0x{bad.hex()} at character {e.start}): "
                    "lmlab's files (safetensors, tokenizer.json, YAML) need UTF-8 names; rename it"
                ) from None


# Numeric flags (argparse dest) -> (lowest, highest) allowed, checked before a command runs. A
# lowest of None is checked where the value is used (--stride against the context, --max-steps
# as train.max_steps, --time-budget as positive seconds); --nproc against the cores in launch().
NUMERIC_FLAGS: dict[str, tuple[int | None, float]] = {
    "max_steps": (None, 10**9),  # optimizer steps
    "time_budget": (None, 1e8),  # seconds (three years)
    "stride": (None, 1 << 24),  # tokens
    "max_tokens": (2, 1 << 40),  # tokens
    "batch_size": (1, 1 << 16),  # windows per forward pass
    "max_new_tokens": (0, 1 << 20),  # tokens
    "max_context": (2, 1 << 24),  # tokens
    "seq_len": (1, 1 << 24),  # tokens
    "batch": (1, 1 << 20),  # sequences
    "context": (1, 1 << 30),  # KV-cache tokens
}


def _check_numeric_args(args: argparse.Namespace) -> None:
    """Refuse a numeric flag outside :data:`NUMERIC_FLAGS` (NaN and inf included) in one line."""
    for name, (low, high) in NUMERIC_FLAGS.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if low is not None and not value >= low:  # (NaN fails this)
            raise LmlabError(f"{flag} must be >= {low}, got {value}")
        if value > high:
            raise LmlabError(f"{flag} must be <= {high:,.0f}, got {value}")


# flags whose value may start with '-' (argparse would take "-1:3" for an option and say only
# "expected one argument"); their value is joined to them ("--window=-1:3") before parsing
DASH_VALUE_FLAGS = ("--window",)


def _join_dash_values(argv: list[str]) -> list[str]:
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg == "--":  # everything after it is positional
            out += [arg, *it]
            break
        if arg in DASH_VALUE_FLAGS:
            value = next(it, None)
            if value is not None and value.startswith("-") and not value.startswith("--"):
                out.append(f"{arg}={value}")
                continue
            out += [arg] if value is None else [arg, value]
            continue
        out.append(arg)
    return out


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
    """warnings.showwarning for the CLI: ``warning: MESSAGE``, one line on stderr."""
    print(f"warning: {one_line(str(message))}", file=sys.stderr if file is None else file)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(_join_dash_values(argv))
    args.argv = argv
    if args.command is None:
        parser.print_help()
        return 0
    debug = getattr(args, "debug", False) or bool(os.environ.get("LMLAB_DEBUG"))
    try:
        _check_text_args(args)
        _check_path_args(args)
        _check_numeric_args(args)
        with warnings.catch_warnings(), plugins(getattr(args, "plugin", None)) as args.plugins:
            if not debug:  # a library's warning as one "warning:" line, not file:line + source
                warnings.showwarning = _one_line_warning
            return COMMANDS[args.command].run(args)
    except Interrupted as e:
        print(str(e), file=sys.stderr)
        return e.exit_code
    except LmlabError as e:
        if debug:
            raise
        rank = os.environ.get("RANK", "0")  # under torchrun every rank may report the same
        where = "" if rank == "0" else f" (rank {rank})"
        print(f"error{where}: {one_line(str(e))}", file=sys.stderr)  # may quote a model's text
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # a bug: one line unless --debug
        if debug:
            raise
        first = one_line(str(e).strip().splitlines()[0]) if str(e).strip() else ""
        print(
            f"error: unexpected {type(e).__name__}: {first} (run with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
