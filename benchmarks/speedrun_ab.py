"""Step cost of speedrun preset variants, interleaved in one process (the step-cost column of
benchmarks/README.md's time_to_loss table).

    python benchmarks/speedrun_ab.py --steps 20 --variant "" --variant "train.precision=fp32"
    python benchmarks/speedrun_ab.py --optimizer --steps 40

Each ``--variant`` is a ``;``-separated list of ``--set`` overrides of ``configs/speedrun.yaml``
(the empty string: the preset as it is). Every variant is built as benchmarks/time_to_loss.py
builds the preset (its ``lmlab_session``), warmed up for 3 steps (timed apart: a compiled
variant's compilation shows there), then the variants take one ``Trainer.train_step`` each in
turn, ``--steps`` rounds, so a change in the machine's load falls on all of them alike. Prints
per variant ms/step, us/token, the seconds of one evaluation (``train.eval_batches`` batches) and
the ratios of its step time and of its time per token to the first variant's; then the load
average. ``--nanogpt`` puts nanoGPT's README CPU step first (time_to_loss.py's
reimplementation, batch 12 x 64; no evaluation timed for it), so the ratios are to it.

``--optimizer``: the optimizer step alone on the preset's block matrices (the parameters
``train.optimizer: muon`` gives Muon) with random gradients: torch.optim.Muon (one matrix at a
time) vs lmlab's GroupedMuon (batched by shape) vs fused AdamW on the same matrices, interleaved.
Threads: 1 unless ``--threads``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from time_to_loss import (  # noqa: E402
    NanoConfig,
    NanoGPT,
    _text,
    lmlab_session,
    nanogpt_lr,
    nanogpt_optimizer,
)


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


class NanoStepper:
    """nanoGPT's README CPU recipe step (time_to_loss.py's reimplementation: batch 12 x 64,
    AdamW, clip 1.0), taking steps like a Trainer: ``train_step(it)``."""

    def __init__(self) -> None:
        import numpy as np

        text = _text()
        stoi = {ch: i for i, ch in enumerate(sorted(set(text)))}
        ids = np.array([stoi[c] for c in text], dtype=np.int64)
        self.train_ids = torch.from_numpy(ids[: int(len(text) * 0.9)])
        self.c = NanoConfig(vocab_size=len(stoi))
        torch.manual_seed(1337)
        self.model = NanoGPT(self.c)
        self.opt = nanogpt_optimizer(self.model, 1e-3, 0.1)
        self.bs, self.T = 12, self.c.block_size
        self.tokens_per_step = self.bs * self.T

    def train_step(self, it: int) -> None:
        for g in self.opt.param_groups:
            g["lr"] = nanogpt_lr(it, 1e-3, 1e-4, 100, 2000)
        ix = torch.randint(len(self.train_ids) - self.T, (self.bs,))
        x = torch.stack([self.train_ids[i : i + self.T] for i in ix])
        y = torch.stack([self.train_ids[i + 1 : i + 1 + self.T] for i in ix])
        loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def variants_ab(config: str, variants: list[str], steps: int, nanogpt: bool = False) -> None:
    sets = [[s for s in v.split(";") if s] for v in variants]
    with contextlib.ExitStack() as stack:
        runs: list[Any] = [
            stack.enter_context(lmlab_session(config, [*v, f"train.max_steps={steps + 3}"]))
            for v in sets
        ]
        if nanogpt:  # first: the ratios are to nanoGPT's step
            runs.insert(0, NanoStepper())
            variants = ["nanoGPT README CPU recipe", *variants]
        trainers = [getattr(run, "trainer", run) for run in runs]
        for run, v in zip(trainers, variants, strict=True):
            t0 = time.perf_counter()
            for step in range(3):
                run.train_step(step)
            print(f"warm-up (3 steps) {time.perf_counter() - t0:7.1f} s  [{v}]", flush=True)
        total = [0.0] * len(runs)
        for step in range(3, steps + 3):
            for i, run in enumerate(trainers):
                t0 = time.perf_counter()
                run.train_step(step)
                total[i] += time.perf_counter() - t0
        evals = []
        for run in runs:
            t0 = time.perf_counter()
            if hasattr(run, "evaluate"):
                run.evaluate()
            evals.append(time.perf_counter() - t0)
        per_token = [
            t / trainer.tokens_per_step for t, trainer in zip(total, trainers, strict=True)
        ]
        for v, t, e, pt in zip(variants, total, evals, per_token, strict=True):
            print(
                f"{1000 * t / steps:8.1f} ms/step {1e6 * pt / steps:8.1f} us/token  "
                f"eval {e:5.2f} s  step x{t / total[0]:5.2f}  "
                f"token x{pt / per_token[0]:5.2f}  [{v}]"
            )


def optimizer_ab(config: str, steps: int) -> None:
    from lmlab.training.optim import GroupedMuon, muon_param_names

    with lmlab_session(config, ["train.optimizer=muon"]) as run:
        named = dict(run.model.named_parameters())
        hidden = [named[n] for n in muon_param_names(run.model)]
        shapes = sorted({tuple(p.shape) for p in hidden})
        print(f"{len(hidden)} matrices, shapes {shapes}")
        kw = {"lr": 0.02, "weight_decay": 0.01, "momentum": 0.95, "nesterov": True}

        def copies() -> list[torch.nn.Parameter]:
            return [torch.nn.Parameter(p.detach().clone()) for p in hidden]

        a, b, c = copies(), copies(), copies()
        opts = {
            "torch.optim.Muon": (a, torch.optim.Muon(a, **kw)),
            "GroupedMuon": (b, GroupedMuon(b, **kw)),
            "AdamW (fused)": (c, torch.optim.AdamW(c, lr=1e-3, fused=True)),
        }
        total = dict.fromkeys(opts, 0.0)
        for _ in range(steps):
            for name, (params, opt) in opts.items():
                for p in params:
                    p.grad = torch.randn_like(p)
                t0 = time.perf_counter()
                opt.step()
                total[name] += time.perf_counter() - t0
        first = total["torch.optim.Muon"]
        for name, t in total.items():
            print(f"{1000 * t / steps:8.1f} ms/step  x{t / first:5.2f}  {name}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default="configs/speedrun.yaml")
    ap.add_argument("--variant", action="append", default=[], help="';'-separated --set items")
    ap.add_argument("--steps", type=int, default=20, help="interleaved rounds")
    ap.add_argument("--optimizer", action="store_true", help="the optimizer step alone")
    ap.add_argument(
        "--nanogpt", action="store_true", help="also nanoGPT's README CPU step, first (the anchor)"
    )
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {_load()}")
    if args.optimizer:
        optimizer_ab(args.config, args.steps)
    else:
        variants_ab(args.config, args.variant or [""], args.steps, args.nanogpt)
    print(f"load at the end {_load()}")


if __name__ == "__main__":
    main()
