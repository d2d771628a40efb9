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
from lmlab.fsutil import check_out_path
from lmlab.plugins import add_plugin_flag, plugins
from lmlab.textsafe import for_terminal, one_line

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
  lmlab train --config configs/seq2seq-reverse.yaml     an encoder-decoder on a reverse task
  lmlab generate runs/seq2seq-reverse --source "abcdefgh" --temperature 0
  lmlab compare experiments/positions.yaml   train variants x seeds, report.md + plots
  lmlab eval runs/minigpt --lengths 128,256,512 --set model.position.scaling.kind=ntk
                                      perplexity per context length (length extrapolation)
  lmlab list                          every component variant a config can name
  lmlab export runs/minigpt --format hf --out hf/minigpt    a Hugging Face folder (checked)
  lmlab import hf/minigpt --out runs/imported               any loadable model as a run
  lmlab train --init-from hf/minigpt --data my.txt          fine-tune a model on your text
  lmlab train --config configs/bert-mini.yaml           a BERT (masked LM) on the same corpus
  lmlab fill-mask runs/bert-mini --text "To be, or not to be, that is the [MASK]."
  lmlab embed MODEL_DIR --text "A man plays a guitar." --text "Someone plays music." --json
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
    t.add_argument(
        "--out",
        help="run folder (default: runs/<config name>); must be new, empty, or left by an lmlab "
        "attempt with no checkpoint",
    )
    t.add_argument(
        "--overwrite",
        action="store_true",
        help="write the new run into an --out that holds a run or other files: replaces only "
        "what a run folder holds (config.yaml, tokenizer.json, data/, checkpoints/, "
        "metrics.jsonl, tb/, loss.png); other files stay",
    )
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
        "--init-from",
        metavar="PATH",
        help="fine-tune: start from this model (run folder, Hugging Face folder, ...) with its "
        "own config and tokenizer; the config's data and train sections apply",
    )
    t.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="train in N processes on this machine through torchrun (DDP; FSDP2 with --set "
        "train.parallel=fsdp), each with cores/N threads; the global batch is N x batch_size x "
        "grad_accum_steps; N is at most 4 x the cores this process may use (and 256)",
    )
    t.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: when stderr is a terminal)",
    )
    _add_common(t)
    add_plugin_flag(t)

    e = sub.add_parser(
        "eval",
        help="loss, perplexity and bits per byte of a model on a text",
        description="Score a model: a run folder (latest checkpoint), a Hugging Face folder or a "
        ".gguf file. Text longer than the context is scored in non-overlapping windows unless "
        "--stride is given. Prints name: value lines (loss in nats/token, perplexity = "
        "exp(loss), bits_per_byte). Example: lmlab eval model.gguf --data input.txt "
        "--max-tokens 4096. An encoder-decoder run prints exact_match (greedy output == "
        "target), token_accuracy and loss on its held-out pairs (or on --data PAIRS.tsv/.jsonl), "
        "e.g. lmlab eval runs/seq2seq-reverse",
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
    e.add_argument(
        "--lengths",
        metavar="L1,L2,...",
        help="length extrapolation: perplexity at each context length (non-overlapping windows "
        "over the same text), printed as a table and plotted, e.g. --lengths 128,256,512,1024; "
        "RUN may then be anything lmlab.load accepts",
    )
    e.add_argument(
        "--plot",
        metavar="FILE",
        help="with --lengths: the PNG to write (default: eval_lengths.png in the current folder)",
    )
    e.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="inference-time override of the model's position scaling, e.g. --set "
        "model.position.scaling.kind=ntk --set model.position.scaling.factor=4 (repeatable; "
        "implies --lengths at the trained context if --lengths is not given)",
    )
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
        "--source",
        action="append",
        help="encoder-decoder (seq2seq) models: the source to transform, e.g. --source "
        '"abcdefgh" --temperature 0 (repeatable: one batch); RUN may be any model lmlab.load '
        "accepts (a T5/BART folder too)",
    )
    g.add_argument(
        "--max-new-tokens", type=int, default=200, help="at most this many new tokens (default 200)"
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="0 = greedy, as is a value too small for float32 such as 1e-45 (default 0.8)",
    )
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
    add_plugin_flag(g)

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
    c.add_argument(
        "--temperature",
        type=float,
        default=0.7,
        help="0 = greedy, as is a value too small for float32 such as 1e-45 (default 0.7)",
    )
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
    add_plugin_flag(v)

    ins = sub.add_parser(
        "inspect",
        help="parameters, FLOPs per token, KV cache and training memory of a model",
        description="Parameters per component (tied weights counted once; MoE total and active), "
        "FLOPs per token (2 N + 4 L T d_attn forward, Kaplan et al. 2020 / PaLM; training = 3 x "
        "forward), KV-cache bytes per token and for BATCH x CONTEXT, and the training-memory "
        "estimate, in closed form: a config file or run folder is not built, so real sizes "
        "(configs/llama.yaml with the overrides in its header) are inspected on a laptop. Any "
        "other path is loaded (HF folder). Encoders (BERT) and encoder-decoders (T5/BART) "
        "too: their FLOP and KV-cache conventions are in docs/inspect.md.",
        epilog="example: lmlab inspect configs/llama.yaml --seq-len 2048 --batch 8 --context "
        "4096 --dtype bf16; lmlab inspect configs/bert-mini.yaml",
    )
    ins.add_argument("path", metavar="CONFIG_OR_MODEL")
    ins.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field (repeatable; config files and run folders only)",
    )
    ins.add_argument(
        "--seq-len",
        type=int,
        metavar="T",
        help="tokens per sequence for the FLOPs' attention term and the training memory "
        "(default: model.max_seq_len)",
    )
    ins.add_argument(
        "--batch", type=int, default=1, help="sequences, for the KV cache and training memory"
    )
    ins.add_argument(
        "--context", type=int, metavar="TOKENS", help="KV-cache tokens (default: max_seq_len)"
    )
    ins.add_argument(
        "--dtype",
        help="KV-cache element type: float32, bfloat16, float16, int8 (default: the parameters')",
    )
    ins.add_argument("--json", action="store_true", help="print one JSON object")
    ins.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")
    add_plugin_flag(ins)

    at = sub.add_parser(
        "attention",
        help="attention heatmaps and per-head entropy, distance and sink share on a text",
        description="Run a model on --text with attention weights (math backend) and write "
        "OUT/layer-LL.png: one grid per layer, one panel per head, tokens on both axes. Prints "
        "per head: entropy (nats; max = uniform over the keys a query sees), mean attended "
        "distance (tokens), share of attention on the first token (sink), mean largest weight, "
        "and flags heads 'blurred' (entropy >= 0.9 x max) or 'collapsed' (largest weight >= 0.9 "
        "on average). Layers and heads count from 0.",
        epilog='example: lmlab attention runs/minigpt --text "ROMEO: But soft" --layer 0 '
        '--out maps; lmlab attention runs/seq2seq-reverse --source "abcdefgh" --out maps',
    )
    at.add_argument("model", metavar="MODEL", help="run folder or Hugging Face folder")
    at.add_argument("--text", help="the text to run the model on (decoder or encoder models)")
    at.add_argument(
        "--source",
        help="encoder-decoder models: the source; draws the decoder's cross-attention (target "
        "tokens x source tokens) per layer, plus encoder and decoder self-attention",
    )
    at.add_argument(
        "--target", help="with --source: the target to teacher-force (default: greedy output)"
    )
    at.add_argument("--layer", type=int, help="only this layer (default: all)")
    at.add_argument("--head", type=int, help="only this head (default: all)")
    at.add_argument("--out", default="attention", help="folder for the PNGs (default: attention)")
    at.add_argument("--no-plot", action="store_true", help="print the numbers only")
    at.add_argument("--json", action="store_true", help="print one JSON object")
    _add_common(at)

    x = sub.add_parser(
        "export",
        help="write a model as a Hugging Face folder transformers loads",
        description="Write config.json, model.safetensors, tokenizer.json (+ tokenizer_config."
        "json, generation_config.json) for the Hugging Face family that computes exactly what "
        "the model does (lmlab list hf_family). When transformers is installed the folder is "
        "loaded back and its logits compared (float32, 1e-5) before it is put in place; a model "
        "with no Hugging Face counterpart is refused, naming the component. Example: lmlab "
        "export runs/minigpt --format hf --out hf/minigpt",
    )
    x.add_argument("model", metavar="RUN_OR_MODEL", help="a run folder or any loadable model")
    x.add_argument("--format", default="hf", choices=["hf"], help="output format (default hf)")
    x.add_argument("--out", required=True, help="folder to write (must be new or empty)")
    x.add_argument("--force", action="store_true", help="replace a non-empty --out")
    x.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")

    im = sub.add_parser(
        "import",
        help="store any loadable model as an lmlab run folder",
        description="Store a model lmlab can load (a Hugging Face folder, ...) as a run folder: "
        "config.yaml, tokenizer.json and a step-0 checkpoint, so eval, generate and train "
        "--init-from take it. Example: lmlab import hf/pythia-tiny --out runs/pythia-tiny",
    )
    im.add_argument("path", metavar="PATH", help="the model to import")
    im.add_argument("--out", required=True, help="run folder to write (must be new or empty)")
    im.add_argument("--force", action="store_true", help="replace a non-empty --out")
    im.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")

    c = sub.add_parser(
        "compare",
        help="train the variants of an experiment over seeds and write a comparison report",
        description="Train every variant x seed of an experiment YAML (a base config, named "
        "variants of dotted overrides, seeds, one budget: steps, tokens or time_s) one after "
        "another into OUT/<variant>/seed-<s>/, measure each run, and write OUT/report.md "
        "(mean +/- std over seeds, perplexity, params, tokens/s, KV-cache bytes, decode "
        "tokens/s, loss per eval length, whether each difference exceeds seed noise) and PNG "
        "plots. Re-running the same command continues a stopped comparison; finished runs are "
        "not re-trained. Example: lmlab compare experiments/attention_heads.yaml",
    )
    c.add_argument("experiment", metavar="EXPERIMENT.yaml")
    c.add_argument(
        "--out", help="output folder (default: runs/compare/<name>, <name>-smoke with --smoke)"
    )
    c.add_argument(
        "--smoke",
        action="store_true",
        help="every variant 2 steps, the first seed, a tiny eval: checks the experiment runs",
    )
    c.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the trainer's progress bar (default: when stderr is a terminal)",
    )
    _add_common(c)

    fm = sub.add_parser(
        "fill-mask",
        help="top-k fills of each [MASK] in a text, with probabilities (encoder models)",
        description="Predict the masked tokens of a text with an encoder (BERT-style) model: "
        "any run folder or model folder lmlab.load accepts. The mask may be written [MASK] or "
        "as the tokenizer spells it (e.g. <mask>); several masks are filled independently.",
    )
    fm.add_argument("model", metavar="MODEL")
    fm.add_argument("--text", required=True, help="text with one or more [MASK] tokens")
    fm.add_argument("--top-k", type=int, default=5, help="fills shown per mask (default 5)")
    fm.add_argument("--json", action="store_true", help="print a JSON list per mask")
    _add_common(fm)

    em = sub.add_parser(
        "embed",
        help="sentence embeddings of texts (encoder models)",
        description="Embed texts with an encoder model: the pooling and normalisation its "
        "folder declares (sentence-transformers modules.json), else mean pooling over the real "
        "tokens. Prints one line per text, or a JSON list of lists with --json.",
    )
    em.add_argument("model", metavar="MODEL")
    em.add_argument("--text", action="append", required=True, help="a text (repeatable)")
    em.add_argument("--json", action="store_true", help="print a JSON list of lists")
    _add_common(em)

    ls = sub.add_parser(
        "list",
        help="list the component variants a config can choose",
        description="Every registered variant, by family, with the config field that selects "
        "it and a one-line description citing its source.",
    )
    ls.add_argument("family", nargs="?", help="only this family (e.g. position, ffn)")
    ls.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    add_plugin_flag(ls)
    return parser


