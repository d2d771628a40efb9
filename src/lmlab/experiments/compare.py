"""``lmlab compare``: train every variant x seed of an experiment, measure each run, report.

Layout of the output folder ``OUT`` (default ``runs/compare/<name>``, ``<name>-smoke`` for
``--smoke``)::

    OUT/comparison.json            name, smoke flag and budget: a re-run must match them
    OUT/<variant>/seed-<s>/        a normal run folder (lmlab eval/generate/train --resume work)
    OUT/<variant>/seed-<s>/summary.json   what was measured after training (see below)
    OUT/report.md, OUT/*.png       the comparison (lmlab.experiments.report)

Runs train in-process, one after another, with :func:`lmlab.training.trainer.train`. Re-running
the same command continues a stopped comparison: a run whose ``summary.json`` is written (and
matches the current eval settings) is skipped; a run that reached its budget but was not measured
is only measured; a run with a checkpoint short of its budget resumes from that checkpoint
(``train --resume``; it retraces the uninterrupted run exactly for step and token budgets); a run
without checkpoint starts afresh. A run whose loss or gradients stay non-finite
(``train.max_skipped_steps``) is recorded as diverged, not retried.

After training each run is measured once: parameters, training tokens/s (from metrics.jsonl, over
every session), KV-cache bytes per token (K and V over all layers, float32 parameters), decode
tokens/s (batch 1, KV cache, greedy, ``decode_tokens`` steps after 4 warm-up steps, on the
training device), with ``eval.passkey`` the retrieval accuracy per distance
(:mod:`lmlab.evaluation.passkey`) and, with ``eval.lengths``, the loss at each context length on
the validation split, also for each ``eval.inference`` variant.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lmlab.errors import CheckpointError, Interrupted, LmlabError
from lmlab.experiments.spec import Budget, Experiment, load_experiment
from lmlab.fsutil import atomic_write_text
from lmlab.safeio import read_json
from lmlab.training import trainer
from lmlab.training.checkpoint import has_checkpoint, latest_checkpoint, read_trainer_state
from lmlab.training.metrics import read_metrics

SUMMARY_FILE = "summary.json"
COMPARISON_FILE = "comparison.json"
RECORD_MAX_BYTES = 1 << 20  # comparison.json and summary.json hold a few hundred bytes
DECODE_WARMUP = 4


@dataclass
class CompareResult:
    """What :func:`compare` did. ``trained``/``measured``/``skipped``: (variant, seed) pairs."""

    out: Path
    report: Path
    plots: list[Path]
    trained: list[tuple[str, int]] = field(default_factory=list)
    measured: list[tuple[str, int]] = field(default_factory=list)
    skipped: list[tuple[str, int]] = field(default_factory=list)
    summaries: list[dict[str, Any]] = field(default_factory=list)


def run_dir(out: Path, variant: str, seed: int) -> Path:
    return out / variant / f"seed-{seed}"


def default_out(exp: Experiment) -> Path:
    return Path("runs") / "compare" / (exp.name + ("-smoke" if exp.is_smoke else ""))


def budget_reached(state: dict[str, Any], max_steps: int, budget: Budget) -> bool:
    """Whether a checkpoint's trainer state has used up the run's budget."""
    if int(state["step"]) >= max_steps:
        return True
    return budget.time_s is not None and float(state.get("elapsed_s", 0.0)) >= budget.time_s


def _check_comparison(out: Path, exp: Experiment) -> None:
    """Write OUT/comparison.json, or check that the one there describes the same comparison."""
    record = {
        "name": exp.name,
        "smoke": exp.is_smoke,
        "budget": {exp.budget.kind: exp.budget.value},
    }
    path = out / COMPARISON_FILE
    if os.path.lexists(path):  # a FIFO, device or loop there is refused by read_json
        old = read_json(path, "comparison record", RECORD_MAX_BYTES)
        if old != record:
            raise LmlabError(
                f"{out} holds another comparison ({path.name}: {json.dumps(old)}; this one: "
                f"{json.dumps(record)}); choose another --out or remove {out}"
            )
        return
    if out.is_dir() and any(out.iterdir()):  # a run folder, or any other: variants would mix in
        raise LmlabError(
            f"--out {out} is not empty and holds no comparison ({COMPARISON_FILE}); choose a new "
            "or empty folder"
        )
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")


def measure_key(exp: Experiment) -> dict[str, Any]:
    """The settings a run's measurements depend on (beyond its weights)."""
    ev = exp.eval
    return {
        "lengths": ev.lengths,
        "max_tokens": ev.max_tokens,
        "batch_size": ev.batch_size,
        "inference": {k: asdict(v) for k, v in ev.inference.items()},
        "decode_tokens": exp.decode_tokens,
        **({"passkey": asdict(ev.passkey)} if ev.passkey is not None else {}),
    }


