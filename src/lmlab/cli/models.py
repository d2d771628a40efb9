"""``lmlab verify``, ``inspect``, ``attention``, ``export`` and ``import``: check, measure, look
into and convert models."""

from __future__ import annotations

import argparse
import json

from lmlab.cli.common import Command
from lmlab.errors import LmlabError


def _verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="a config YAML (default: every preset in configs/)")


def _inspect_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="CONFIG_OR_MODEL")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field (repeatable; config files and run folders only)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        metavar="T",
        help="tokens per sequence for the FLOPs' attention term and the training memory "
        "(default: model.max_seq_len)",
    )
    p.add_argument(
        "--batch", type=int, default=1, help="sequences, for the KV cache and training memory"
    )
    p.add_argument(
        "--context", type=int, metavar="TOKENS", help="KV-cache tokens (default: max_seq_len)"
    )
    p.add_argument(
        "--dtype",
        help="KV-cache element type: float32, bfloat16, float16, int8 (default: the parameters')",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _attention_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="run folder, Hugging Face folder or GGUF file")
    p.add_argument("--text", help="the text to run the model on (decoder or encoder models)")
    p.add_argument(
        "--source",
        help="encoder-decoder models: the source; draws the decoder's cross-attention (target "
        "tokens x source tokens) per layer, plus encoder and decoder self-attention",
    )
    p.add_argument(
        "--target", help="with --source: the target to teacher-force (default: greedy output)"
    )
    p.add_argument("--layer", type=int, help="only this layer (default: all)")
    p.add_argument("--head", type=int, help="only this head (default: all)")
    p.add_argument("--out", default="attention", help="folder for the PNGs (default: attention)")
    p.add_argument("--no-plot", action="store_true", help="print the numbers only")
    p.add_argument(
        "--window", metavar="START:END", help="draw only token positions START..END-1 "
        "(PNGs and page; long texts), e.g. 0:64; the numbers cover every token"
    )  # fmt: skip
    p.add_argument(
        "--html", metavar="OUT.html", help="also write one self-contained interactive page "
        "(hover a token to see where each head looks); an existing file is refused"
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="RUN_OR_MODEL", help="a run folder or any loadable model")
    p.add_argument("--format", default="hf", choices=["hf", "gguf"], help="output format "
                   "(default hf; gguf: one llama.cpp file, docs/gguf-export.md)")  # fmt: skip
    p.add_argument("--out", required=True, help="folder to write (must be new or empty); "
                   "for gguf the file to write (must not exist)")  # fmt: skip
    p.add_argument("--quant", choices=["f32", "f16", "q8_0", "q4_0"], help="gguf only: the "
                   "type of the 2-D weights (default f32)")  # fmt: skip
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")


def _import_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", help="the model to import")
    p.add_argument("--out", required=True, help="run folder to write (must be new or empty)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")


def cmd_verify(args: argparse.Namespace) -> int:
    from lmlab.analysis.contract import verify_plugin
    from lmlab.analysis.verify import format_table, verify

    checks = verify_plugin(args.config, args.plugins) if args.plugin else verify(args.config)
    print(format_table(checks))
    failed = [c for c in checks if c.status == "FAIL"]
    print(f"{len(checks) - len(failed)} passed or skipped, {len(failed)} failed")
    return 1 if failed else 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from lmlab.analysis.inspection import format_inspection, inspect_model

    info = inspect_model(args.path, args.set, args.seq_len, args.batch, args.context, args.dtype)
    print(json.dumps(info) if args.json else format_inspection(info))
    return 0


