"""Kill a training run with SIGKILL at N random moments, resume it each time, and check that it
ends exactly where an uninterrupted run of the same config ends.

    python scripts/crash_test.py --n 20            # the closing-note measurement
    python scripts/crash_test.py --n 3 --json      # what CI runs (tests/e2e/test_crash_test.py)

What it does, in a fresh work folder:
1. writes a small corpus (the first 200k characters of tinyshakespeare) and a tiny config with
   dropout on (so the test also covers dropout's randomness), a checkpoint every 3 steps and one
   train_loss record per step;
2. trains the reference run to the end, uninterrupted (one process);
3. trains the same config again in a second folder, and N times: waits until the process has
   logged a random number (1-4) of steps beyond any step logged before, waits a further random
   time (0 to 3 steps' worth, so kills land anywhere: inside a step, an evaluation, a
   checkpoint write), then sends SIGKILL and starts it again with ``lmlab train --resume``
   (or afresh, with the same command line, while no checkpoint exists yet);
4. lets the last resume finish and compares: each resumed process's train_loss records against
   the reference's at the same steps (exact float equality, as written to metrics.jsonl), and the
   final model and optimizer tensors (torch.equal).

The kill plan is drawn from ``random.Random(seed)``; the moments themselves depend on timing.
Every process runs with OMP_NUM_THREADS=--threads (default 1) so both runs compute with the
same thread count: "bit-identical on CPU with the same settings". Exit code 0 when every resume
reproduced the reference and the final tensors are equal, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

CHECKPOINT_EVERY = 3


@dataclass
class Segment:
    """One process of the crash run: how it started, where it ended, what it logged."""

    index: int
    started_from: int | None  # the checkpoint step it resumed from; None: a fresh start
    planned_new_steps: int  # steps beyond any step logged before, then the random delay
    delay_s: float
    exit: str  # "killed", "finished" or "failed (code N)"
    reached_step: int = 0  # the highest step in metrics.jsonl when it ended
    killed_mid_checkpoint: bool = False  # a half-written checkpoint folder was left behind
    checked_steps: int = 0  # train_loss records after started_from compared with the reference
    mismatched_steps: list[int] = field(default_factory=list)

    @property
    def reproduced(self) -> bool:
        return not self.exit.startswith("failed") and not self.mismatched_steps


def _src_dir() -> Path:
    import lmlab

    return Path(lmlab.__file__).resolve().parents[1]


def _env(workdir: Path, threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_src_dir()), env.get("PYTHONPATH", "")) if p
    )
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    env["LMLAB_CACHE_DIR"] = str(workdir / "cache")
    env["MPLBACKEND"] = "Agg"
    return env


def _write_inputs(workdir: Path, steps: int) -> Path:
    from lmlab.data.corpus import BUNDLED, CORPORA_DIR

    text = (CORPORA_DIR / BUNDLED["tinyshakespeare"]).read_text(encoding="utf-8")[:200_000]
    corpus = workdir / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    cfg = {
        "name": "crash",
        "model": {
            "d_model": 32,
            "n_layers": 2,
            "max_seq_len": 32,
            "dropout": 0.1,
            "attention": {"n_heads": 4, "dropout": 0.1},
        },
        "data": {"corpus": str(corpus)},
        "train": {
            "max_steps": steps,
            "batch_size": 4,
            "lr": 3e-3,
            "warmup_steps": 3,
            "eval_every": 10,
            "eval_batches": 2,
            "log_every": 1,
            "checkpoint_every": CHECKPOINT_EVERY,
            "checkpoint_interval_s": 3600.0,
            "keep_checkpoints": 2,
            "precision": "fp32",
            "device": "cpu",
        },
    }
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return path


def _losses(run: Path) -> dict[int, float]:
    from lmlab.training.metrics import read_metrics

    return {int(r["step"]): r["train_loss"] for r in read_metrics(run) if "train_loss" in r}


def _max_step(run: Path) -> int:
    return max(_losses(run), default=0)


def _checkpoint_step(run: Path) -> int | None:
    from lmlab.errors import CheckpointError
    from lmlab.training.checkpoint import has_checkpoint, latest_checkpoint, read_trainer_state

    if not has_checkpoint(run):
        return None
    try:
        return int(read_trainer_state(latest_checkpoint(run))["step"])
    except CheckpointError:
        return None


def _train_cmd(config: Path, run: Path) -> list[str]:
    base = [sys.executable, "-m", "lmlab", "train", "--no-progress"]
    if _checkpoint_step(run) is None:  # nothing to resume: the same command as the first start
        return [*base, "--config", str(config), "--out", str(run)]
    return [*base, "--resume", str(run)]


def _final_tensors_equal(a: Path, b: Path) -> tuple[bool, bool]:
    import torch
    from safetensors.torch import load_file

    from lmlab.training.checkpoint import MODEL_FILE, OPTIMIZER_FILE, latest_checkpoint

    out = []
    for name in (MODEL_FILE, OPTIMIZER_FILE):
        ta = load_file(str(latest_checkpoint(a) / name))
        tb = load_file(str(latest_checkpoint(b) / name))
        out.append(ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta))
    return out[0], out[1]


def run_crash_test(
    n: int = 20,
    seed: int = 0,
    workdir: str | Path | None = None,
    threads: int = 1,
    timeout_s: float = 120.0,
    log: Any = None,
) -> dict[str, Any]:
    """Run the whole test; return the summary (see the module docstring) as a dict."""
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    rng = random.Random(seed)
    plan = [(rng.randint(1, 4), rng.random()) for _ in range(n)]
    steps = sum(k for k, _ in plan) + 3 * n + 10
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="lmlab-crash-"))
    work.mkdir(parents=True, exist_ok=True)
    config = _write_inputs(work, steps)
    env = _env(work, threads)
    ref, crash = work / "reference", work / "crash"
    for d in (ref, crash):
        shutil.rmtree(d, ignore_errors=True)

    t0 = time.perf_counter()
    done = subprocess.run(
        _train_cmd(config, ref), env=env, capture_output=True, text=True, timeout=timeout_s * 5
    )
    if done.returncode != 0:
        raise RuntimeError(f"the reference run failed: {done.stderr.strip()[-2000:]}")
    reference = _losses(ref)
    from lmlab.training.metrics import read_metrics

    elapsed = [r["elapsed_s"] for r in read_metrics(ref) if "train_loss" in r]
    step_s = max((elapsed[-1] - elapsed[0]) / max(len(elapsed) - 1, 1), 1e-3)
    took = time.perf_counter() - t0
    say(f"reference: {steps} steps in {took:.1f} s ({step_s * 1e3:.1f} ms/step)")

    segments: list[Segment] = []
    for i in range(n + 1):
        last = i == n
        new_steps, frac = plan[i] if not last else (0, 0.0)
        delay = frac * CHECKPOINT_EVERY * step_s
        seen = _max_step(crash) if crash.exists() else 0
        seg = Segment(i, _checkpoint_step(crash), new_steps, round(delay, 4), "")
        stderr_path = work / f"segment-{i}.stderr"
        with open(stderr_path, "w") as err:
            proc = subprocess.Popen(
                _train_cmd(config, crash), env=env, stdout=subprocess.DEVNULL, stderr=err
            )
            deadline = time.monotonic() + timeout_s
            killed = False
            while not last and proc.poll() is None and time.monotonic() < deadline:
                if crash.exists() and _max_step(crash) >= seen + new_steps:
                    time.sleep(delay)
                    if proc.poll() is None:
                        os.kill(proc.pid, signal.SIGKILL)
                        killed = True
                    break
                time.sleep(0.005)
            if time.monotonic() >= deadline and proc.poll() is None:
                proc.kill()
            code = proc.wait(timeout=timeout_s)
        if killed:
            seg.exit = "killed"
        elif code == 0:
            seg.exit = "finished"
        else:
            tail = stderr_path.read_text().strip().splitlines()[-1:] or [""]
            seg.exit = f"failed (code {code}): {tail[0][:300]}"
        # save_checkpoint writes into .tmp-step-NNNNNN-<pid> and renames it when complete
        seg.killed_mid_checkpoint = any((crash / "checkpoints").glob(f".tmp-*-{proc.pid}"))
        got = _losses(crash)
        seg.reached_step = max(got, default=0)
        start = seg.started_from or 0
        checked = [s for s in got if s > start]
        seg.checked_steps = len(checked)
        seg.mismatched_steps = [s for s in checked if reference.get(s) != got[s]]
        segments.append(seg)
        origin = f"step {seg.started_from}" if seg.started_from is not None else "a fresh start"
        say(
            f"segment {i}: from {origin}, {seg.exit} at step {seg.reached_step}"
            f"{' (mid-checkpoint)' if seg.killed_mid_checkpoint else ''}, {seg.checked_steps} "
            f"steps checked, {len(seg.mismatched_steps)} differ"
        )
        if seg.exit.startswith("failed") or (seg.exit == "finished" and not last):
            break

    final = _losses(crash)
    finished = bool(segments) and segments[-1].exit == "finished"
    weights_equal, optimizer_equal = (
        _final_tensors_equal(ref, crash) if finished else (False, False)
    )
    resumes = segments[1:]  # segment 0 is the first start; each later one follows a kill
    kills = sum(s.exit == "killed" for s in segments)
    summary = {
        "n": n,
        "seed": seed,
        "steps": steps,
        "threads": threads,
        "kills": kills,
        "kills_mid_checkpoint": sum(s.killed_mid_checkpoint for s in segments),
        "resumes": len(resumes),
        "fresh_restarts": sum(s.started_from is None for s in resumes),
        "resumes_reproduced": sum(s.reproduced for s in resumes),
        "finished": finished,
        "trajectory_equal": finished and final == reference,
        "final_weights_equal": weights_equal,
        "final_optimizer_equal": optimizer_equal,
        "workdir": str(work),
        "segments": [asdict(s) | {"reproduced": s.reproduced} for s in segments],
    }
    summary["ok"] = bool(
        kills == n
        and summary["resumes_reproduced"] == n
        and summary["trajectory_equal"]
        and weights_equal
        and optimizer_equal
    )
    say(
        f"crash test: {summary['resumes_reproduced']}/{n} resumes reproduced the uninterrupted "
        f"trajectory exactly ({kills} SIGKILLs, {summary['kills_mid_checkpoint']} during a "
        f"checkpoint write, {summary['fresh_restarts']} before the first checkpoint); final "
        f"weights {'equal' if weights_equal else 'DIFFER'}, optimizer state "
        f"{'equal' if optimizer_equal else 'DIFFERS'}"
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, default=20, help="SIGKILLs (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill plan")
    p.add_argument("--workdir", help="work folder (default: a new temporary folder)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    args = p.parse_args(argv)
    summary = run_crash_test(args.n, args.seed, args.workdir, args.threads)
    if args.json:
        print(json.dumps(summary, indent=1))
    if not args.keep and not args.workdir:
        shutil.rmtree(summary["workdir"], ignore_errors=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