def _version() -> str:
    from lmlab import __version__

    return f"lmlab {__version__}"


def cmd_train(args: argparse.Namespace) -> int:
    from lmlab.config import load_config
    from lmlab.training.trainer import train

    overrides = list(args.set)
    if args.init_from and (args.resume or any(o.startswith("model.") for o in overrides)):
        raise LmlabError(
            "--init-from takes the model (config and weights) from its PATH and starts a new "
            "run: it cannot be combined with --resume or --set model.*"
        )
    if args.data:
        overrides.append(f"data.corpus={json.dumps(args.data)}")
    cfg = None
    if not args.resume:
        cfg = load_config(args.config, overrides)
    elif args.config or overrides:  # checked against the run's own config by train()
        cfg = load_config(args.config or Path(args.resume) / "config.yaml", overrides)
    if not args.resume and args.config:  # the run writes its resolved config over it
        from lmlab.training.run_folder import made_by_lmlab

        name = cfg.name if cfg is not None else ""
        written = Path(args.out or Path("runs") / name) / "config.yaml"
        # A config lmlab itself wrote (a run folder left without a checkpoint, whose hint says to
        # train it again from its own config.yaml) may be replaced by its resolution; a user's not.
        if Path(args.config).resolve() == written.resolve() and not made_by_lmlab(written.parent):
            raise LmlabError(
                f"--config {args.config} is the file the run writes its resolved config to; "
                "copy it out of the run folder or choose another --out"
            )
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
        init_from=args.init_from,
        overwrite=args.overwrite,
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
    if args.source is not None:
        return _generate_seq2seq(args, params)
    if args.chat is not None and args.prompt:
        raise LmlabError("give either --chat or --prompt, not both")
    if args.system is not None and args.chat is None:
        raise LmlabError("--system needs --chat")
    model, tokenizer = _load_with_tokenizer(args.run, args.device)
    max_seq_len = model.cfg.max_seq_len
    if model.cfg.kind != "decoder":
        if model.cfg.kind == "encoder" and model.cfg.mlm_head:
            hint = f"lmlab fill-mask {args.run} --text '... [MASK] ...'"
        elif model.cfg.kind == "encoder":  # no masked-LM head: a sentence-embedding model
            hint = f"lmlab embed {args.run} --text '...'"
        else:
            hint = f"lmlab generate {args.run} --source '...'"
        raise LmlabError(
            f"generate needs a decoder model (--prompt, --chat); {args.run} is model.kind="
            f"{model.cfg.kind}: use {hint}"
        )
    out = for_terminal(sys.stdout)  # a model's control characters are escaped on a terminal
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


