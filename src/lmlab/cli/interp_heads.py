"""``lmlab heads``: score every attention head as previous-token, induction, duplicate-token
and sink head (lmlab.analysis.head_detectors)."""

from __future__ import annotations

import argparse
import json

from lmlab.cli.common import Command


def _heads_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="run folder, Hugging Face folder or GGUF file")
    p.add_argument(
        "--seq-len", type=int, metavar="L", help="random tokens per block; the input is the "
        "block twice, 2 L tokens (default: 50, or half the model's context if shorter)"
    )  # fmt: skip
    p.add_argument("--batch", type=int, default=4, help="random sequences (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens (default 0)")
    p.add_argument(
        "--text", help="also score previous-token and sink attention on this text (t.prev, "
        "t.sink columns; JSON: text_previous_token, text_sink)"
    )  # fmt: skip
    p.add_argument("--out", default="heads", help="folder for heads.png (default: heads)")
    p.add_argument("--no-plot", action="store_true", help="print the numbers only")
    p.add_argument(
        "--html", metavar="OUT.html", help="also write one self-contained interactive page "
        "(a layer x head grid per detector); an existing file is refused"
    )  # fmt: skip
    p.add_argument(
        "--json", action="store_true", help="print only a JSON list of per-head records "
        "{layer, head, previous_token, induction, duplicate_token, sink, kinds}"
    )  # fmt: skip


def cmd_heads(args: argparse.Namespace) -> int:
    from lmlab.analysis.head_detectors import format_scores
    from lmlab.analysis.heads_report import heads_report

    report = heads_report(
        args.model,
        seq_len=args.seq_len,
        batch=args.batch,
        seed=args.seed,
        text=args.text,
        out=None if args.no_plot else args.out,
        html=args.html,
        device=args.device or "auto",
    )
    if args.json:
        print(json.dumps([s.as_dict() for s in report.scores]))
        return 0
    print(format_scores(report.scores, report.thresholds))
    for f in report.files:
        print(f"wrote {f}")
    return 0


HEADS = Command(
    help="find previous-token, induction, duplicate-token and sink heads",
    description="Run a model on random tokens repeated twice (x_0..x_{L-1} x_0..x_{L-1}) and "
    "score every head by the mean attention it puts on one predicted key: previous token "
    "(query i -> i-1), induction (L+j -> j+1, the token after the earlier copy; Olsson et al. "
    "2022), duplicate token (L+j -> j; Wang et al. 2022) and sink (i -> 0; Xiao et al. 2023). "
    "Each score is in [0, 1]; a head reaching 0.4 is flagged that kind. Prints a table and the "
    "flagged heads, writes OUT/heads.png (a layer x head heatmap per detector). Layers and "
    "heads count from 0. Definitions and caveats: docs/interpretability.md.",
    arguments=_heads_arguments,
    run=cmd_heads,
    epilog="example: lmlab heads model.gguf --seq-len 40 --batch 2 --html heads.html; "
    "lmlab heads runs/minigpt --json",
)