@torch.no_grad()
def decode_tokens_per_s(model: nn.Module, n_tokens: int, max_seq_len: int) -> float:
    """Greedy decoding speed, tokens/s: batch 1, KV cache, a 1-token prompt, then
    ``n_tokens`` cached steps timed after 4 warm-up steps (fewer if the context is shorter)."""
    dev = next(model.parameters()).device
    n = max(1, min(n_tokens, max_seq_len - 1 - DECODE_WARMUP))
    was_training = model.training
    model.eval()
    cache = model.new_cache()  # type: ignore[operator]
    logits = model(torch.zeros(1, 1, dtype=torch.long, device=dev), cache=cache).logits
    t0 = time.perf_counter()
    for i in range(DECODE_WARMUP + n):
        if i == DECODE_WARMUP:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        nxt = logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
        logits = model(nxt, cache=cache, last_only=True).logits
    if dev.type == "cuda":
        torch.cuda.synchronize()
    model.train(was_training)
    return n / max(time.perf_counter() - t0, 1e-9)


def train_tokens_per_s(records: list[dict[str, Any]]) -> float | None:
    """Average training throughput over a run's logged windows (tokens / seconds of steps, so
    windows of every resumed session count by their length); None if nothing was logged."""
    tokens, seconds, prev = 0.0, 0.0, 0
    for r in records:
        if "tokens_per_s" in r and r["tokens_per_s"]:
            window = max(int(r["tokens"]) - prev, 0)
            tokens += window
            seconds += window / float(r["tokens_per_s"])
        if "tokens" in r and "skipped" not in r:
            prev = int(r["tokens"])
    return tokens / seconds if seconds > 0 else None


def expert_load(records: list[dict[str, Any]]) -> float | None:
    """MoE routing balance at the end of training: max / mean tokens per expert in the last
    logged window, averaged over MoE layers (1.0 = perfectly balanced, n_experts = one expert
    takes everything); None without MoE layers."""
    last = next((r["expert_counts"] for r in reversed(records) if "expert_counts" in r), None)
    if not last:
        return None
    ratios = [max(c) / (sum(c) / len(c)) for c in last if sum(c) > 0]
    return float(np.mean(ratios)) if ratios else None


def _diverged(run: Path, error: LmlabError) -> bool:
    """Whether a training error is the divergence guard (non-finite loss, gradient or weights)."""
    records = read_metrics(run)
    return "non-finite" in str(error) or bool(records and "skipped" in records[-1])


def _val_ids(run: Path, cfg: Any, tokenizer: Any, max_tokens: int | None) -> np.ndarray:
    from lmlab.data.corpus import load_data

    text = load_data(cfg.data).split("val")
    if max_tokens is not None:
        text = text[: max_tokens * 64]  # enough characters for max_tokens tokens
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    return ids[:max_tokens] if max_tokens is not None else ids


