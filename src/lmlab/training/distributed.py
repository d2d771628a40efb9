"""Distributed training on PyTorch's own engine: process group, DDP or FSDP2, collectives, launch.

torchrun starts one process per rank and describes the job in the environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). :class:`Parallel` turns that into what
the trainer needs, and is a no-op in a plain single process:

- a process group (``gloo`` on CPU, ``nccl`` on CUDA, chosen from the training device);
- the model replicated with :class:`~torch.nn.parallel.DistributedDataParallel`
  (``train.parallel: ddp``) or sharded with FSDP2 :func:`~torch.distributed.fsdp.fully_shard`
  (``train.parallel: fsdp``: parameters, gradients and AdamW state split across ranks);
- gradient synchronisation only on the last micro-batch of a step (DDP ``no_sync``, FSDP2
  ``set_requires_gradient_sync``);
- the global batch: rank r's micro-batch m of a step is global micro-batch
  ``r * grad_accum_steps + m``, so W ranks x G micro-batches draw exactly the windows one process
  draws with W * G micro-batches (the global batch is ``W * batch_size * G`` sequences);
- scalar all-reduces for the logged loss, agreed stop/checkpoint decisions, and the eval loss;
- checkpoints: every run keeps the single-process safetensors format, portable to any world
  size: rank 0 writes it (FSDP2 shards gathered first, :mod:`lmlab.training.sharded_checkpoint`)
  and every rank reads it whole on resume, keeping its own shards;
- a clean shutdown (wrapped model dropped, garbage collected, barrier, destroy_process_group).

:func:`launch` is ``lmlab train --nproc N``: torchrun (``torch.distributed.run``) on this machine.

``train()`` forms the process group when torchrun's variables are set and destroys it on return;
if a process group already exists, it uses that one and leaves it open. A script that calls
``train()`` more than once in the same torchrun process should form the group itself
(``dist.init_process_group()``): torch resets its group counter when the group is destroyed, so
a second group formed in the same process reuses the first one's rendezvous keys and can hang.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lmlab.config import ModelConfig
from lmlab.errors import LmlabError
from lmlab.training import checkpoint as ckpt_io
from lmlab.training import sharded_checkpoint as sharded_io

PARALLEL_MODES = ("ddp", "fsdp")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


PROCS_PER_CORE = 4  # lmlab train --nproc N: N <= 4 x available_cores() and N <= MAX_NPROC
MAX_NPROC = 256


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, else ``os.cpu_count()``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def threads_per_rank(local_world_size: int) -> int:
    """Intra-op threads for one rank: ``OMP_NUM_THREADS`` when set (torchrun sets 1 unless told
    otherwise; ``lmlab train --nproc N`` sets cores // N), else cores // local ranks (>= 1)."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isascii() and env.isdigit() and int(env) > 0:  # not "²" (isdigit, but int() fails)
        return int(env)
    return max(1, available_cores() // max(1, local_world_size))


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise LmlabError(f"environment variable {name}={value!r} is not an integer") from None


@dataclass
class Parallel:
    """This process's place in a training job. The default is one plain process (rank 0 of 1).

    ``launched``: the process was started by torchrun (or joins a process group its caller made),
    so :meth:`setup` joins a process group even when ``world_size`` is 1.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launched: bool = False
    mode: str = "ddp"  # train.parallel
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _owns_group: bool = False
    _ddp: nn.Module | None = None
    _fsdp: nn.Module | None = None

    @classmethod
    def from_env(cls) -> Parallel:
        """Read the job from an existing process group, else from torchrun's environment.
        Raises LmlabError for a half-set or inconsistent environment."""
        if dist.is_available() and dist.is_initialized():
            local = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)
            return cls(dist.get_rank(), dist.get_world_size(), *local, launched=True)
        present = [v for v in TORCHRUN_VARS if v in os.environ]
        if not present:
            return cls()
        if len(present) != len(TORCHRUN_VARS):
            missing = [v for v in TORCHRUN_VARS if v not in os.environ]
            raise LmlabError(
                f"the environment sets {', '.join(present)} but not {', '.join(missing)}; start "
                "distributed training with torchrun (or lmlab train --nproc N)"
            )
        rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
        if not 0 <= rank < world:
            raise LmlabError(f"RANK={rank} is outside WORLD_SIZE={world}")
        local_rank = _env_int("LOCAL_RANK", 0)
        local_world = _env_int("LOCAL_WORLD_SIZE", world)
        return cls(rank, world, local_rank, local_world, launched=True)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs, plots and writes run files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether a process group is active (collectives are real, not no-ops)."""
        return self.launched and dist.is_available() and dist.is_initialized()

    @property
    def sharded(self) -> bool:
        """``train.parallel: fsdp``: parameters are sharded over the ranks (in a process group)."""
        return self.mode == "fsdp"

    @property
    def collective_checkpoints(self) -> bool:
        """Every rank must take part in writing a checkpoint (sharded and distributed: the
        shards are gathered to rank 0)."""
        return self.sharded and self.distributed

    # ------------------------------------------------------------------ set-up and wrapping
    def setup(self, device: torch.device, mode: str) -> torch.device:
        """Join the process group torchrun described and return this rank's device.

        Backend: nccl for a CUDA device (one GPU per local rank: ``cuda:LOCAL_RANK``), gloo for
        the CPU. On the CPU each rank runs :func:`threads_per_rank` threads. A plain process
        (not launched) keeps ``device`` and creates no group. Raises LmlabError for an unknown
        mode, an unsupported device (mps) or a process group that cannot be formed.
        """
        if mode not in PARALLEL_MODES:
            raise LmlabError(f"train.parallel must be one of {', '.join(PARALLEL_MODES)}: {mode!r}")
        self.mode = mode
        self.device = device
        if not self.launched:
            return device
        if device.type == "cuda":
            if self.local_rank >= torch.cuda.device_count():
                raise LmlabError(
                    f"LOCAL_RANK {self.local_rank} needs GPU {self.local_rank}, but torch sees "
                    f"{torch.cuda.device_count()}; start at most one process per GPU"
                )
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
        elif device.type == "cpu":
            torch.set_num_threads(threads_per_rank(self.local_world_size))
        else:
            raise LmlabError(
                f"distributed training runs on cpu (gloo) or cuda (nccl), not {device.type}; "
                "use --device cpu or cuda"
            )
        self.device = device
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            try:
                if device.type == "cuda":
                    dist.init_process_group(backend, device_id=device)
                else:
                    dist.init_process_group(backend)
            except (ValueError, RuntimeError) as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise LmlabError(f"cannot form the {backend} process group: {first}") from None
            self._owns_group = True
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        return device

    def shard(self, model: nn.Module) -> nn.Module:
        """FSDP2 (``fsdp`` mode, in a process group): shard every block of ``model.layers``, then
        the root (embeddings, final norm and LM head stay one group, so tied weights stay tied).
        In place: the same module object is returned with DTensor parameters. Build the
        optimizer after this. Otherwise ``model`` is returned unchanged."""
        if not (self.sharded and self.distributed):
            return model
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        for block in getattr(model, "layers", ()):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self._fsdp = model
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module to call for training steps: DistributedDataParallel around ``model`` in
        ``ddp`` mode in a process group, else ``model`` itself (FSDP2 shards it in place)."""
        if self.sharded or not self.distributed:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        self._ddp = DistributedDataParallel(model, device_ids=ids)
        return self._ddp

    @contextlib.contextmanager
    def sync_gradients(self, sync: bool) -> Iterator[None]:
        """Run one micro-batch's forward and backward; all-reduce (DDP) or reduce-scatter (FSDP2)
        gradients only when ``sync`` (the last micro-batch of a step). DDP's ``no_sync`` keeps the
        others' gradients local, accumulating in ``.grad``."""
        if self._ddp is not None and not sync:
            with self._ddp.no_sync():  # type: ignore[operator]
                yield
            return
        if self._fsdp is not None:
            self._fsdp.set_requires_gradient_sync(sync)  # type: ignore[operator]
        yield

    def micro_index(self, micro: int, grad_accum_steps: int) -> int:
        """The global micro-batch index of this rank's micro-batch ``micro`` (0-based):
        ``rank * grad_accum_steps + micro``; equals ``micro`` in one process."""
        return self.rank * grad_accum_steps + micro

    # ------------------------------------------------------------------ collectives
    def _reduce(self, values: Sequence[float], op: Any) -> list[float]:
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return [float(v) for v in t.tolist()]

    def mean(self, values: Sequence[float]) -> list[float]:
        """The mean of each value over ranks (float64 all-reduce); ``values`` as-is in one
        process."""
        if not self.distributed:
            return list(values)
        return [v / self.world_size for v in self._reduce(values, dist.ReduceOp.SUM)]

    def sum(self, values: Sequence[float]) -> list[float]:
        """The sum of each value over ranks; ``values`` as-is in one process."""
        return self._reduce(values, dist.ReduceOp.SUM) if self.distributed else list(values)

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over ranks (a copy on this rank's device); ``t`` in one process."""
        if not self.distributed:
            return t
        out = t.detach().to(self.device).clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any rank: decisions that need every rank
        (stop on a time budget, write a timed checkpoint) are taken together."""
        if not self.distributed:
            return flag
        return self._reduce([1.0 if flag else 0.0], dist.ReduceOp.MAX)[0] > 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (it may write shared files, e.g. the token cache); the
        other ranks run it once rank 0 has finished."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self,
        run_dir: Path,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
        keep: int,
        model_cfg: ModelConfig,
    ) -> None:
        """Write the usual safetensors checkpoint, whatever the mode: an FSDP2-sharded model and
        its optimizer state are gathered to rank 0 first (collective,
        :mod:`~lmlab.training.sharded_checkpoint`); otherwise rank 0 writes its full replica.
        Call on every rank. A non-finite number in ``state`` (a val_loss of inf) is written as
        null: trainer_state.json stays strict JSON, which is all lmlab reads."""
        state = {
            k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in state.items()
        }
        if self._fsdp is not None:
            sharded_io.save_sharded_checkpoint(
                run_dir, step, model, optimizer, state, keep, model_cfg
            )
        elif self.is_main:
            ckpt_io.save_checkpoint(run_dir, step, model, optimizer, state, keep)

    def load_checkpoint(
        self, ckpt: Path, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """Load a checkpoint into ``model``/``optimizer`` whatever the world size and mode that
        wrote it: every rank reads the whole files (before DDP wrapping; after FSDP2 sharding,
        keeping its own shards). No communication, nothing unpickled. Returns the trainer
        state. Raises CheckpointError."""
        return ckpt_io.load_checkpoint(ckpt, model, optimizer)

    def resume_grad_accum(self, state: dict[str, Any], grad_accum_steps: int) -> int:
        """Micro-batches per rank that keep a resumed run's global batch: the checkpoint records
        the world size and micro-batches per rank it was written with. Raises LmlabError when
        the recorded global micro-batch count does not divide over this world size."""
        saved_world = int(state.get("world_size", 1))
        total = saved_world * int(state.get("grad_accum_steps", grad_accum_steps))
        if total % self.world_size:
            raise LmlabError(
                f"this run was trained with {total} micro-batches per step ({saved_world} "
                f"process(es)); {self.world_size} processes cannot share them evenly. Resume with "
                f"a number of processes that divides {total}"
            )
        accum = total // self.world_size
        if accum != grad_accum_steps and self.is_main:
            print(
                f"resuming a {saved_world}-process run with {self.world_size}: "
                f"train.grad_accum_steps {grad_accum_steps} -> {accum} keeps its global batch",
                file=sys.stderr,
            )
        return accum

    # ------------------------------------------------------------------ shutdown
    def close(self, ok: bool = True) -> None:
        """Leave the process group this object created: drop the wrapped model, collect
        garbage, wait for every rank (only after success: a failed rank's peers may be stuck in
        a collective), then ``destroy_process_group``. Without the collection and barrier about
        one exit in five aborted with "terminate called without an active exception"."""
        self._ddp = self._fsdp = None
        if not self._owns_group:
            return
        gc.collect()
        if ok and dist.is_initialized():
            with contextlib.suppress(RuntimeError):
                dist.barrier()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False


@contextlib.contextmanager
def session() -> Iterator[Parallel]:
    """A :class:`Parallel` for this process, closed on the way out (barrier only on success)."""
    par = Parallel.from_env()
    ok = False
    try:
        yield par
        ok = True
    finally:
        par.close(ok)


def launch(nproc: int, argv: Sequence[str]) -> int:
    """``lmlab train --nproc N``: run ``python -m lmlab ARGV`` in N processes on this machine
    through torchrun (``torch.distributed.run``, standalone rendezvous on a free local port),
    each with ``cores // N`` threads (``OMP_NUM_THREADS``). Returns the exit code: 0, or the
    failing rank's (each rank prints its own ``error:`` line; a rank ended by a signal is named
    here). Raises LmlabError for N < 1, N over PROCS_PER_CORE x the available cores or over
    MAX_NPROC, or when already inside a torchrun job."""
    if nproc < 1:
        raise LmlabError(f"--nproc must be a positive number of processes, got {nproc}")
    if nproc > (limit := min(MAX_NPROC, PROCS_PER_CORE * (cores := available_cores()))):
        raise LmlabError(
            f"--nproc {nproc} is more than this machine runs: {cores} cores found, "
            f"at most {limit} processes ({PROCS_PER_CORE} per core, {MAX_NPROC} in all)"
        )
    if any(v in os.environ for v in TORCHRUN_VARS):
        raise LmlabError("--nproc starts torchrun itself; drop it when launching with torchrun")
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    os.environ["OMP_NUM_THREADS"] = str(max(1, available_cores() // nproc))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    args = torchrun.parse_args(["--standalone", f"--nproc-per-node={nproc}", "-m", "lmlab", *argv])
    elastic = logging.getLogger("torch.distributed.elastic")
    level = elastic.level
    elastic.setLevel(logging.CRITICAL)  # each rank reports its own error in one line
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        codes = {int(rank): f.exitcode for rank, f in e.failures.items()}
        errors = [code for _, code in sorted(codes.items()) if code > 0]
        if errors:  # those ranks printed their error; the others were stopped by torchrun
            return errors[0]
        for rank, code in sorted(codes.items()):
            name = signal.Signals(-code).name if -code in signal.valid_signals() else -code
            print(f"error: rank {rank} was ended by signal {name}", file=sys.stderr)
        return 1
    finally:
        elastic.setLevel(level)
    return 0
