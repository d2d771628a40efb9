"""The training loop: ``train()`` turns a config into a run folder, or continues one.

One optimizer step = ``grad_accum_steps`` micro-batches of ``batch_size`` windows of ``seq_len``
tokens. Batches and dropout are pure functions of (seed, step, micro-batch, rank), so a run resumed
from any checkpoint retraces the uninterrupted run exactly on the same machine and settings. The
loop keeps ``rank``/``world_size`` explicit and writes files only where ``is_main``.

Under torchrun every rank runs ``train()`` unchanged: :mod:`lmlab.training.distributed` forms the
process group and replicates (DDP) or shards (FSDP2) the model. Rank r's micro-batch m is global
micro-batch ``r * grad_accum_steps + m``, so the global batch is world_size x batch_size x
grad_accum_steps sequences, the same windows one process draws with world_size times the
accumulation. The logged loss is the mean over ranks; eval runs on every rank (its batches split
between them, losses all-reduced); logs, plots and run files are written by rank 0.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lmlab.config import RunConfig, diff_configs, save_config
from lmlab.data.corpus import load_corpus
from lmlab.data.dataset import batch_rng, build_token_cache, check_split_length
from lmlab.data.tokenizer import fit_tokenizer
from lmlab.data.tokenizer_config import save_tokenizer
from lmlab.errors import Interrupted, LmlabError
from lmlab.fsutil import write_error
from lmlab.models.build import build_model
from lmlab.run import CONFIG_FILE, load_run_tokenizer, read_run_config
from lmlab.training import checkpoint as ckpt_io
from lmlab.training.checkpoint import has_checkpoint
from lmlab.training.distributed import Parallel, session
from lmlab.training.flops import flops_per_token
from lmlab.training.guard import (
    ForcedStop,
    StopSignals,
    Terminated,
    clip_gradients,
    first_nonfinite_param,
)
from lmlab.training.hardware import autocast, matmul_peak, resolve_device, synchronize
from lmlab.training.init_from import start_from
from lmlab.training.memory import check_training_memory
from lmlab.training.metrics import MetricsLogger, plot_losses, truncate_metrics
from lmlab.training.objectives import (
    CausalLM,
    Objective,
    build_objective,
    prepare_tokenizer,
    set_seq2seq_ids,
)
from lmlab.training.optim import build_optimizer, lr_at
from lmlab.training.run_folder import RunFolder, claim_new_run, claim_resumed_run

# Settings that may differ when a run is resumed (they do not change what is computed).
RESUMABLE_CHANGES = {"train.max_steps", "train.device"}


@dataclass
class TrainResult:
    """What a finished (or stopped) ``train()`` call reports. Losses in nats/token;
    tokens_per_s and mfu are averages over this call's training steps (eval time excluded)."""

    run_dir: Path
    step: int
    tokens: int
    train_loss: float | None
    val_loss: float | None
    tokens_per_s: float
    mfu: float | None
    elapsed_s: float  # the whole run's training time so far, resumed sessions included
    stopped_early: bool = False
    steps_run: int = 0  # optimizer steps taken by this call (tokens_per_s and mfu average them)


@dataclass
class PreparedRun:
    """What :func:`prepare_run` resolved: the config, the claimed (locked) run folder, and
    whether the run continues from a checkpoint."""

    cfg: RunConfig
    folder: RunFolder
    resuming: bool

    @property
    def run_dir(self) -> Path:
        return self.folder.path


