"""The training loop: :class:`Trainer` takes optimizer steps (:meth:`Trainer.train_step`) and
:meth:`Trainer.fit` drives them, with logging, evaluation, checkpoints and stop signals.

:func:`lmlab.training.trainer.train` resolves a run (:mod:`lmlab.training.resolve`), builds its
data, model and optimizer, and hands them to a Trainer. Units: losses in nats/token, time in
seconds, throughput in tokens/s; ``step`` counts optimizer steps taken.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lmlab.config import save_config
from lmlab.data.dataset import batch_rng
from lmlab.errors import Interrupted, LmlabError
from lmlab.run import CONFIG_FILE
from lmlab.training import checkpoint as ckpt_io
from lmlab.training.allocator import keep_freed_memory
from lmlab.training.checkpoint import has_checkpoint
from lmlab.training.distributed import Parallel
from lmlab.training.evaluate import estimate_loss
from lmlab.training.flops import flops_per_token
from lmlab.training.guard import (
    ForcedStop,
    StopSignals,
    Terminated,
    clip_gradients,
    first_nonfinite_param,
)
from lmlab.training.hardware import autocast, matmul_peak, synchronize
from lmlab.training.metrics import MetricsLogger, plot_losses, truncate_metrics
from lmlab.training.objectives import Objective
from lmlab.training.optim import lr_at, set_lr
from lmlab.training.resolve import PreparedRun, ResolvedRun


def seed_rng(device: torch.device, seed: int) -> None:
    """Seed the generator that a step's random ops (dropout) draw from on ``device``: on a CPU
    the CPU generator alone (``torch.manual_seed`` also queues a seed for every CUDA, XPU and
    MTIA device, some 60 us a call, every step); elsewhere ``torch.manual_seed``."""
    if device.type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)


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
class StepOutcome:
    """What one optimizer step measured: loss (nats/token, the mean over every target of the
    step, all ranks), aux_loss (the MoE auxiliary loss summed over micro-batches, mean over
    ranks; 0 without MoE), grad_norm (before clipping), bad_grad (the first parameter with a
    non-finite gradient), lr (the step's learning rate), finite (the step was applied: loss and
    gradient finite)."""

    loss: float
    aux_loss: float
    grad_norm: float
    bad_grad: str | None
    lr: float
    finite: bool


class Trainer:
    """One training session of a run: the model, optimizer and the run's counters.

    :meth:`train_step` takes one optimizer step; :meth:`fit` is the loop around it (logging,
    evaluation, checkpoints, stop signals, the time budget). Rank-collective where ``par`` is.
    """

    def __init__(
        self,
        par: Parallel,
        run: PreparedRun,
        res: ResolvedRun,
        objective: Objective,
        val_tokens: np.ndarray,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        self.par, self.run_dir, self.resuming = par, run.run_dir, run.resuming
        self.cfg, self.tc, self.dev, self.seq_len = res.cfg, res.cfg.train, res.device, res.seq_len
        self.objective, self.val_tokens = objective, val_tokens
        self.model, self.optimizer = model, optimizer
        self.params = list(model.parameters())  # what clip_gradients reads, listed once
        self.is_main = par.is_main
        self.auto_precision = res.auto_precision
        self.start_step, self.tokens_seen, self.elapsed_before = 0, 0, 0.0

    def resume(self) -> TrainResult | None:
        """Load the latest checkpoint; a TrainResult when the run is already at max_steps."""
        tc, run_dir = self.tc, self.run_dir
        ckpt = ckpt_io.latest_checkpoint(run_dir)
        state = self.par.load_checkpoint(ckpt, self.model, self.optimizer)
        tc.grad_accum_steps = self.par.resume_grad_accum(state, tc.grad_accum_steps)
        self.start_step, self.tokens_seen = int(state["step"]), int(state["tokens"])
        self.elapsed_before = float(state.get("elapsed_s", 0.0))
        if tc.max_steps < self.start_step:
            raise LmlabError(
                f"{run_dir} is already at step {self.start_step}; --max-steps {tc.max_steps} "
                "would not extend it (give a larger number)"
            )
        if tc.max_steps == self.start_step:  # finished: nothing to do, nothing rewritten
            return TrainResult(
                run_dir,
                self.start_step,
                self.tokens_seen,
                state.get("train_loss"),
                state.get("val_loss"),
                0.0,
                None,
                self.elapsed_before,
            )
        if self.is_main:
            truncate_metrics(run_dir, self.start_step)
            save_config(self.cfg, run_dir / CONFIG_FILE)  # records an extended max_steps
        return None

    def _start(self, progress: bool | None) -> None:
        """The forward function, throughput counters, MFU peak, logger and progress bar."""
        tc, par, model = self.tc, self.par, self.model
        if self.dev.type == "cpu":  # the same large tensors every step: keep their pages mapped
            keep_freed_memory()
        self.fwd = torch.compile(par.wrap(model)) if tc.compile else par.wrap(model)
        self.tokens_per_step = (
            self.objective.tokens_per_batch(tc.batch_size) * tc.grad_accum_steps * par.world_size
        )
        self.flops_tok = flops_per_token(model, self.cfg.model, self.seq_len, True, tc.mask_prob)
        # MFU's denominator: a robust, recorded peak (hardware.matmul_peak), never one measured
        # while the cores were busy; NaN (MFU not reported) when there is none, or off rank 0
        self.peak_info = matmul_peak(self.dev, tc.precision) if self.is_main else None
        self.peak = float("nan")
        if self.peak_info is not None and self.peak_info.flops is not None:
            self.peak = self.peak_info.flops * par.world_size
        if self.peak_info is not None and progress is not False:
            source = self.peak_info.source
            if self.auto_precision:  # what train.precision: auto picked, and why
                why = "has" if tc.precision == "bf16" else "has no"
                print(
                    f"precision: auto -> {tc.precision} ({self.dev.type} {why} bf16 units)",
                    file=sys.stderr,
                )
            print(f"MFU denominator (matmul peak): {source}", file=sys.stderr, flush=True)
        if self.is_main and progress is not False and tc.warmup_steps > tc.max_steps:
            print(  # the schedule never reaches train.lr
                f"note: train.warmup_steps {tc.warmup_steps} > max_steps {tc.max_steps}: "
                f"the learning rate ends at {tc.max_steps / tc.warmup_steps:.0%} of "
                f"train.lr, still warming up",
                file=sys.stderr,
                flush=True,
            )
        purge = self.start_step if self.resuming else None
        self.logger = MetricsLogger(self.run_dir, purge_step=purge) if self.is_main else None
        self.bar = _progress_bar(tc.max_steps, self.start_step, progress) if self.is_main else None
        self.progress = progress
        model.train()
        self.t_start = time.perf_counter()
        self.last_ckpt_t = self.t_start
        self.window_t, self.window_tokens = self.t_start, 0
        self.paused = 0.0  # seconds spent in eval/checkpoint inside the current tokens/s window
        self.step = self.start_step
        self.train_loss: float | None = None
        self.val_loss: float | None = None
        self.tok_s = 0.0
        self.mfu: float | None = None
        self.train_seconds = 0.0  # time in training steps this session (no eval, checkpoints)
        self.stopped_early = False
        self.last_saved = self.start_step if self.resuming else -1
        self.evaluated_at = -1  # the step val_loss was last measured at
        self.expert_counts: torch.Tensor | None = None  # (MoE layers, E) routed since last log
        self.skipped = 0  # consecutive steps skipped for a non-finite loss or gradient

    def elapsed(self) -> float:
        """The run's training time so far, seconds (resumed sessions included)."""
        return self.elapsed_before + time.perf_counter() - self.t_start

    def fit(self, time_budget: float | None, progress: bool | None) -> TrainResult:
        """Train from the current step to ``train.max_steps`` (or the time budget, seconds)."""
        self._start(progress)
        tc, par = self.tc, self.par
        stops = StopSignals().install()  # Ctrl-C / SIGTERM: stop at the top of the next step
        try:
            if self.step == 0:
                self.evaluate()
            while self.step < tc.max_steps:
                stops.check()  # a pending Ctrl-C or SIGTERM stops here, between whole steps
                if time_budget is not None and par.any(
                    time.perf_counter() - self.t_start >= time_budget
                ):
                    self.stopped_early = True
                    break
                out = self.train_step(self.step)
                self.step += 1
                self.tokens_seen += self.tokens_per_step
                self.window_tokens += self.tokens_per_step
                self.skipped = 0 if out.finite else self.skipped + 1
                if out.finite:
                    self.train_loss = out.loss
                else:  # the step is skipped (weights unchanged); too many in a row stop the run
                    self.skip_step(out)
                step = self.step
                if out.finite and (step % tc.log_every == 0 or step == tc.max_steps):
                    self.log_step(out)
                self._update_bar()
                if step % tc.eval_every == 0 and step < tc.max_steps:
                    self.evaluate()
                due = tc.checkpoint_every is not None and step % tc.checkpoint_every == 0
                timed = par.any(time.perf_counter() - self.last_ckpt_t >= tc.checkpoint_interval_s)
                if (due or timed) and step < tc.max_steps:  # the last follows the final eval
                    self.checkpoint()
            if self.window_tokens:  # the last, partial tokens/s window
                self.train_seconds += max(time.perf_counter() - self.window_t - self.paused, 1e-9)
            self.evaluate()
            self.checkpoint()
        except (KeyboardInterrupt, Terminated) as stop:
            raise self._stopped(stop) from None
        finally:
            stops.restore()
            if self.bar is not None:
                self.bar.close()
            if self.logger is not None:
                self.logger.close()
        steps_run = self.step - self.start_step
        seconds = self.train_seconds
        tok_s = steps_run * self.tokens_per_step / seconds if seconds > 0 else 0.0
        peak = self.peak
        mfu = min(1.0, self.flops_tok * tok_s / peak) if tok_s and peak == peak else None
        return TrainResult(
            self.run_dir,
            self.step,
            self.tokens_seen,
            self.train_loss,
            self.val_loss,
            tok_s,
            mfu,
            self.elapsed(),
            self.stopped_early,
            steps_run,
        )

    def train_step(self, step: int) -> StepOutcome:
        """Optimizer step ``step`` (0-based): ``grad_accum_steps`` micro-batches forward and
        backward, gradients clipped, the update applied when loss and gradient are finite.
        Runs inside :meth:`fit` (which sets up the forward function and counters)."""
        tc, par, objective, world_size = self.tc, self.par, self.objective, self.par.world_size
        lr = set_lr(self.optimizer, step, tc)
        # Each micro-batch's loss is a mean over its targets; weighting it by its share of the
        # step's targets (all micro-batches, all ranks) makes the step's loss and gradient those
        # of one batch holding them all. When every micro-batch holds as many targets (CLM) this
        # is the plain mean, computed as before: loss / grad_accum_steps.
        accum = tc.grad_accum_steps
        globals_ = [par.micro_index(micro, accum) for micro in range(accum)]
        batches = [
            objective.batch("train", tc.batch_size, batch_rng(tc.seed, step, g)) for g in globals_
        ]
        counts = [objective.n_targets(b) for b in batches]
        n_total, n_squares = par.sum([float(sum(counts)), float(sum(c * c for c in counts))])
        uniform = n_squares * accum * world_size == n_total * n_total  # all counts equal
        loss_sum, aux_sum, weighted_sum = 0.0, 0.0, 0.0
        for micro, (g, batch, n) in enumerate(zip(globals_, batches, counts, strict=True)):
            seed_rng(self.dev, tc.seed * 1_000_003 + step * 1009 + g * 31)
            with par.sync_gradients(micro == accum - 1):
                with autocast(self.dev, tc.precision):
                    output = self.fwd(**{k: v.to(self.dev) for k, v in batch.items()})
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
                ec = self.expert_counts
                self.expert_counts = counts_e if ec is None else ec + counts_e
        loss_sum, aux_sum, weighted_sum = par.mean([loss_sum, aux_sum, weighted_sum])
        # NaN/Inf: names the first
        grad_norm, bad_grad = clip_gradients(self.model, tc.grad_clip, self.params)
        # the mean over every target of the step (over ranks: mean * world_size = sum)
        step_loss = loss_sum / accum if uniform else weighted_sum * world_size / n_total
        # the same on every rank; a norm past float32's range is inf with no gradient to name
        finite = bad_grad is None and math.isfinite(grad_norm) and math.isfinite(step_loss)
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutcome(step_loss, aux_sum, grad_norm, bad_grad, lr, finite)

    def _record(self, **fields: Any) -> None:
        """One metrics.jsonl record at the current step (rank 0)."""
        if self.logger is not None:
            self.logger.log(
                {
                    "step": self.step,
                    "tokens": self.tokens_seen,
                    "elapsed_s": round(self.elapsed(), 3),
                    **fields,
                }
            )

    def log_step(self, out: StepOutcome) -> None:
        """Throughput over the window since the last record, and this step's metrics."""
        tc = self.tc
        synchronize(self.dev)
        now = time.perf_counter()
        window_s = max(now - self.window_t - self.paused, 1e-9)
        self.train_seconds += window_s
        self.tok_s = self.window_tokens / window_s
        self.window_t, self.window_tokens, self.paused = now, 0, 0.0
        moe: dict[str, Any] = {}  # MoE: this step's aux loss, counts since the last log
        peak = self.peak
        self.mfu = min(1.0, self.flops_tok * self.tok_s / peak) if peak == peak else None
        if self.peak_info is not None:  # the session's first record says which peak
            moe["mfu_peak_flops"] = peak if peak == peak else None  # all ranks' FLOP/s
            moe["mfu_peak_source"] = self.peak_info.source
            self.peak_info = None
        if self.expert_counts is not None:
            moe["aux_loss"] = out.aux_loss / tc.grad_accum_steps
            moe["expert_counts"] = self.par.sum_tensor(self.expert_counts).tolist()
            self.expert_counts = None
        self._record(
            lr=out.lr,
            tokens_per_s=round(self.tok_s, 1),
            mfu=self.mfu,
            grad_norm=out.grad_norm,
            clipped=bool(tc.grad_clip > 0 and out.grad_norm > tc.grad_clip),
            train_loss=self.train_loss,
            **moe,
        )

    def _update_bar(self) -> None:
        if self.bar is not None:
            self.bar.update(1)
            loss_text = f"{self.train_loss:.4f}" if self.train_loss is not None else "n/a"
            val_text = f"{self.val_loss:.4f}" if self.val_loss is not None else "n/a"
            tok_s = f"{self.tok_s:,.0f}"
            self.bar.set_postfix(loss=loss_text, val_loss=val_text, tok_s=tok_s, refresh=False)

    def checkpoint(self) -> None:
        """Save the current step (once); refused (LmlabError) when a weight is non-finite."""
        t0 = time.perf_counter()
        step = self.step
        if self.last_saved != step:
            broken = first_nonfinite_param(self.model)  # never checkpoint broken weights
            if broken is not None:
                raise LmlabError(
                    f"the weights hold non-finite values at step {step} (first: {broken}); they "
                    f"were not checkpointed, {_last_checkpoint(self.run_dir)}. Lower train.lr, "
                    "raise train.warmup_steps or check the data"
                )
            state = {
                "step": step,
                "tokens": self.tokens_seen,
                "elapsed_s": self.elapsed(),
                "train_loss": self.train_loss,
                "val_loss": self.val_loss,
                "val_loss_step": self.evaluated_at if self.val_loss is not None else None,
                "world_size": self.par.world_size,
                "grad_accum_steps": self.tc.grad_accum_steps,
            }
            self.par.save_checkpoint(
                self.run_dir,
                step,
                self.model,
                self.optimizer,
                state,
                self.tc.keep_checkpoints,
                self.cfg.model,
            )
        self.last_ckpt_t, self.last_saved = time.perf_counter(), step
        self.paused += self.last_ckpt_t - t0

    def evaluate(self) -> None:
        """Measure (once per step) and log the validation loss."""
        if self.evaluated_at == self.step:
            return
        self.evaluated_at = self.step
        t0 = time.perf_counter()
        self.val_loss = estimate_loss(
            self.model, self.val_tokens, self.cfg, self.dev, self.seq_len, self.par, self.objective
        )
        if self.logger is not None:
            self._record(lr=lr_at(max(self.step - 1, 0), self.tc), val_loss=self.val_loss)
            plot_losses(self.run_dir)
        line = (
            f"step {self.step}/{self.tc.max_steps}  val_loss {self.val_loss:.4f}  "
            f"{self.tok_s:,.0f} tokens/s"
        )
        if self.bar is not None:  # above the bar, which keeps its place below
            self.bar.write(line, file=sys.stderr)
        elif self.is_main and self.progress is not False:
            print(line, file=sys.stderr, flush=True)
        self.paused += time.perf_counter() - t0

    def skip_step(self, out: StepOutcome) -> None:
        """Log a skipped step; past train.max_skipped_steps in a row, checkpoint and stop."""
        tc, step, skipped, bad_grad = self.tc, self.step, self.skipped, out.bad_grad
        what = "loss" if not math.isfinite(out.loss) else "gradient"
        if bad_grad is not None and what == "loss":
            what = "loss and gradient"
        reason = f"non-finite {what} (loss {out.loss})"
        where = f"; first non-finite gradient: {bad_grad}" if bad_grad else ""
        self._record(
            lr=out.lr, skipped=reason, first_nonfinite_grad=bad_grad, consecutive_skips=skipped
        )
        if skipped <= tc.max_skipped_steps:
            if self.is_main:
                print(
                    f"warning: step {step} skipped: {reason}{where} ({skipped} in a row; the run "
                    f"stops after train.max_skipped_steps={tc.max_skipped_steps})",
                    file=sys.stderr,
                )
            return
        broken = first_nonfinite_param(self.model)
        if broken is None:  # weights and optimizer untouched since the last good step
            self.checkpoint()
            saved = (
                f"the last good state is saved as checkpoint {ckpt_io.checkpoint_name(step)} in "
                f"{self.run_dir / 'checkpoints'}"
            )
        else:
            last = _last_checkpoint(self.run_dir)
            saved = f"the weights are non-finite (first: {broken}), {last}"
        raise LmlabError(
            f"training stopped at step {step}: {skipped} steps in a row had a {reason}{where}, "
            f"more than train.max_skipped_steps={tc.max_skipped_steps}; {saved}. Lower "
            "train.lr, raise train.warmup_steps or check the data"
        )

    def _stopped(self, stop: BaseException) -> Interrupted:
        """The Interrupted a Ctrl-C or SIGTERM ends the session with (checkpointed if it can)."""
        run_dir, step = self.run_dir, self.step
        if isinstance(stop, ForcedStop):  # mid-step: this state is not one to checkpoint
            again = (
                f"continue with: lmlab train --resume {run_dir}"
                if has_checkpoint(run_dir)
                else "start it again"
            )
            return Interrupted(
                f"stopped at once during step {step + 1}, without a checkpoint of it; "
                f"{_last_checkpoint(run_dir)}; {again}"
            )
        if self.par.collective_checkpoints:  # peers may be inside a collective: no joint save
            return Interrupted(
                f"interrupted at step {step}; continue from the last checkpoint with: "
                f"lmlab train --resume {run_dir}"
            )
        self.checkpoint()
        term = isinstance(stop, Terminated)
        return Interrupted(
            f"{'terminated (SIGTERM)' if term else 'interrupted'} at step {step}; checkpoint "
            f"saved. Continue with: lmlab train --resume {run_dir}",
            exit_code=143 if term else 130,
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
