"""``lmlab list``: every registered component variant, by family."""

from __future__ import annotations

import argparse

from lmlab.cli.common import Command
from lmlab.errors import LmlabError


def _list_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("family", nargs="?", help="only this family (e.g. position, ffn)")
    p.add_argument("--markdown", action="store_true", help="print docs/components.md")


def cmd_list(args: argparse.Namespace) -> int:
    from lmlab.analysis.components_doc import components_markdown, load_registries
    from lmlab.registry import families

    load_registries()
    if args.markdown:
        print(components_markdown(), end="")
        return 0
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
    common=("debug-hidden", "plugin"),
)