def cmd_attention(args: argparse.Namespace) -> int:
    from lmlab.analysis.attention_maps import attention_report, format_stats
    from lmlab.analysis.patching import tokens_phrase

    report = attention_report(
        args.model,
        args.text,
        layer=args.layer,
        head=args.head,
        out=None if args.no_plot else args.out,
        device=args.device or "auto",
        source=args.source,
        target=args.target,
        html=args.html,
        window=args.window,
    )
    if args.json:
        print(json.dumps(report.as_dict(), ensure_ascii=False))
        return 0
    if report.target_tokens is not None:
        print(f"source, {tokens_phrase(len(report.tokens))}: {' '.join(report.tokens)}")
        print(
            f"target, {tokens_phrase(len(report.target_tokens))}: {' '.join(report.target_tokens)}"
        )
        print("cross-attention (decoder queries x source keys):")
    else:
        print(f"{tokens_phrase(len(report.tokens))}: {' '.join(report.tokens)}")
    print(format_stats(report.heads))
    for f in report.files:
        print(f"wrote {f}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from lmlab.interop.export import export_model

    if args.format == "gguf":
        from lmlab.interop.gguf_export import export_gguf, format_result

        print(format_result(export_gguf(args.model, args.out, args.quant or "f32", args.force)))
        return 0
    if args.quant is not None:
        raise LmlabError("--quant applies to --format gguf only")
    res = export_model(args.model, args.out, format=args.format, force=args.force)
    print(f"wrote {res.out} ({res.hf_class}): {', '.join(res.files)}")
    print(f"check: {res.verify_note}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from lmlab.interop.importer import import_model

    res = import_model(args.path, args.out, force=args.force)
    print(
        f"wrote run {res.out}: {res.params:,} parameters, {res.tokenizer_kind} tokenizer of "
        f"{res.vocab_size} tokens (lmlab eval {res.out}; lmlab train --init-from {res.out})"
    )
    return 0


VERIFY = Command(
    help="prove a model config correct: causality, KV cache, gradients, reference",
    description="Run lmlab's correctness proofs on a model configuration with random "
    "weights: causality, cached decoding == full forward, finite gradients, safetensors "
    "round trip, and equality with the Hugging Face reference model where the config has "
    "an exact counterpart (needs transformers). Prints a table; exits 1 on any failure.",
    arguments=_verify_arguments,
    run=cmd_verify,
    common=("debug", "plugin"),
)


INSPECT = Command(
    help="parameters, FLOPs per token, KV cache and training memory of a model",
    description="Parameters per component (tied weights counted once; MoE total and active), "
    "FLOPs per token (2 N + 4 L T d_attn forward, Kaplan et al. 2020 / PaLM; training = 3 x "
    "forward), KV-cache bytes per token and for BATCH x CONTEXT, and the training-memory "
    "estimate, from the model built on the meta device (no storage allocated), so real sizes "
    "(configs/llama.yaml with the overrides in its header) are inspected on a laptop. Any "
    "other path is loaded (HF folder). Encoders (BERT) and encoder-decoders (T5/BART) "
    "too: their FLOP and KV-cache conventions are in docs/inspect.md.",
    arguments=_inspect_arguments,
    run=cmd_inspect,
    common=("debug", "plugin"),
    epilog="example: lmlab inspect configs/llama.yaml --seq-len 2048 --batch 8 --context "
    "4096 --dtype bf16; lmlab inspect configs/bert-mini.yaml",
)


ATTENTION = Command(
    help="attention heatmaps and per-head entropy, distance and sink share on a text",
    description="Run a model on --text with attention weights (math backend) and write "
    "OUT/layer-LL.png: one grid per layer, one panel per head, tokens on both axes. Prints "
    "per head: entropy (nats; max = uniform over the keys a query sees), mean attended "
    "distance (tokens), share of attention on the first token (sink), mean largest weight, "
    "and flags heads 'blurred' (entropy >= 0.9 x max) or 'collapsed' (largest weight >= 0.9 "
    "on average). Layers and heads count from 0.",
    arguments=_attention_arguments,
    run=cmd_attention,
    epilog='example: lmlab attention runs/minigpt --text "ROMEO: But soft" --layer 0 '
    '--out maps; lmlab attention runs/minigpt --text "ROMEO: But soft" --html maps.html '
    '(an interactive page); lmlab attention runs/seq2seq-reverse --source "abcdefgh" --out maps',
)


EXPORT = Command(
    help="write a model as a Hugging Face folder or a GGUF file (llama.cpp)",
    description="Write config.json, model.safetensors, tokenizer.json (+ tokenizer_config."
    "json, generation_config.json) for the Hugging Face family that computes exactly what "
    "the model does (lmlab list hf_family). When transformers is installed the folder is "
    "loaded back and its logits compared (float32, 1e-5) before it is put in place; a model "
    "with no Hugging Face counterpart is refused, naming the component. --format gguf "
    "writes one llama.cpp file instead (llama or starcoder2 architecture, the tokenizer "
    "inside, --quant f32|f16|q8_0|q4_0; docs/gguf-export.md). Example: lmlab export "
    "runs/minigpt --format hf --out hf/minigpt; lmlab export runs/minigpt --format gguf "
    "--out minigpt.gguf --quant q8_0",
    arguments=_export_arguments,
    run=cmd_export,
    common=("debug",),
)


IMPORT = Command(
    help="store any loadable model as an lmlab run folder",
    description="Store a model lmlab can load (a Hugging Face folder, ...) as a run folder: "
    "config.yaml, tokenizer.json and a step-0 checkpoint, so eval, generate and train "
    "--init-from take it. Example: lmlab import hf/pythia-tiny --out runs/pythia-tiny",
    arguments=_import_arguments,
    run=cmd_import,
    common=("debug",),
)
