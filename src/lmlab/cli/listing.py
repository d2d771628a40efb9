"""``lmlab list``: every registered component variant, by family."""

from __future__ import annotations

import argparse

from lmlab.cli.common import Command
from lmlab.errors import LmlabError


def _list_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("family", nargs="?", help="only this family (e.g. position, ffn)")


def cmd_list(args: argparse.Namespace) -> int:
    import lmlab.data.tokenizer  # noqa: F401  (registers tokenizers)
    import lmlab.interop.families  # noqa: F401
    import lmlab.models  # noqa: F401
    import lmlab.models.init  # noqa: F401
    import lmlab.nn  # noqa: F401
    import lmlab.training.objectives  # noqa: F401
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


LIST = Command(
    help="list the component variants a config can choose",
    description="Every registered variant, by family, with the config field that selects "
    "it and a one-line description citing its source.",
    arguments=_list_arguments,
    run=cmd_list,
    common=("debug-hidden",),
)