def _generate_seq2seq(args: argparse.Namespace, params: typing.Any) -> int:
    from lmlab.generation.seq2seq import generate_from_sources

    if args.prompt or args.chat is not None:
        raise LmlabError(
            "give --source (encoder-decoder models) or --prompt / --chat (decoders), not both"
        )
    model, tokenizer = _load_with_tokenizer(args.run, args.device)
    texts = generate_from_sources(model, tokenizer, args.source, params)
    for_terminal(sys.stdout).write("\n---\n".join(texts) + "\n")
    return 0


def _load_with_tokenizer(path: str, device: str | None) -> tuple[typing.Any, typing.Any]:
    """``lmlab.load(path)``; LmlabError when the model comes without a tokenizer."""
    from lmlab.interop.load import load, no_tokenizer

    model, tokenizer = load(path, device or "auto")
    if tokenizer is None:
        raise no_tokenizer(path, "generated")
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
    if model.cfg.kind != "decoder":  # else: a misleading "no chat template, use --prompt"
        raise LmlabError(
            f"lmlab chat needs a decoder model; {args.run} is model.kind={model.cfg.kind}"
        )
    limit = model.cfg.max_seq_len
    return chat_repl(model, tokenizer, params, min(args.max_context or limit, limit), args.system)


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

    report = attention_report(
        args.model,
        args.text,
        layer=args.layer,
        head=args.head,
        out=None if args.no_plot else args.out,
        device=args.device or "auto",
        source=args.source,
        target=args.target,
    )
    if args.json:
        print(json.dumps(report.as_dict(), ensure_ascii=False))
        return 0
    if report.target_tokens is not None:
        print(f"source, {len(report.tokens)} tokens: {' '.join(report.tokens)}")
        print(f"target, {len(report.target_tokens)} tokens: {' '.join(report.target_tokens)}")
        print("cross-attention (decoder queries x source keys):")
    else:
        print(f"{len(report.tokens)} tokens: {' '.join(report.tokens)}")
    print(format_stats(report.heads))
    for f in report.files:
        print(f"wrote {f}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from lmlab.interop.export import export_model

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


def cmd_compare(args: argparse.Namespace) -> int:
    from lmlab.experiments.compare import compare

    if args.out is not None:
        check_out_path(args.out)
    res = compare(
        args.experiment,
        out=args.out,
        smoke=args.smoke,
        device=args.device,
        progress=args.progress,
    )
    print(res.report.read_text(encoding="utf-8"))
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


COMMANDS = {
    "train": cmd_train,
    "eval": cmd_eval,
    "generate": cmd_generate,
    "chat": cmd_chat,
    "verify": cmd_verify,
    "inspect": cmd_inspect,
    "attention": cmd_attention,
    "compare": cmd_compare,
    "list": cmd_list,
    "export": cmd_export,
    "import": cmd_import,
    "fill-mask": cmd_fill_mask,
    "embed": cmd_embed,
}


TEXT_ARGS = ("prompt", "chat", "system", "text", "stop")  # flags whose value is text to encode


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
                    raise LmlabError(
                        f"--{name} is not UTF-8 text (byte 0x{bad.hex()} at character {e.start}); "
                        "give UTF-8 text"
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
        _check_text_args(args)
        _check_numeric_args(args)
        with plugins(getattr(args, "plugin", None)) as args.plugins:
            return COMMANDS[args.command](args)
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
