"""Training: ``train()`` turns a config into a run folder, or continues one.

``train()`` claims the folder and resolves the config (:mod:`lmlab.training.resolve`: the fields
a run fills in, device, precision), builds the data, model and optimizer, and hands them to
:class:`lmlab.training.loop.Trainer`, whose ``fit`` loop drives ``train_step``.

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

import shutil
from pathlib import Path

import torch
from torch import nn

from lmlab.config import RunConfig, save_config
from lmlab.data.corpus import load_data
from lmlab.data.dataset import build_token_cache, check_split_length
from lmlab.data.tokenizer import fit_tokenizer
from lmlab.data.tokenizer_config import save_tokenizer
from lmlab.errors import Interrupted, LmlabError
from lmlab.fsutil import write_error
from lmlab.models.build import build_model
from lmlab.run import CONFIG_FILE, load_run_tokenizer
from lmlab.training.checkpoint import has_checkpoint
from lmlab.training.distributed import Parallel, session
from lmlab.training.evaluate import estimate_loss
from lmlab.training.hardware import resolve_device
from lmlab.training.init_from import start_from
from lmlab.training.loop import StepOutcome, Trainer, TrainResult
from lmlab.training.memory import check_training_memory
from lmlab.training.objectives import build_objective, prepare_tokenizer
from lmlab.training.optim import build_optimizer
from lmlab.training.resolve import (
    RESUMABLE_CHANGES,
    PreparedRun,
    ResolvedRun,
    check_precision,
    prepare_run,
    resolve_run,
)

__all__ = [  # moved to loop, evaluate and resolve; importable from here as before
    "RESUMABLE_CHANGES",
    "PreparedRun",
    "ResolvedRun",
    "StepOutcome",
    "TrainResult",
    "Trainer",
    "estimate_loss",
    "prepare_run",
    "resolve_run",
    "train",
]


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
    """Resolve the run, build its data, model and optimizer, and drive :class:`Trainer`."""
    cfg, run_dir, resuming = run.cfg, run.run_dir, run.resuming
    if device is not None:
        cfg.train.device = device
    dev = par.setup(resolve_device(cfg.train.device), cfg.train.parallel)
    check_precision(cfg, dev)

    # ---- data, tokenizer, and the fields a run fills in from them
    corpus = load_data(cfg.data)
    init_model: nn.Module | None = None  # --init-from: the loaded model, trained from
    if resuming:
        tokenizer = load_run_tokenizer(run_dir, cfg)
    elif init_from is not None:
        tokenizer, init_model = start_from(init_from, cfg)
    else:
        tokenizer = fit_tokenizer(corpus.splits, cfg.data.tokenizer)
        tokenizer = prepare_tokenizer(cfg, tokenizer)  # + the objective's special tokens
    res = resolve_run(cfg, tokenizer, dev, new_run=not resuming)
    cfg, seq_len = res.cfg, res.seq_len
    check_training_memory(cfg, dev)  # before any weight is allocated
    with par.main_first():
        splits = build_token_cache(corpus, tokenizer, run_dir / "data", resuming)
    objective = build_objective(cfg, tokenizer, splits, seq_len)
    if objective.uses_token_cache:  # seq2seq reads its own pairs
        check_split_length(splits["train"], seq_len, "train")
        check_split_length(splits["val"], seq_len, "val")
    if par.is_main and not resuming:  # only now is the folder a run (see prepare_run)
        save_tokenizer(tokenizer, run_dir)  # --init-from: + the model's chat template
        save_config(cfg, run_dir / CONFIG_FILE)

    # ---- model and optimizer
    torch.manual_seed(cfg.train.seed)
    model = par.shard((build_model(cfg.model) if init_model is None else init_model).to(dev))
    optimizer = build_optimizer(model, cfg.train)
    trainer = Trainer(par, run, res, objective, splits["val"], model, optimizer)
    if resuming and (finished := trainer.resume()) is not None:
        return finished
    return trainer.fit(time_budget, progress)
