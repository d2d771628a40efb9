"""The comparison report: ``report.md`` (a table, a seed-noise verdict per variant) and PNG plots.

Numbers come from each run's ``summary.json`` (:mod:`lmlab.experiments.compare`). Losses are in
nats/token. Over seeds: mean and sample standard deviation (n - 1); perplexity = exp(mean loss).

Seed noise. A variant's difference to the first (reference) variant *exceeds seed noise* when the
two sets of seeds do not overlap (every seed of one is below every seed of the other) and the
difference of the means is more than twice the larger of the two seed standard deviations. When
only the first holds, the difference is reported as suggestive; with one seed nothing is claimed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmlab.experiments.spec import Experiment
from lmlab.fsutil import atomic_write_text

STEP_PLOT = "val_loss_vs_step.png"
TIME_PLOT = "val_loss_vs_time.png"
LENGTH_PLOT = "loss_vs_length.png"


def _finite(values: list[Any]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def _mean_std(values: list[float]) -> tuple[float, float | None]:
    std = float(np.std(values, ddof=1)) if len(values) > 1 else None
    return float(np.mean(values)), std


def seed_noise_verdict(ref: list[float], other: list[float]) -> str:
    """'exceeds seed noise', 'suggestive' or 'within seed noise' (or 'one seed') for two sets of
    per-seed losses, by the rule in the module docstring."""
    if len(ref) < 2 or len(other) < 2:
        return "one seed"
    separated = max(ref) < min(other) or max(other) < min(ref)
    if not separated:
        return "within seed noise"
    gap = abs(float(np.mean(other)) - float(np.mean(ref)))
    larger_std = max(float(np.std(ref, ddof=1)), float(np.std(other, ddof=1)))
    return "exceeds seed noise" if gap > 2 * larger_std else "suggestive"


def _sentence(name: str, ref_name: str, ref: list[float], other: list[float], what: str) -> str:
    if not other:
        return f"`{name}`: no finite {what} (every seed diverged); nothing to compare."
    if not ref:
        return f"`{name}`: the reference `{ref_name}` has no finite {what}; nothing to compare."
    m, r = float(np.mean(other)), float(np.mean(ref))
    verdict = seed_noise_verdict(ref, other)
    spread = (
        f"seeds {min(other):.4f}-{max(other):.4f} vs {min(ref):.4f}-{max(ref):.4f}"
        if len(ref) > 1 and len(other) > 1
        else ""
    )
    text = {
        "exceeds seed noise": "the difference exceeds seed noise",
        "suggestive": "the seeds do not overlap, but the gap is under two seed standard "
        "deviations: suggestive only",
        "within seed noise": "the difference is within seed noise (the seeds overlap)",
        "one seed": "one seed only, so seed noise is unknown",
    }[verdict]
    lower = "lower" if m < r else "higher"
    return (
        f"`{name}` vs `{ref_name}`: {what} {m:.4f} vs {r:.4f} ({m - r:+.4f}, {lower}); {text}"
        + (f" ({spread})." if spread else ".")
    )


Curve = list[tuple[float, float]]  # one run's (x, val loss) points, x in steps or seconds


@dataclass
class CurveSeries:
    """What :func:`plot_curves` draws for one variant. ``lines``: each drawn line's (xs, ys),
    every point a measured one (the mean over seeds at x values every seed has, or, when the
    seeds were measured at different x, as the wall times always are, each seed's own curve);
    ``band``: (x, min, max) over seeds, only over the x range every seed covers (None for one
    seed)."""

    name: str
    n_runs: int
    lines: list[tuple[list[float], list[float]]]
    band: tuple[list[float], list[float], list[float]] | None


def _band(curves: list[Curve]) -> tuple[list[float], list[float], list[float]] | None:
    """Seeds' sorted curves -> (x, min, max) over the x range every seed covers, each seed
    read at the others' x by linear interpolation (the band is an envelope, not data)."""
    lo, hi = max(c[0][0] for c in curves), min(c[-1][0] for c in curves)
    grid = np.array(sorted({x for c in curves for x, _ in c if lo <= x <= hi}))
    if grid.size == 0:
        return None
    ys = np.stack([np.interp(grid, [x for x, _ in c], [y for _, y in c]) for c in curves])
    return grid.tolist(), ys.min(0).tolist(), ys.max(0).tolist()


def curve_series(groups: dict[str, list[dict[str, Any]]], axis: str) -> list[CurveSeries]:
    """The series of val loss against ``axis`` ('step' or 'time') per variant, from each run's
    ``val_curve`` of (step, seconds, val loss) points; non-finite losses are left out."""
    col = 0 if axis == "step" else 1
    out: list[CurveSeries] = []
    for name, runs in groups.items():
        curves = [
            sorted(
                (float(p[col]), float(p[2])) for p in r.get("val_curve", []) if math.isfinite(p[2])
            )
            for r in runs
        ]
        curves = [c for c in curves if c]
        if not curves:
            continue
        xs = [[x for x, _ in c] for c in curves]
        if all(x == xs[0] for x in xs):  # measured at the same x: the mean is exact
            ys = np.array([[y for _, y in c] for c in curves])
            lines = [(xs[0], ys.mean(0).tolist())]
            band = (xs[0], ys.min(0).tolist(), ys.max(0).tolist()) if len(curves) > 1 else None
        else:  # each seed's real points; the band only where every seed has data
            lines = [([x for x, _ in c], [y for _, y in c]) for c in curves]
            band = _band(curves)
        out.append(CurveSeries(name, len(runs), lines, band))
    return out


def plot_curves(
    groups: dict[str, list[dict[str, Any]]],
    out: Path,
    axis: str,
    title: str,
    ylabel: str = "val loss (nats/token)",
) -> tuple[Path, list[CurveSeries]]:
    """Val loss against ``axis`` ('step' or 'time'), per variant: the mean over seeds where the
    seeds share their x values (steps), else each seed's own measured curve (wall time), with a
    min/max band over seeds where every seed has data (:func:`curve_series`). Writes ``out``
    (PNG); returns it and the series drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    starts = []
    series = curve_series(groups, axis)
    for s in series:
        color = None
        for i, (xs, ys) in enumerate(s.lines):
            label = f"{s.name} (n={s.n_runs})" if i == 0 else None
            width = 1.5 if len(s.lines) == 1 else 1.0
            (line,) = ax.plot(xs, ys, "-", marker="o", ms=2.5, lw=width, color=color, label=label)
            color = line.get_color()
            starts.append(ys[0])
        if s.band is not None:
            ax.fill_between(s.band[0], s.band[1], s.band[2], color=color, alpha=0.2)
    if starts:  # keep a blown-up variant from flattening the others
        ymin = ax.get_ylim()[0]
        ax.set_ylim(ymin, max(starts) * 1.05)
    ax.set_xlabel("optimizer step" if axis == "step" else "training time (s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out, series


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "n/a" if value is None or not math.isfinite(value) else format(value, spec)


def _mean_of(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = _finite([r.get(key) for r in runs])
    return float(np.mean(vals)) if vals else None


def _loss_cell(vals: list[float], n_runs: int, n_diverged: int) -> str:
    if not vals:
        return f"diverged ({n_diverged}/{n_runs} seeds)" if n_diverged else "n/a"
    mean, std = _mean_std(vals)
    cell = f"{mean:.4f} ± {std:.4f}" if std is not None else f"{mean:.4f}"
    if n_diverged:
        cell += f" (diverged {n_diverged}/{n_runs})"
    return cell


def _length_losses(runs: list[dict[str, Any]], length: int, inference: str | None) -> list[Any]:
    out = []
    for r in runs:
        table = (r.get("inference") or {}).get(inference, {}) if inference else r.get("lengths")
        out.append((table or {}).get(str(length)))
    return out


def loss_scope(exp: Experiment) -> tuple[str, str]:
    """(table header, definition) of the val loss column: the cross-entropy over every target,
    or with ``data.loss_on: answers`` (:mod:`lmlab.data.answers`) over the answer tokens only;
    variants that differ are named."""
    on = {v: exp.config(v, exp.seeds[0]).data for v in exp.variants}
    answers = [v for v, d in on.items() if d.loss_on == "answers"]
    windows = "train.eval_batches fixed random windows of the val split"
    if not answers:
        return "val loss (nats/token)", f"mean cross-entropy over every token of {windows}"
    what = (
        "mean cross-entropy over the answer tokens only of "
        f"{windows} (data.loss_on: answers; every other target is ignored, so this is not "
        "comparable to an all-token loss; chance for a uniform digit: ln 10 = 2.303)"
    )
    ranges = sorted({(d.passkey_min_distance, d.passkey_max_distance) for d in on.values()})
    if ranges != [(None, None)]:
        from lmlab.data.passkey import distance_range

        spans = ", ".join(f"{lo}-{hi}" for lo, hi in sorted({distance_range(*r) for r in ranges}))
        what += f"; training and val key distances uniform in {spans} characters"
    if len(answers) == len(on):
        return "val answer loss (nats/answer token)", what
    return "val loss (nats/token)", (
        f"mean cross-entropy over every token of {windows}, except for "
        f"{', '.join(f'`{v}`' for v in answers)}: {what}"
    )


def write_report(exp: Experiment, out: Path, summaries: list[dict[str, Any]]) -> list[Path]:
    """Write ``out/report.md`` and the plots; return the plot paths."""
    groups: dict[str, list[dict[str, Any]]] = {v: [] for v in exp.variants}
    for s in summaries:
        groups.setdefault(s["variant"], []).append(s)
    loss_head, loss_what = loss_scope(exp)
    plots = [
        plot_curves(groups, out / STEP_PLOT, "step", f"{exp.name}: val loss vs step", loss_head)[0],
        plot_curves(
            groups, out / TIME_PLOT, "time", f"{exp.name}: val loss vs training time", loss_head
        )[0],
    ]
    lengths = exp.eval.lengths
    rows: list[tuple[str, str | None, list[dict[str, Any]]]] = [
        (v, None, runs) for v, runs in groups.items()
    ]
    rows += [(name, name, groups[inf.variant]) for name, inf in exp.eval.inference.items()]
    if lengths:
        from lmlab.evaluation.lengths import plot_lengths

        curves, bands = {}, {}
        for name, inference, runs in rows:
            points, low, high = [], [], []
            for n in lengths:
                vals = _finite(_length_losses(runs, n, inference))
                ok = vals and len(vals) == len(runs)
                points.append((n, float(np.mean(vals)) if ok else None))
                low.append(min(vals) if ok else math.nan)
                high.append(max(vals) if ok else math.nan)
            curves[name], bands[name] = points, (low, high)
        trained = exp.config(next(iter(exp.variants)), exp.seeds[0]).model.max_seq_len
        plots.append(
            plot_lengths(
                curves, out / LENGTH_PLOT, trained, f"{exp.name}: loss vs context length", bands
            )
        )

    if exp.eval.passkey is not None:
        from lmlab.evaluation.passkey import PLOT, plot_passkey, window_reach

        acc = {v: [r.get("passkey") or {} for r in runs] for v, runs in groups.items()}
        reach = window_reach([exp.config(v, exp.seeds[0]).model for v in exp.variants])
        title = f"{exp.name}: passkey accuracy vs distance"
        plots.append(plot_passkey(acc, out / PLOT, title, reach))

    ref_name = next(iter(exp.variants))
    head = ["variant", loss_head, "perplexity", "params", "train tokens/s"]
    head += ["KV cache bytes/token", "decode tokens/s", "steps"]
    moe = any(r.get("expert_load") is not None for r in summaries)
    head += ["expert load max/mean"] if moe else []
    head += [f"loss @{n}" for n in lengths]
    pk = exp.eval.passkey
    head += [f"passkey acc @{d}" for d in pk.distances] if pk is not None else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, inference, runs in rows:
        vals = _finite([r.get("val_loss") for r in runs if not r.get("diverged")])
        n_div = sum(1 for r in runs if r.get("diverged"))
        params = runs[0].get("params") if runs else None
        kv = runs[0].get("kv_cache_bytes_per_token") if runs else None
        steps = sorted({int(r["step"]) for r in runs if r.get("step") is not None})
        if inference is None:
            cells = [
                f"`{name}`",
                _loss_cell(vals, len(runs), n_div),
                _fmt(math.exp(float(np.mean(vals))) if vals else None, ".2f"),
                f"{params:,}" if params else "n/a",
                _fmt(_mean_of(runs, "tokens_per_s"), ",.0f"),
                f"{kv:,}" if kv else "n/a",
                _fmt(_mean_of(runs, "decode_tokens_per_s"), ",.0f"),
                "-".join(str(s) for s in (steps[:1] + steps[-1:] if len(steps) > 1 else steps))
                or "n/a",
            ]
            if moe:
                cells.append(_fmt(_mean_of(runs, "expert_load"), ".2f"))
        else:
            base = exp.eval.inference[name].variant
            cells = [f"`{name}` (`{base}` at inference)"] + [""] * (len(head) - 1 - len(lengths))
        for n in lengths:
            lv = _length_losses(runs, n, inference)
            finite = _finite(lv)
            if finite and len(finite) == len(lv):
                mean, std = _mean_std(finite)
                cells.append(f"{mean:.4f}" + (f" ± {std:.4f}" if std is not None else ""))
            else:
                cells.append("n/a")
        if pk is not None:
            from lmlab.evaluation.passkey import accuracy_cells

            cells += (
                accuracy_cells(runs, pk.distances)
                if inference is None
                else [""] * len(pk.distances)
            )
        lines.append("| " + " | ".join(cells) + " |")

    ref_vals = _finite([r.get("val_loss") for r in groups[ref_name] if not r.get("diverged")])
    verdicts = []
    for name, runs in list(groups.items())[1:]:
        vals = _finite([r.get("val_loss") for r in runs if not r.get("diverged")])
        verdicts.append("- " + _sentence(name, ref_name, ref_vals, vals, "val loss"))
    if lengths:
        longest = max(lengths)
        ref_l = _finite(_length_losses(groups[ref_name], longest, None))
        for name, inference, runs in rows[1:]:
            vals = _finite(_length_losses(runs, longest, inference))
            if vals:
                verdicts.append("- " + _sentence(name, ref_name, ref_l, vals, f"loss @{longest}"))
    notes = sorted(
        {note for r in summaries for note in (r.get("length_notes") or {}).values() if note}
    )
    diverged = [r for r in summaries if r.get("diverged")]

    base = exp.path.name if exp.path else exp.name
    cmd = f"lmlab compare {exp.path or base} --out {out}" + (" --smoke" if exp.is_smoke else "")
    md = [f"# {exp.name}", ""]
    if exp.claim:
        md += [f"Claim: {exp.claim}", ""]
    if exp.is_smoke:
        md += [
            "**Smoke run** (2 steps, one seed): the numbers below test the tool, not the claim.",
            "",
        ]
    md += [
        f"Budget: {exp.budget.describe()}; seeds {', '.join(map(str, exp.seeds))}; "
        f"reproduce with `{cmd}`.",
        "",
        "\n".join(lines),
        "",
        f"val loss: the trainer's final validation loss ({loss_what}; nats), mean ± sample "
        "standard deviation over seeds; perplexity = exp(mean val loss); train tokens/s: "
        f"training throughput averaged over the run; decode tokens/s: batch 1, KV cache, greedy, "
        f"{exp.decode_tokens} tokens; KV cache bytes/token: K and V summed over layers at the "
        "parameter dtype."
        + (
            f" loss @L: the val split in non-overlapping windows of L tokens "
            f"({exp.eval.max_tokens or 'all'} tokens)."
            if lengths
            else ""
        )
        + (
            " passkey acc @d: exact-match accuracy of the greedy answer to prompts whose key "
            f"lies d tokens before the answer ({pk.samples} prompts per distance), mean ± "
            "standard deviation over seeds."
            if pk is not None
            else ""
        )
        + (
            " expert load: tokens of the busiest expert / mean tokens per expert in the last "
            "logged training window, averaged over MoE layers (1 = balanced)."
            if moe
            else ""
        ),
        "",
        f"## Differences to `{ref_name}`",
        "",
        *(verdicts or ["(one variant: nothing to compare)"]),
        "",
        "Rule: a difference exceeds seed noise when the seeds of the two variants do not overlap "
        "and the gap between the means is more than twice the larger seed standard deviation.",
        "",
    ]
    if notes:
        md += ["Notes:", "", *[f"- {n}" for n in notes], ""]
    if diverged:
        md += ["Diverged runs:", ""]
        md += [f"- `{r['variant']}` seed {r['seed']}: {r['diverged']}" for r in diverged]
        md += [""]
    md += ["## Plots", ""]
    md += [f"![{p.stem.replace('_', ' ')}]({p.name})" for p in plots]
    md += ["", "## Variants", ""]
    for name, overrides in exp.variants.items():
        text = ", ".join(f"`{k}={v}`" for k, v in overrides.items()) or "the base config"
        md.append(f"- `{name}`: {text}")
    for name, inf in exp.eval.inference.items():
        md.append(f"- `{name}`: `{inf.variant}` evaluated with `{' '.join(inf.overrides)}`")
    runs_head = f"| variant | seed | steps | tokens | training time (s) | {loss_head} |"
    md += ["", "## Runs", "", runs_head]
    md += ["|---|---|---|---|---|---|"]
    for r in summaries:
        md.append(
            f"| `{r['variant']}` | {r['seed']} | {r.get('step', 'n/a')} | "
            f"{r.get('tokens', 'n/a')} | {_fmt(r.get('elapsed_s'), '.1f')} | "
            f"{'diverged' if r.get('diverged') else _fmt(r.get('val_loss'))} |"
        )
    atomic_write_text(out / "report.md", "\n".join(md) + "\n")
    return plots