def measure_run(
    run: Path, exp: Experiment, variant: str, seed: int, device: str, diverged: str | None
) -> dict[str, Any]:
    """Measure a trained run (see the module docstring) -> the summary.json record."""
    from lmlab.analysis.costs import kv_cache_bytes_per_token
    from lmlab.evaluation.evaluate import token_byte_lengths
    from lmlab.evaluation.lengths import apply_inference_overrides, equal_token_ids, score_lengths
    from lmlab.run import load_run

    summary: dict[str, Any] = {
        "variant": variant,
        "seed": seed,
        "diverged": diverged,
        "measure_key": measure_key(exp),
    }
    records = read_metrics(run)
    summary["val_curve"] = [
        [int(r["step"]), float(r["elapsed_s"]), float(r["val_loss"])]
        for r in records
        if "val_loss" in r
    ]
    summary["tokens_per_s"] = train_tokens_per_s(records)
    summary["expert_load"] = expert_load(records)
    try:
        loaded = load_run(run, device)
    except CheckpointError:  # diverged before its first checkpoint: nothing to measure
        if diverged is None:
            raise
        return summary
    state = read_trainer_state(loaded.checkpoint)
    model, cfg = loaded.model, loaded.config
    dtype_bytes = next(model.parameters()).element_size()
    summary.update(
        step=int(state["step"]),
        tokens=int(state["tokens"]),
        elapsed_s=float(state.get("elapsed_s", 0.0)),
        train_loss=state.get("train_loss"),
        val_loss=state.get("val_loss"),
        params=model.num_params(),  # type: ignore[operator]
        params_non_embedding=model.num_params(non_embedding=True),  # type: ignore[operator]
        kv_cache_bytes_per_token=kv_cache_bytes_per_token(cfg.model, dtype_bytes),
        decode_tokens_per_s=decode_tokens_per_s(model, exp.decode_tokens, cfg.model.max_seq_len),
    )
    if exp.eval.passkey is not None:
        from lmlab.evaluation.passkey import greedy_answerer, passkey_accuracy, prompt_length

        acc = passkey_accuracy(
            greedy_answerer(model, loaded.tokenizer),
            exp.eval.passkey,
            prompt_length(cfg.model.max_seq_len),
            cfg.data.corpus,
        )
        summary["passkey"] = {str(d): a for d, a in acc.items()}
    if exp.eval.lengths:
        ids = equal_token_ids(
            _val_ids(run, cfg, loaded.tokenizer, exp.eval.max_tokens), exp.eval.lengths
        )
        nbytes = token_byte_lengths(loaded.tokenizer)
        rows = score_lengths(model, ids, nbytes, exp.eval.lengths, exp.eval.batch_size)
        summary["lengths"] = {str(r.length): r.loss for r in rows}
        summary["length_notes"] = {str(r.length): r.note for r in rows if r.note}
        summary["inference"] = {}
        for name, inf in exp.eval.inference.items():
            if inf.variant != variant:
                continue
            scaled = apply_inference_overrides(model, inf.overrides)
            rows = score_lengths(scaled, ids, nbytes, exp.eval.lengths, exp.eval.batch_size)
            summary["inference"][name] = {str(r.length): r.loss for r in rows}
    return summary


def _read_summary(run: Path) -> dict[str, Any] | None:
    path = run / SUMMARY_FILE
    if not path.is_file():
        return None
    try:  # bounded: a damaged (or huge) summary is measured again
        data = read_json(path, "run summary", RECORD_MAX_BYTES)
    except LmlabError:
        return None
    return data if isinstance(data, dict) else None


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def compare(
    experiment: str | Path | Experiment,
    out: str | Path | None = None,
    smoke: bool = False,
    device: str | None = None,
    progress: bool | None = False,
    log: Callable[[str], None] = _stderr,
) -> CompareResult:
    """Train every variant x seed of ``experiment`` (a YAML path or a parsed Experiment) into
    ``out``, measure each run, and write ``out/report.md`` with its plots.

    smoke: every variant 2 steps, the first seed, a tiny eval (what CI runs). device: overrides
    ``train.device``. progress: the trainer's progress output. log: receives one line per run.
    Resumable: see the module docstring.

    Raises ConfigError for a bad experiment (naming the field or variant), LmlabError when
    ``out`` holds another comparison or a run's saved config differs from its variant's, and
    Interrupted (with the command to continue) on Ctrl-C or SIGTERM.
    """
    from lmlab.experiments.report import write_report

    exp = experiment if isinstance(experiment, Experiment) else load_experiment(experiment)
    if smoke and not exp.is_smoke:
        exp = exp.smoke()
    out_dir = Path(out) if out is not None else default_out(exp)
    if out_dir.exists() and not out_dir.is_dir():
        raise LmlabError(f"--out {out_dir} is a file; give a folder for the comparison")
    _check_comparison(out_dir, exp)
    dev = device or "auto"
    result = CompareResult(out_dir, out_dir / "report.md", [])
    key = measure_key(exp)
    pairs = [(v, s) for v in exp.variants for s in exp.seeds]
    for i, (variant, seed) in enumerate(pairs, 1):
        run = run_dir(out_dir, variant, seed)
        cfg = exp.config(variant, seed)
        label = f"[{i}/{len(pairs)}] {variant} seed {seed}"
        if has_checkpoint(run):
            _check_run_config(run, cfg, variant, seed, exp)
        summary = _read_summary(run)
        if summary is not None and summary.get("measure_key") == key:
            log(f"{label}: done before, skipped")
            result.skipped.append((variant, seed))
            result.summaries.append(summary)
            continue
        diverged: str | None = summary.get("diverged") if summary else None
        reached = False
        if has_checkpoint(run) and diverged is None:
            state = read_trainer_state(latest_checkpoint(run))
            reached = budget_reached(state, cfg.train.max_steps, exp.budget)
        if not reached and diverged is None:
            diverged = _train_one(cfg, run, exp, device, progress, label, log)
            result.trained.append((variant, seed))
        summary = measure_run(run, exp, variant, seed, dev, diverged)
        atomic_write_text(run / SUMMARY_FILE, json.dumps(summary, indent=1) + "\n")
        result.measured.append((variant, seed))
        result.summaries.append(summary)
        val = summary.get("val_loss")
        note = (
            f"diverged ({diverged})"
            if diverged
            else f"val_loss {val:.4f}"
            if val is not None
            else ""
        )
        log(f"{label}: {note}")
    result.plots = write_report(exp, out_dir, result.summaries)
    log(f"report: {result.report}")
    return result