def prepare_run(
    cfg: RunConfig | None,
    out: Path | None,
    resume: Path | None,
    max_steps: int | None,
    clean: bool = True,
    overwrite: bool = False,
) -> PreparedRun:
    """Resolve the config and claim the run folder (:mod:`lmlab.training.run_folder`: locked
    by rank 0, ``clean``, until the caller releases ``folder``).

    A folder counts as a run once it holds a checkpoint; a folder lmlab made for a run that
    failed or was stopped before its first checkpoint is started afresh. A folder holding a run
    or files lmlab did not write is refused unless ``overwrite``.
    """
    if resume is not None:
        if out is not None and Path(out).resolve() != Path(resume).resolve():
            raise LmlabError("--out cannot be combined with --resume (a run stays in its folder)")
        if overwrite:
            raise LmlabError("--overwrite starts a new run; it cannot be combined with --resume")
        saved = read_run_config(resume)
        if cfg is not None:
            # Fields a new run fills in (from the tokenizer, max_steps) compare as filled in.
            t, m = cfg.train, cfg.model
            probe = replace(
                cfg,
                train=replace(
                    t,
                    lr_decay_steps=t.lr_decay_steps or saved.train.lr_decay_steps,
                    seq_len=t.seq_len or saved.train.seq_len,
                ),
            )
            s, ss = m.seq2seq, saved.model.seq2seq  # special ids, filled from the tokenizer
            ids = ("pad_token_id", "decoder_start_token_id", "eos_token_id")
            s = replace(
                s,
                **{k: getattr(s, k) if getattr(s, k) is not None else getattr(ss, k) for k in ids},
            )
            probe = replace(
                probe,
                model=replace(m, vocab_size=m.vocab_size or saved.model.vocab_size, seq2seq=s),
            )
            changed = [
                f for f in diff_configs(saved, probe) if f not in RESUMABLE_CHANGES | {"name"}
            ]
            if changed:
                raise LmlabError(
                    f"--resume continues {resume} with its own config; these settings differ from "
                    f"it: {', '.join(changed)}. Only --max-steps (and --device, --time-budget) may "
                    "change on resume; start a new run for anything else"
                )
        folder = claim_resumed_run(Path(resume), clean)  # checked: now lock it
        if max_steps is not None:
            saved.train.max_steps = max_steps
        return PreparedRun(saved, folder, True)
    assert cfg is not None
    run_dir = Path(out) if out is not None else Path("runs") / cfg.name
    folder = claim_new_run(run_dir, overwrite, clean)
    if max_steps is not None:
        cfg.train.max_steps = max_steps
    return PreparedRun(cfg, folder, False)


def _batch_loss(
    model: Callable[..., Any], batch: dict[str, torch.Tensor], dev: torch.device, precision: str
) -> torch.Tensor:
    with autocast(dev, precision):
        return model(**{k: v.to(dev) for k, v in batch.items()}).loss


