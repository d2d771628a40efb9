"""``lmlab patch``: activation patching of a clean / corrupted prompt pair
(:func:`lmlab.analysis.patching_report.patch_report`)."""

from __future__ import annotations

import argparse
import json
import sys

from lmlab.cli.common import Command


def _patch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="run folder, Hugging Face folder or GGUF file")
    p.add_argument(
        "--clean", metavar="TEXT", help="the prompt the model gets right (required for a "
        "decoder; an encoder-decoder's decoder text, default empty: the metric is then on the "
        "first output token)",
    )  # fmt: skip
    p.add_argument(
        "--corrupted", metavar="TEXT",
        help="the same prompt with a few tokens changed (must be as many tokens as --clean; "
        "required for a decoder, an encoder-decoder's defaults to --clean)",
    )  # fmt: skip
    p.add_argument(
        "--clean-source", metavar="TEXT", help="encoder-decoders only: the source text the "
        "model gets right (encoded as in training); the decoder reads "
        "model.seq2seq.decoder_start_token_id, then --clean, as it was trained",
    )  # fmt: skip
    p.add_argument(
        "--corrupted-source", metavar="TEXT", help="encoder-decoders only: the source with a "
        "few tokens changed (as many tokens as --clean-source; default --clean-source)",
    )  # fmt: skip
    p.add_argument(
        "--target", required=True, metavar="TOKEN",
        help="the token the clean prompt predicts next (one token; a BPE word usually with its "
        "leading space)",
    )  # fmt: skip
    p.add_argument(
        "--versus", metavar="TOKEN", help="the contrast token: the metric is the logit "
        "difference target - versus (default: the target's log-probability, nats)",
    )  # fmt: skip
    p.add_argument(
        "--what", metavar="LIST",
        help="what to patch, comma-separated: resid_pre, resid_mid, resid_post, attn_out, "
        "ffn_out, heads (default resid_pre,attn_out,ffn_out,heads); an encoder-decoder's "
        "decoder points take these names plus resid_cross, cross_out, cross_heads, and its "
        "encoder's the same names after 'encoder.' (encoder.resid_pre, encoder.heads, ...; "
        "default encoder.resid_pre,resid_pre,heads,cross_heads)",
    )  # fmt: skip
    p.add_argument("--out", default="patch", help="folder for the PNGs (default: patch)")
    p.add_argument("--no-plot", action="store_true", help="print the numbers only")
    p.add_argument(
        "--top", type=int, default=5, help="patches listed per map by |score| (default %(default)s)"
    )
    p.add_argument(
        "--html", metavar="OUT.html", help="also write one self-contained interactive page (a "
        "map per --what, hover a cell for its score); an existing file is refused",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _progress(done: int, total: int) -> None:
    print(f"patching: {done}/{total} runs", file=sys.stderr, flush=True)


def cmd_patch(args: argparse.Namespace) -> int:
    from lmlab.analysis.patching_report import format_report, patch_report
    from lmlab.errors import LmlabError

    if not 0 <= args.top <= 1_000_000:
        raise LmlabError(f"--top must be between 0 and 1,000,000, got {args.top}")
    report = patch_report(
        args.model,
        args.clean,
        args.corrupted,
        args.target,
        args.versus,
        what=args.what,
        out=None if args.no_plot else args.out,
        html=args.html,
        device=args.device or "auto",
        progress=_progress,
        clean_source=args.clean_source,
        corrupted_source=args.corrupted_source,
    )
    if args.json:
        print(json.dumps(report.as_dict(args.top), ensure_ascii=False))
        return 0
    print(format_report(report, args.top))
    for f in report.files:
        print(f"wrote {f}")
    return 0


PATCH = Command(
    help="activation patching: which layers, positions and heads carry a prompt's answer",
    description="Run MODEL on --clean and on --corrupted (the same number of tokens), then "
    "re-run the corrupted prompt once per activation with that one activation taken from the "
    "clean run: the residual stream entering each layer (resid_pre), each attention and FFN "
    "output (attn_out, ffn_out) at each position, and each head's output at all positions "
    "(heads). Each is scored (patched - corrupted) / (clean - corrupted) on the logit "
    "difference --target - --versus at the last token (no --versus: log p(target)): 1 = the "
    "clean answer is fully restored, 0 = no effect. Prints the metric and each map's top patches; "
    "writes OUT/patch-WHAT.png (layers x positions, layers x heads). An encoder-decoder takes "
    "--clean-source/--corrupted-source (the encoder inputs) and --clean/--corrupted as decoder "
    "texts (after the start token): maps of the encoder (layers x source positions, heads) "
    "and of the decoder (layers x decoder positions, self- and cross-attention heads). Causal "
    "tracing (Meng et al. 2022), IOI (Wang et al. 2022); see docs/interpretability.md.",
    arguments=_patch_arguments,
    run=cmd_patch,
    epilog='example: lmlab patch runs/minigpt --clean "Enter ROMEO an" --corrupted "Enter '
    'ROMEO on" --target d --versus " " --html patch.html (prompts of equal token length)',
)
