"""``lmlab lens``: the logit lens of a model on a text, and the direct logit attribution of one
target token's logit (lmlab.analysis.lens_report)."""

from __future__ import annotations

import argparse
import json
import sys

from lmlab.cli.common import Command


def _lens_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="run folder, Hugging Face folder or .gguf file")
    p.add_argument(
        "--text", required=True, help="the text to run the model on (an encoder-decoder: the "
        "decoder's target prefix, read behind model.seq2seq.decoder_start_token_id as in "
        "training, so column 0 is the start token and predicts the first target token; "
        "--text '' runs the start token alone)"
    )  # fmt: skip
    p.add_argument(
        "--source", metavar="TEXT", help="encoder-decoder only, and required there: the "
        "encoder's input (framed as in training); the lens and attribution read the decoder"
    )  # fmt: skip
    p.add_argument("--top", type=int, default=5, metavar="K",
                   help="top tokens kept per layer and position (default %(default)s, "
                   "at most 1000)")  # fmt: skip
    p.add_argument(
        "--target", metavar="TOKEN", help="one token (its text, e.g. ' the'): its probability "
        "and rank per layer and position, and the direct logit attribution of its logit"
    )  # fmt: skip
    p.add_argument(
        "--versus", metavar="TOKEN", help="with --target: attribute the logit difference "
        "target - versus instead"
    )  # fmt: skip
    p.add_argument(
        "--position", type=int, default=-1, metavar="P", help="the position whose next-token "
        "logit is attributed (default -1: the last; negative counts from the end)"
    )  # fmt: skip
    p.add_argument("--out", default="lens", help="folder for lens.png and dla.png (default: lens)")
    p.add_argument("--no-plot", action="store_true", help="print the numbers only")
    p.add_argument(
        "--html", metavar="OUT.html", help="also write one self-contained interactive page "
        "(click a cell to see its top tokens); an existing file is refused"
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")


def cmd_lens(args: argparse.Namespace) -> int:
    from lmlab.analysis.lens_report import format_dla, format_lens, lens_report
    from lmlab.analysis.patching import tokens_phrase

    report = lens_report(
        args.model,
        args.text,
        top=args.top,
        target=args.target,
        versus=args.versus,
        position=args.position,
        out=None if args.no_plot else args.out,
        html=args.html,
        device=args.device or "auto",
        source=args.source,
    )
    if args.json:
        print(json.dumps(report.as_dict(), ensure_ascii=False))
        if report.dla_unavailable:
            print(f"note: {report.dla_unavailable}", file=sys.stderr)
        return 0
    if report.source is not None:
        print(f"source, {tokens_phrase(len(report.source))}: {' '.join(report.source)}")
        print("decoder input, ", end="")
    print(f"{tokens_phrase(len(report.tokens))}: {' '.join(report.tokens)}")
    print(f"logit lens: top-1 prediction of {report.predicts} and its probability after each "
          "layer")  # fmt: skip
    print(format_lens(report))
    if args.target is not None:
        print()
        print(format_dla(report))
    for f in report.files:
        print(f"wrote {f}")
    return 0


LENS = Command(
    help="logit lens (per-layer predictions) and direct logit attribution on a text",
    description="Run a model on --text and put the residual stream after the embedding and "
    "after every layer through the model's own final norm and LM head (the logit lens, "
    "nostalgebraist 2020): prints layer x position the top-1 next token and its probability "
    "(the last row is the model's output). With --target TOKEN: that token's probability and "
    "rank per layer x position, and the direct logit attribution of its logit at --position "
    "(Elhage et al. 2021): the embedding, every head, every FFN, with the final norm frozen at "
    "the run's scale, summing to the actual logit (pre-norm decoders). An encoder-decoder "
    "(T5, BART) needs --source (the encoder's text): the lens reads its decoder, whose input "
    "is the decoder start token then --text, and the attribution (pre-norm only) splits each "
    "decoder layer into self-attention heads (L{i}.self.H{h}), cross-attention heads "
    "(L{i}.cross.H{h}) and the FFN. Writes OUT/lens.png and OUT/dla.png; --html one "
    "interactive page. Layers, heads and positions count from 0.",
    arguments=_lens_arguments,
    run=cmd_lens,
    epilog='example: lmlab lens runs/minigpt --text "ROMEO: But soft" --target " " --out lens; '
    'lmlab lens model.gguf --text "The capital of France is" --target " Paris" --versus '
    '" London" --html lens.html; lmlab lens runs/t5 --source "abcd" --text "dc" --target "b"',
)