def _check_run_config(run: Path, cfg: Any, variant: str, seed: int, exp: Experiment) -> None:
    """Refuse a run folder trained from another config than its variant's now (an edited
    experiment file): its results would be reported under the wrong name."""
    from dataclasses import replace

    from lmlab.config import diff_configs
    from lmlab.run import read_run_config

    saved = read_run_config(run)
    t, m = cfg.train, cfg.model
    probe = replace(
        cfg,
        name=saved.name,
        train=replace(
            t,
            lr_decay_steps=t.lr_decay_steps or saved.train.lr_decay_steps,
            seq_len=t.seq_len or saved.train.seq_len,
            max_steps=saved.train.max_steps,
            device=saved.train.device,
        ),
        model=replace(m, vocab_size=m.vocab_size or saved.model.vocab_size),
    )
    changed = diff_configs(saved, probe)
    if changed:
        raise LmlabError(
            f"{variant} seed {seed}: {run} was trained with another config than the experiment "
            f"now gives this variant ({', '.join(changed)} differ); restore the experiment file "
            "or choose another --out"
        )


def _train_one(
    cfg: Any,
    run: Path,
    exp: Experiment,
    device: str | None,
    progress: bool | None,
    label: str,
    log: Callable[[str], None],
) -> str | None:
    """Train (or resume) one run to its budget. Returns the divergence message, or None."""
    time_budget = exp.budget.time_s
    resume = None
    if has_checkpoint(run):
        state = read_trainer_state(latest_checkpoint(run))
        resume = run
        if time_budget is not None:
            time_budget = max(time_budget - float(state.get("elapsed_s", 0.0)), 1e-3)
        log(f"{label}: resuming from step {state['step']}")
    else:
        log(f"{label}: training ({exp.budget.describe()})")
    try:
        trainer.train(
            cfg,
            out=None if resume else run,
            resume=resume,
            max_steps=cfg.train.max_steps,
            time_budget=time_budget,
            device=device,
            progress=progress,
        )
    except Interrupted as e:
        source = str(exp.path) if exp.path else exp.name
        smoke = " --smoke" if exp.is_smoke else ""
        raise Interrupted(
            f"comparison stopped during {label.split('] ', 1)[-1]} ({e}); continue it with: "
            f"lmlab compare {source} --out {run.parent.parent}{smoke}",
            e.exit_code,
        ) from None
    except LmlabError as e:
        if _diverged(run, e):
            return str(e)
        raise LmlabError(f"{label.split('] ', 1)[-1]}: {e}") from None
    return None
