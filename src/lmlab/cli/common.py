"""What every subcommand shares: the parser class, the :class:`Command` table entry, the common
flags (one place adds them: :data:`COMMON_FLAGS`), and the sampling flags of ``generate`` and
``chat``, declared once (:data:`SAMPLING_FLAGS`)."""

from __future__ import annotations

import argparse
import typing
from collections.abc import Callable
from dataclasses import dataclass

if typing.TYPE_CHECKING:
    from lmlab.generation.generate import SamplingParams


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``error: ...``, exit 2), like every other lmlab error."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


# Flags several subcommands take, by the name a Command lists in ``common``; added last, in the
# order a Command names them.
COMMON_FLAGS: dict[str, dict[str, typing.Any]] = {
    "device": {
        "default": None,
        "choices": ["auto", "cpu", "cuda", "mps"],
        "help": "where to run (default: the config's train.device, 'auto': cuda, mps, then cpu)",
    },
    "debug": {"action": "store_true", "help": "show Python tracebacks on errors"},
    "quantize": {
        "metavar": "int8|int4[:G][+h4][+a8]",
        "help": "quantize the linear layers' weights after loading: int8 (one scale "
        "per output row), int4 (asymmetric, a scale and zero per 32 weights; the LM head int8 "
        "per 32, +h4 rounds it to 4 bits too); int4:64 sets the group size; +a8 (int4+a8) also "
        "rounds each layer's input to int8 per 32 values, for integer dot products (faster "
        "decode, slightly different numbers; docs/quantization.md)",
    },
    "debug-hidden": {"dest": "debug", "action": "store_true", "help": argparse.SUPPRESS},
    "plugin": {
        "action": "append",
        "metavar": "FILE.py",
        "help": "import this one-file component first (it registers itself; repeatable; runs its "
        "code: name only files you trust)",
    },
}
COMMON_FLAG_NAMES = {
    "device": "--device",
    "debug": "--debug",
    "quantize": "--quantize",
    "debug-hidden": "--debug",
    "plugin": "--plugin",
}


def add_common(p: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
    """Add the :data:`COMMON_FLAGS` named in ``names`` to ``p``, in that order."""
    for name in names:
        p.add_argument(COMMON_FLAG_NAMES[name], **COMMON_FLAGS[name])


@dataclass(frozen=True)
class Command:
    """One subcommand: its parser's texts, the function adding its own flags, the function it
    runs (returns the exit code), and the :data:`COMMON_FLAGS` it takes (added after its own)."""

    help: str
    description: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    common: tuple[str, ...] = ("device", "debug")
    epilog: str | None = None


# The sampling flags (argparse dest -> add_argument keywords), shared by generate and chat; a
# command overrides a flag's default or help where it differs. "%(default)s" is the default.
SAMPLING_FLAGS: dict[str, dict[str, typing.Any]] = {
    "max_new_tokens": {
        "type": int,
        "default": 200,
        "help": "at most this many new tokens (default %(default)s)",
    },
    "temperature": {
        "type": float,
        "default": 0.8,
        "help": "0 = greedy, as is a value too small for float32 such as 1e-45 "
        "(default %(default)s)",
    },
    "top_k": {"type": int, "default": 0, "help": "sample among the K most likely tokens (0 = off)"},
    "top_p": {"type": float, "default": 1.0, "help": "nucleus sampling mass (1 = off)"},
    "repetition_penalty": {
        "type": float,
        "default": 1.0,
        "help": "> 1 discourages tokens already present (1 = off)",
    },
    "stop": {
        "action": "append",
        "default": [],
        "metavar": "STR",
        "help": "stop when this string appears (repeatable; not printed; \\n and \\t are "
        "newline and tab)",
    },
    "seed": {"type": int, "help": "random seed for reproducible samples"},
}


def add_sampling_flags(
    p: argparse.ArgumentParser, omit: tuple[str, ...] = (), **changes: dict[str, typing.Any]
) -> None:
    """Add :data:`SAMPLING_FLAGS` to ``p`` except those in ``omit``; ``changes`` maps a flag's
    dest to keywords replacing its own (e.g. ``seed={"help": ...}``)."""
    for dest, kw in SAMPLING_FLAGS.items():
        if dest not in omit:
            p.add_argument("--" + dest.replace("_", "-"), **{**kw, **changes.get(dest, {})})


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The validated SamplingParams of the sampling flags in ``args`` (no --stop: none)."""
    from lmlab.generation.generate import SamplingParams
    from lmlab.generation.stream import unescape

    params = SamplingParams(
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.top_p,
        args.repetition_penalty,
        [unescape(s) for s in getattr(args, "stop", [])],
        args.seed,
    )
    params.validate()
    return params