@torch.no_grad()
def estimate_loss(
    model: nn.Module,
    tokens: np.ndarray,
    cfg: RunConfig,
    dev: torch.device,
    seq_len: int,
    par: Parallel | None = None,
    objective: Objective | None = None,
) -> float:
    """Mean loss (nats/token) over ``train.eval_batches`` random batches of ``objective``'s
    ``val`` split (default: next-token windows of ``tokens``); the same batches at every call
    (a fixed generator), so successive values compare. Collective under ``par``:
    rank r scores batches r, r + W, ...; every rank runs the same number of forward passes (FSDP
    gathers weights in each), the last padded with an uncounted repeat."""
    rank, world = (par.rank, par.world_size) if par is not None else (0, 1)
    n = cfg.train.eval_batches
    if objective is None:
        objective = CausalLM(cfg, None, {"val": tokens}, seq_len)  # type: ignore[arg-type]
    was_training = model.training
    model.eval()
    losses = []
    for i in range(rank, -(-n // world) * world, world):
        rng = batch_rng(cfg.train.seed, 0, min(i, n - 1), stream=1)
        batch = objective.batch("val", cfg.train.batch_size, rng)
        loss = float(_batch_loss(model, batch, dev, cfg.train.precision))
        if i < n:
            losses.append(loss)
    model.train(was_training)
    total = float(np.sum(losses)) if losses else 0.0
    return (par.sum([total])[0] if par is not None else total) / n


def train(
    cfg: RunConfig | None = None,
    out: str | Path | None = None,
    resume: str | Path | None = None,
    max_steps: int | None = None,
    time_budget: float | None = None,
    device: str | None = None,
    progress: bool | None = None,
    init_from: str | Path | None = None,
    overwrite: bool = False,
) -> TrainResult:
    """Train a model and write its run folder (see :mod:`lmlab.run` for the layout).

    cfg: the run config (ignored fields on resume must match the saved one). out: the run folder
    (default ``runs/<cfg.name>``). resume: a run folder to continue from its latest checkpoint.
    max_steps: overrides ``train.max_steps`` (extends a resumed run). time_budget: stop after
    this many seconds of training (checkpoint written). device: overrides ``train.device``.
    progress: show a progress bar (default: when stderr is a terminal). init_from: start a new
    run from this model's weights, config and tokenizer (:mod:`lmlab.training.init_from`).
    overwrite: write a new run into a folder that holds a run or other files, replacing only
    the entries a run folder has (:mod:`lmlab.training.run_folder`).

    Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK set) every rank calls this with the same
    arguments; see :mod:`lmlab.training.distributed`.

    The run folder is locked for the whole call (:mod:`lmlab.runlock`): a second writer gets an
    LmlabError naming this process's pid. Raises LmlabError for bad input: missing/empty/non-UTF-8
    corpus, an occupied run folder, a changed config on resume, a corrupt checkpoint, a run whose
    estimated peak memory exceeds the machine's (:mod:`lmlab.training.memory`), a full disk or
    read-only folder (naming the path and the bytes needed; the last checkpoint stays intact), or
    more than ``train.max_skipped_steps`` consecutive steps with a non-finite loss or gradient
    (the last good state is checkpointed). Ctrl-C and SIGTERM finish the step in progress,
    checkpoint, and raise Interrupted (exit code 130, 143) with the command that resumes; a
    second Ctrl-C stops at once, without checkpoint. A run folder this call created is removed
    again when it fails before its first checkpoint (one process only; under torchrun it stays
    and the next attempt starts it afresh), except when it was stopped by Ctrl-C or SIGTERM:
    then it is kept and the message says so. A folder holding a checkpoint, or one this call did
    not create, is never removed.
    """
    if init_from is not None and resume is not None:
        raise LmlabError("--init-from starts a new run and --resume continues one; give one")
    if time_budget is not None and not time_budget > 0:
        raise LmlabError(f"--time-budget must be a positive number of seconds, got {time_budget}")
    if init_from is not None and cfg is not None:  # --overwrite would delete what it reads
        target = Path(out) if out else Path("runs") / cfg.name
        source = Path(init_from).resolve()
        if source == target.resolve() or target.resolve() in source.parents:
            raise LmlabError(
                f"--out {target} holds the --init-from model {init_from}; choose another --out"
            )
    with session() as par:
        run = prepare_run(
            cfg,
            Path(out) if out else None,
            Path(resume) if resume else None,
            max_steps,
            par.is_main,
            overwrite,
        )
        try:
            return _train(par, run, time_budget, device, progress, init_from)
        except BaseException as e:
            replacement = _after_failure(e, run, par.world_size)
            if replacement is None:
                raise
            raise replacement from None
        finally:
            run.folder.release()


def _after_failure(e: BaseException, run: PreparedRun, world_size: int) -> BaseException | None:
    """Tidy up after a failed run and return the error to raise instead of ``e`` (None: ``e``).

    A folder this call created with no checkpoint is removed (nothing to resume), unless the
    run was stopped by the user (Ctrl-C, SIGTERM): then it is kept and the message says so. A
    full disk or read-only folder becomes one LmlabError naming the path."""
    run_dir = run.run_dir
    kept = has_checkpoint(run_dir)
    stopped = isinstance(e, (KeyboardInterrupt, Interrupted))
    if run.folder.created and world_size == 1 and not kept and not stopped:
        shutil.rmtree(run_dir, ignore_errors=True)  # nothing to resume: leave no trace
    if stopped and not kept and not run.resuming and run.folder.lock is not None:
        said = str(e) if isinstance(e, Interrupted) else "interrupted before the first checkpoint"
        return Interrupted(
            f"{said}; {run_dir} keeps what was written so far (no checkpoint), and the same "
            "lmlab train command starts the run afresh",
            e.exit_code if isinstance(e, Interrupted) else 130,
        )
    if isinstance(e, OSError):
        return write_error(e, run_dir)
    return None


def _train(
    par: Parallel,
    run: PreparedRun,
    time_budget: float | None,
    device: str | None,
    progress: bool | None,
    init_from: str | Path | None = None,
) -> TrainResult:
    world_size, is_main = par.world_size, par.is_main
    cfg, run_dir, resuming = run.cfg, run.run_dir, run.resuming
    if device is not None:
        cfg.train.device = device
    dev = par.setup(resolve_device(cfg.train.device), cfg.train.parallel)
    if cfg.train.precision == "bf16" and dev.type == "mps":
        raise LmlabError("train.precision=bf16 autocast is not supported on mps; use fp32")

    # ---- data and tokenizer
    corpus = load_corpus(cfg.data.corpus, cfg.data.val_fraction)
    init_model: nn.Module | None = None  # --init-from: the loaded model, trained from
    if resuming:
        tokenizer = load_run_tokenizer(run_dir, cfg)
    else:
        if init_from is not None:
            tokenizer, init_model = start_from(init_from, cfg)
        else:
            tokenizer = fit_tokenizer(corpus.splits, cfg.data.tokenizer)
            tokenizer = prepare_tokenizer(cfg, tokenizer)  # + the objective's special tokens
        if cfg.model.vocab_size not in (None, n := tokenizer.vocab_size):  # refused, not replaced
            msg = f"model.vocab_size is {cfg.model.vocab_size} but the tokenizer has {n} tokens"
            raise LmlabError(f"{msg}; remove model.vocab_size (null: the tokenizer's)")
        cfg.model.vocab_size = tokenizer.vocab_size
        set_seq2seq_ids(cfg, tokenizer)  # encoder-decoder: pad / start / eos from the tokenizer
        cfg.train.lr_decay_steps = cfg.train.lr_decay_steps or cfg.train.max_steps
        cfg.train.seq_len = cfg.train.seq_len or cfg.model.max_seq_len
        cfg.validate()
    tc = cfg.train
    seq_len = tc.seq_len or cfg.model.max_seq_len
    check_training_memory(cfg, dev)  # before any weight is allocated
    with par.main_first():
        splits = build_token_cache(corpus, tokenizer, run_dir / "data", resuming)
    objective = build_objective(cfg, tokenizer, splits, seq_len)
    if objective.uses_token_cache:  # seq2seq reads its own pairs
        check_split_length(splits["train"], seq_len, "train")
        check_split_length(splits["val"], seq_len, "val")
    if is_main and not resuming:  # only now is the folder a run (see prepare_run)
        save_tokenizer(tokenizer, run_dir)  # --init-from: + the model's chat template
        save_config(cfg, run_dir / CONFIG_FILE)

    # ---- model and optimizer
    torch.manual_seed(tc.seed)
    model = par.shard((build_model(cfg.model) if init_model is None else init_model).to(dev))
    optimizer = build_optimizer(model, tc)
    start_step, tokens_seen, elapsed_before = 0, 0, 0.0
    if resuming:
        ckpt = ckpt_io.latest_checkpoint(run_dir)
        state = par.load_checkpoint(ckpt, model, optimizer)
        tc.grad_accum_steps = par.resume_grad_accum(state, tc.grad_accum_steps)
        start_step, tokens_seen = int(state["step"]), int(state["tokens"])
        elapsed_before = float(state.get("elapsed_s", 0.0))
        if tc.max_steps < start_step:
            raise LmlabError(
                f"{run_dir} is already at step {start_step}; --max-steps {tc.max_steps} would not "
                "extend it (give a larger number)"
            )
        if tc.max_steps == start_step:  # finished: nothing to do, nothing rewritten
            return TrainResult(
                run_dir,
                start_step,
                tokens_seen,
                state.get("train_loss"),
                state.get("val_loss"),
                0.0,
                None,
                elapsed_before,
            )
        if is_main:
            truncate_metrics(run_dir, start_step)
            save_config(cfg, run_dir / CONFIG_FILE)  # records an extended max_steps
    fwd = torch.compile(par.wrap(model)) if tc.compile else par.wrap(model)
    tokens_per_step = objective.tokens_per_batch(tc.batch_size) * tc.grad_accum_steps * world_size
    flops_tok = flops_per_token(model, cfg.model, seq_len, True, tc.mask_prob)
    # MFU's denominator: a robust, recorded peak (hardware.matmul_peak), never one measured while
    # the cores were busy; NaN (MFU not reported) when there is none, or off the main rank
    peak_info = matmul_peak(dev, tc.precision) if is_main else None
    peak = float("nan")
    if peak_info is not None and peak_info.flops is not None:
        peak = peak_info.flops * world_size
    if peak_info is not None and progress is not False:
        print(f"MFU denominator (matmul peak): {peak_info.source}", file=sys.stderr, flush=True)
    logger = (
        MetricsLogger(run_dir, purge_step=start_step if resuming else None) if is_main else None
    )
    bar = _progress_bar(tc.max_steps, start_step, progress) if is_main else None

    # ---- loop
    model.train()
    t_start = time.perf_counter()
    last_ckpt_t = t_start
    window_t, window_tokens = t_start, 0
    paused = 0.0  # seconds spent in eval/checkpoint inside the current tokens/s window
    step = start_step
    train_loss: float | None = None
    val_loss: float | None = None
    tok_s, mfu = 0.0, None
    train_seconds = 0.0  # time in training steps this session (eval and checkpoints excluded)
    stopped_early = False
    last_saved = start_step if resuming else -1
    evaluated_at = -1  # the step val_loss was last measured at
    expert_counts: torch.Tensor | None = None  # (MoE layers, E) tokens routed since the last log
    skipped = 0  # consecutive steps skipped for a non-finite loss or gradient

    def elapsed() -> float:
        return elapsed_before + time.perf_counter() - t_start

    def checkpoint() -> None:
        nonlocal last_ckpt_t, last_saved, paused
        t0 = time.perf_counter()
        if last_saved != step:
            broken = first_nonfinite_param(model)  # never checkpoint broken weights
            if broken is not None:
                raise LmlabError(
                    f"the weights hold non-finite values at step {step} (first: {broken}); they "
                    f"were not checkpointed, {_last_checkpoint(run_dir)}. Lower train.lr, raise "
                    "train.warmup_steps or check the data"
                )
            state = {
                "step": step,
                "tokens": tokens_seen,
                "elapsed_s": elapsed(),
                "train_loss": train_loss,
                "val_loss": val_loss,
                "val_loss_step": evaluated_at if val_loss is not None else None,
                "world_size": world_size,
                "grad_accum_steps": tc.grad_accum_steps,
            }
            par.save_checkpoint(
                run_dir, step, model, optimizer, state, tc.keep_checkpoints, cfg.model
            )
        last_ckpt_t, last_saved = time.perf_counter(), step
        paused += last_ckpt_t - t0

    def evaluate() -> None:
        nonlocal val_loss, paused, evaluated_at
        if evaluated_at == step:
            return
        evaluated_at = step
        t0 = time.perf_counter()
        val_loss = estimate_loss(model, splits["val"], cfg, dev, seq_len, par, objective)
        if logger is not None:
            logger.log(
                {
                    "step": step,
                    "tokens": tokens_seen,
                    "elapsed_s": round(elapsed(), 3),
                    "lr": lr_at(max(step - 1, 0), tc),
                    "val_loss": val_loss,
                }
            )
            plot_losses(run_dir)
        line = f"step {step}/{tc.max_steps}  val_loss {val_loss:.4f}  {tok_s:,.0f} tokens/s"
        if bar is not None:  # above the bar, which keeps its place below
            bar.write(line, file=sys.stderr)
        elif is_main and progress is not False:
            print(line, file=sys.stderr, flush=True)
        paused += time.perf_counter() - t0

    def skip_step(step_loss: float, bad_grad: str | None) -> None:
        """Log a skipped step; past train.max_skipped_steps in a row, checkpoint and stop."""
        what = "loss" if not math.isfinite(step_loss) else "gradient"
        if bad_grad is not None and what == "loss":
            what = "loss and gradient"
        reason = f"non-finite {what} (loss {step_loss})"
        where = f"; first non-finite gradient: {bad_grad}" if bad_grad else ""
        if logger is not None:
            logger.log(
                {
                    "step": step,
                    "tokens": tokens_seen,
                    "elapsed_s": round(elapsed(), 3),
                    "lr": lr,
                    "skipped": reason,
                    "first_nonfinite_grad": bad_grad,
                    "consecutive_skips": skipped,
                }
            )
        if skipped <= tc.max_skipped_steps:
            if is_main:
                print(
                    f"warning: step {step} skipped: {reason}{where} ({skipped} in a row; the run "
                    f"stops after train.max_skipped_steps={tc.max_skipped_steps})",
                    file=sys.stderr,
                )
            return
        broken = first_nonfinite_param(model)
        if broken is None:  # weights and optimizer untouched since the last good step
            checkpoint()
            saved = (
                f"the last good state is saved as checkpoint {ckpt_io.checkpoint_name(step)} in "
                f"{run_dir / 'checkpoints'}"
            )
        else:
            saved = f"the weights are non-finite (first: {broken}), {_last_checkpoint(run_dir)}"
        raise LmlabError(
            f"training stopped at step {step}: {skipped} steps in a row had a {reason}{where}, "
            f"more than train.max_skipped_steps={tc.max_skipped_steps}; {saved}. Lower "
            "train.lr, raise train.warmup_steps or check the data"
        )

    stops = StopSignals().install()  # Ctrl-C / SIGTERM: stop at the top of the next step
    try:
        if step == 0:
            evaluate()
        while step < tc.max_steps:
            stops.check()  # a pending Ctrl-C or SIGTERM stops here, between whole steps
            if time_budget is not None and par.any(time.perf_counter() - t_start >= time_budget):
                stopped_early = True
                break
            lr = lr_at(step, tc)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # Each micro-batch's loss is a mean over its targets; weighting it by its share of
            # the step's targets (all micro-batches, all ranks) makes the step's loss and
            # gradient those of one batch holding them all. When every micro-batch holds as many
            # targets (CLM) this is the plain mean, computed as before: loss / grad_accum_steps.
            accum = tc.grad_accum_steps
            globals_ = [par.micro_index(micro, accum) for micro in range(accum)]
            batches = [
                objective.batch("train", tc.batch_size, batch_rng(tc.seed, step, g))
                for g in globals_
            ]
            counts = [objective.n_targets(b) for b in batches]
            n_total, n_squares = par.sum([float(sum(counts)), float(sum(c * c for c in counts))])
            uniform = n_squares * accum * world_size == n_total * n_total  # all counts equal
            loss_sum, aux_sum, weighted_sum = 0.0, 0.0, 0.0
            for micro, (g, batch, n) in enumerate(zip(globals_, batches, counts, strict=True)):
                torch.manual_seed(tc.seed * 1_000_003 + step * 1009 + g * 31)
                with par.sync_gradients(micro == accum - 1):
                    with autocast(dev, tc.precision):
                        output = fwd(**{k: v.to(dev) for k, v in batch.items()})
                    loss, aux = output.loss, output.aux_loss  # aux: MoE auxiliary losses or None
                    if uniform:
                        objective_loss = (loss if aux is None else loss + aux) / accum
                    else:  # DDP and FSDP average gradients over ranks: hence * world_size
                        objective_loss = loss * (n * world_size / n_total)
                        if aux is not None:  # a mean over each micro-batch's tokens already
                            objective_loss = objective_loss + aux / accum
                    objective_loss.backward()
                loss_sum += float(loss.detach())
                weighted_sum += float(loss.detach()) * n
                if aux is not None:
                    aux_sum += float(aux.detach())
                    counts_e = torch.stack(output.expert_counts)
                    expert_counts = counts_e if expert_counts is None else expert_counts + counts_e
            loss_sum, aux_sum, weighted_sum = par.mean([loss_sum, aux_sum, weighted_sum])
            grad_norm, bad_grad = clip_gradients(model, tc.grad_clip)  # NaN/Inf: names the first
            # the mean over every target of the step (over ranks: mean * world_size = sum)
            step_loss = loss_sum / accum if uniform else weighted_sum * world_size / n_total
            finite = bad_grad is None and math.isfinite(step_loss)  # the same on every rank
            if finite:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += tokens_per_step
            window_tokens += tokens_per_step
            skipped = 0 if finite else skipped + 1
            if finite:
                train_loss = step_loss
            else:  # the step is skipped (weights unchanged); too many in a row stops the run
                skip_step(step_loss, bad_grad)
            if finite and (step % tc.log_every == 0 or step == tc.max_steps):
                synchronize(dev)
                now = time.perf_counter()
                window_s = max(now - window_t - paused, 1e-9)
                train_seconds += window_s
                tok_s = window_tokens / window_s
                window_t, window_tokens, paused = now, 0, 0.0
                moe: dict[str, Any] = {}  # MoE: this step's aux loss, counts since the last log
                mfu = min(1.0, flops_tok * tok_s / peak) if peak == peak else None
                if peak_info is not None:  # the session's first record says which peak
                    moe["mfu_peak_flops"] = peak if peak == peak else None  # all ranks' FLOP/s
                    moe["mfu_peak_source"] = peak_info.source
                    peak_info = None
                if expert_counts is not None:
                    moe["aux_loss"] = aux_sum / tc.grad_accum_steps
                    moe["expert_counts"] = par.sum_tensor(expert_counts).tolist()
                    expert_counts = None
                if logger is not None:
                    logger.log(
                        {
                            "step": step,
                            "tokens": tokens_seen,
                            "elapsed_s": round(elapsed(), 3),
                            "lr": lr,
                            "tokens_per_s": round(tok_s, 1),
                            "mfu": mfu,
                            "grad_norm": grad_norm,
                            "clipped": bool(tc.grad_clip > 0 and grad_norm > tc.grad_clip),
                            "train_loss": train_loss,
                            **moe,
                        }
                    )
            if bar is not None:
                bar.update(1)
                loss_text = f"{train_loss:.4f}" if train_loss is not None else "n/a"
                val_text = f"{val_loss:.4f}" if val_loss is not None else "n/a"
                bar.set_postfix(
                    loss=loss_text, val_loss=val_text, tok_s=f"{tok_s:,.0f}", refresh=False
                )
            if step % tc.eval_every == 0 and step < tc.max_steps:
                evaluate()
            due = tc.checkpoint_every is not None and step % tc.checkpoint_every == 0
            timed = par.any(time.perf_counter() - last_ckpt_t >= tc.checkpoint_interval_s)
            if (due or timed) and step < tc.max_steps:  # the last one follows the final eval
                checkpoint()
        if window_tokens:  # the last, partial tokens/s window
            train_seconds += max(time.perf_counter() - window_t - paused, 1e-9)
        evaluate()
        checkpoint()
    except (KeyboardInterrupt, Terminated) as stop:
        if isinstance(stop, ForcedStop):  # mid-step: this state is not one to checkpoint
            again = (
                f"continue with: lmlab train --resume {run_dir}"
                if has_checkpoint(run_dir)
                else "start it again"
            )
            raise Interrupted(
                f"stopped at once during step {step + 1}, without a checkpoint of it; "
                f"{_last_checkpoint(run_dir)}; {again}"
            ) from None
        if par.collective_checkpoints:  # peers may be inside a collective: no joint save
            raise Interrupted(
                f"interrupted at step {step}; continue from the last checkpoint with: "
                f"lmlab train --resume {run_dir}"
            ) from None
        checkpoint()
        term = isinstance(stop, Terminated)
        raise Interrupted(
            f"{'terminated (SIGTERM)' if term else 'interrupted'} at step {step}; checkpoint "
            f"saved. Continue with: lmlab train --resume {run_dir}",
            exit_code=143 if term else 130,
        ) from None
    finally:
        stops.restore()
        if bar is not None:
            bar.close()
        if logger is not None:
            logger.close()
    steps_run = step - start_step
    avg_tok_s = steps_run * tokens_per_step / train_seconds if train_seconds > 0 else 0.0
    avg_mfu = min(1.0, flops_tok * avg_tok_s / peak) if avg_tok_s and peak == peak else None
    return TrainResult(
        run_dir,
        step,
        tokens_seen,
        train_loss,
        val_loss,
        avg_tok_s,
        avg_mfu,
        elapsed(),
        stopped_early,
        steps_run,
    )


def _last_checkpoint(run_dir: Path) -> str:
    """'the last good checkpoint is ...' for a message about weights that were not saved."""
    if not has_checkpoint(run_dir):
        return "and the run has no checkpoint yet"
    try:
        return f"the last good checkpoint is {ckpt_io.latest_checkpoint(run_dir)}"
    except LmlabError:
        return f"the last checkpoints are in {run_dir / 'checkpoints'}"


def _progress_bar(total: int, initial: int, progress: bool | None) -> Any:
    show = sys.stderr.isatty() if progress is None else progress
    if not show:
        return None
    from tqdm.auto import tqdm

    kw: dict[str, Any] = {"total": total, "initial": initial, "unit": "step", "file": sys.stderr}
    try:
        size: os.terminal_size | None = os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # not a real terminal: tqdm's own guess
        size = None
    if size is not None and (size.columns < 20 or size.lines < 1):
        # a terminal that reports 0 x 0 (a fresh pty, some CI runners): tqdm would draw
        # nothing, so draw at a fixed size instead
        return tqdm(**kw, ncols=size.columns if size.columns >= 20 else 100, nrows=24)
    return tqdm(**kw, dynamic_ncols=True)
