"""``lmlab eval``, ``lmlab fill-mask`` and ``lmlab embed``: score, fill and embed texts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lmlab.cli.common import Command
from lmlab.errors import LmlabError


def _eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="MODEL", help="run folder, Hugging Face folder or .gguf file")
    p.add_argument(
        "--split",
        default="val",
        choices=["train", "val", "test"],
        help="corpus split to score (default: val; test only where the corpus has one)",
    )
    p.add_argument("--data", help="score this UTF-8 text file instead of a split")
    p.add_argument(
        "--stride",
        type=int,
        help="sliding-window stride in tokens (each window "
        "scores only its last STRIDE tokens); default: the context length",
    )
    p.add_argument("--max-tokens", type=int, help="score only the first N tokens")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    p.add_argument(
        "--lengths",
        metavar="L1,L2,...",
        help="length extrapolation: perplexity at each context length (non-overlapping windows "
        "over the same text), printed as a table and plotted, e.g. --lengths 128,256,512,1024; "
        "RUN may then be anything lmlab.load accepts",
    )
    p.add_argument(
        "--plot",
        metavar="FILE",
        help="with --lengths: the PNG to write (default: eval_lengths.png in the current folder)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="inference-time override of the model's position scaling, e.g. --set "
        "model.position.scaling.kind=ntk --set model.position.scaling.factor=4 (repeatable; "
        "implies --lengths at the trained context if --lengths is not given)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _fill_mask_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--text", required=True, help="text with one or more [MASK] tokens")
    p.add_argument("--top-k", type=int, default=5, help="fills shown per mask (default 5)")
    p.add_argument("--json", action="store_true", help="print a JSON list per mask")


def _embed_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--text", action="append", required=True, help="a text (repeatable)")
    p.add_argument("--json", action="store_true", help="print a JSON list of lists")


def cmd_eval(args: argparse.Namespace) -> int:
    from lmlab.evaluation.evaluate import evaluate

    if args.lengths is not None or args.set:
        return _eval_lengths(args)
    res = evaluate(
        args.run,
        split=args.split,
        data=args.data,
        stride=args.stride,
        max_tokens=args.max_tokens,
        device=args.device or "auto",
        batch_size=args.batch_size,
        quantize=args.quantize,
    )
    if args.json:
        print(json.dumps(res.as_dict()))
    else:
        for k, v in res.as_dict().items():
            print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    return 0


def _eval_lengths(args: argparse.Namespace) -> int:
    from lmlab.evaluation.lengths import eval_lengths, format_lengths, plot_lengths

    if args.stride is not None:
        raise LmlabError("--stride cannot be combined with --lengths (windows do not overlap)")
    if args.quantize is not None:
        raise LmlabError("--quantize applies to a plain eval, not to --lengths or --set")
    res = eval_lengths(
        args.run,
        args.lengths,  # None (--set alone): the trained context
        args.set,
        split=args.split,
        data=args.data,
        max_tokens=args.max_tokens,
        device=args.device or "auto",
        batch_size=args.batch_size,
    )
    label = " ".join([res.position, *res.overrides])
    plot = plot_lengths(
        {label: [(r.length, r.loss) for r in res.rows]},
        args.plot or "eval_lengths.png",
        res.trained_len,
        title=f"{Path(res.model).name}: loss vs context length",
    )
    if args.json:
        print(json.dumps({**res.as_dict(), "plot": str(plot)}))
    else:
        print(format_lengths(res))
        print(f"plot: {plot}")
    return 0


def cmd_fill_mask(args: argparse.Namespace) -> int:
    from lmlab.encoding.fill_mask import fill_mask

    masks = fill_mask(args.model, args.text, args.top_k, args.device or "auto")
    if args.json:
        print(json.dumps([[vars(f) for f in fills] for fills in masks], ensure_ascii=False))
        return 0
    for i, fills in enumerate(masks):
        if len(masks) > 1:
            print(f"mask {i + 1}:")
        for f in fills:
            print(f"{f.probability:8.4f}  {f.token!r:<16} {f.text}")
    return 0


def cmd_embed(args: argparse.Namespace) -> int:
    from lmlab.encoding.embed import embed

    vectors = embed(args.model, args.text, args.device or "auto").tolist()
    if args.json:
        print(json.dumps(vectors))
        return 0
    for text, v in zip(args.text, vectors, strict=True):
        head = ", ".join(f"{x:.4f}" for x in v[:6])
        norm = sum(x * x for x in v) ** 0.5
        print(f"{text[:40]!r}: dim {len(v)}, norm {norm:.4f}, [{head}, ...]")
    return 0


EVAL = Command(
    help="loss, perplexity and bits per byte of a model on a text",
    description="Score a model: a run folder (latest checkpoint), a Hugging Face folder or a "
    ".gguf file. Text longer than the context is scored in non-overlapping windows unless "
    "--stride is given. Prints name: value lines (loss in nats/token, perplexity = "
    "exp(loss), bits_per_byte). Example: lmlab eval model.gguf --data input.txt "
    "--max-tokens 4096. An encoder-decoder run prints exact_match (greedy output == "
    "target), token_accuracy and loss on its held-out pairs (or on --data PAIRS.tsv/.jsonl), "
    "e.g. lmlab eval runs/seq2seq-reverse. float32 linears of 2^22 multiply-adds or more run "
    "through oneDNN's matmul on the CPU (LMLAB_NO_ONEDNN=1, any value but empty/0/false/no/off: "
    "F.linear, the same product to float32 rounding)",
    arguments=_eval_arguments,
    run=cmd_eval,
    common=("device", "debug", "quantize"),
)


FILL_MASK = Command(
    help="top-k fills of each [MASK] in a text, with probabilities (encoder models)",
    description="Predict the masked tokens of a text with an encoder (BERT-style) model: "
    "any run folder or model folder lmlab.load accepts. The mask may be written [MASK] or "
    "as the tokenizer spells it (e.g. <mask>); several masks are filled independently.",
    arguments=_fill_mask_arguments,
    run=cmd_fill_mask,
)


EMBED = Command(
    help="sentence embeddings of texts (encoder models)",
    description="Embed texts with an encoder model: the pooling and normalisation its "
    "folder declares (sentence-transformers modules.json), else mean pooling over the real "
    "tokens. Prints one line per text, or a JSON list of lists with --json.",
    arguments=_embed_arguments,
    run=cmd_embed,
)
