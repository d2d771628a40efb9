"""``lmlab train`` and ``lmlab compare``: train a run, or the variants x seeds of an experiment."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from lmlab.cli.common import Command
from lmlab.errors import LmlabError
from lmlab.fsutil import check_out_path


def _train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        help="YAML config (sections model, data, train); default: the "
        "built-in tutorial Mini-GPT (AdamW, tied embeddings); configs/minigpt.yaml is the same "
        "model with the tuned recipe `make run` trains",
    )
    p.add_argument(
        "--data",
        help="train on this UTF-8 text file (last data.val_fraction is "
        "validation) or folder with train.txt/valid.txt/test.txt; same as "
        "--set data.corpus=PATH",
    )
    p.add_argument(
        "--out",
        help="run folder (default: runs/<config name>); must be new, empty, or left by an lmlab "
        "attempt with no checkpoint",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="write the new run into an --out that holds a run or other files: replaces only "
        "what a run folder holds (config.yaml, tokenizer.json, data/, checkpoints/, "
        "metrics.jsonl, tb/, loss.png); other files stay",
    )
    p.add_argument(
        "--max-steps", type=int, help="optimizer steps to train to (extends a resumed run)"
    )
    p.add_argument(
        "--time-budget",
        type=float,
        metavar="SECONDS",
        help="stop (with a checkpoint) after this many seconds of training",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set model.position.kind=rope "
        "--set model.attention.n_heads=8 (repeatable; values are YAML)",
    )
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a run from its latest "
        "checkpoint; only --max-steps, --time-budget and --device may change",
    )
    p.add_argument(
        "--init-from",
        metavar="PATH",
        help="fine-tune: start from this model (run folder, Hugging Face folder, ...) with its "
        "own config and tokenizer; the config's data and train sections apply",
    )
    p.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="train in N processes on this machine through torchrun (DDP; FSDP2 with --set "
        "train.parallel=fsdp), each with cores/N threads; the global batch is N x batch_size x "
        "grad_accum_steps; N is at most 4 x the cores this process may use (and 256)",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: when stderr is a terminal)",
    )


def _compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", metavar="EXPERIMENT.yaml")
    p.add_argument(
        "--out", help="output folder (default: runs/compare/<name>, <name>-smoke with --smoke)"
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="every variant 2 steps, the first seed, a tiny eval: checks the experiment runs",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the trainer's progress bar (default: when stderr is a terminal)",
    )


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


TRAIN = Command(
    help="train a model and write a run folder",
    description="Train a language model. Writes RUN/config.yaml, tokenizer.json, "
    "checkpoints/step-NNNNNN/ (+ latest), metrics.jsonl, tb/ (TensorBoard) and loss.png. "
    "On a CPU the process keeps freed memory mapped between steps (glibc's malloc thresholds: "
    "fewer page faults); LMLAB_NO_MALLOC_TUNING=1 turns that off. Training on a CPU runs "
    "lmlab's C++ kernels (compiled on first use): RoPE, gradient clipping, AdamW's step "
    "(one call for all parameters, torch's vectorized fused AdamW's bits) and, in bf16, "
    "the norms, "
    "the residual add (which in pre-norm blocks also adds an FFN's down-projection bias), "
    "on AVX-512 CPUs the MLP's bias + GELU and SwiGLU's silu(gate) * up, and causal "
    "attention up to 256 tokens (its own fused kernel on "
    "CPUs with AVX512-BF16 and no AMX for head dims that are multiples of 16, GQA included; "
    "elsewhere batched matmuls, or torch's kernel for GQA); LMLAB_NO_CPP_KERNELS=1 runs "
    "torch's ops instead (docs/training.md).",
    arguments=_train_arguments,
    run=cmd_train,
    common=("device", "debug", "plugin"),
)


COMPARE = Command(
    help="train the variants of an experiment over seeds and write a comparison report",
    description="Train every variant x seed of an experiment YAML (a base config, named "
    "variants of dotted overrides, seeds, one budget: steps, tokens or time_s) one after "
    "another into OUT/<variant>/seed-<s>/, measure each run, and write OUT/report.md "
    "(mean +/- std over seeds, perplexity, params, tokens/s, KV-cache bytes, decode "
    "tokens/s, loss per eval length, whether each difference exceeds seed noise) and PNG "
    "plots. Re-running the same command continues a stopped comparison; finished runs are "
    "not re-trained. Example: lmlab compare experiments/attention_heads.yaml",
    arguments=_compare_arguments,
    run=cmd_compare,
)
