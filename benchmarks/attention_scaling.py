"""KV-cache bytes, prefill time and decode speed vs context length for every attention design.

    python benchmarks/attention_scaling.py --out runs/bench/attention_scaling [--quick]

One small decoder (d_model 128, 2 layers, 4 heads of 32, RoPE, random weights, float32, batch 1,
``max_seq_len`` = the longest context + the new tokens) per design: full softmax (MHA), GQA,
sliding window, local + global, MLA (expanded and ``absorb``), differential, sigmoid, sink logit +
StreamingLLM cache, MoBA, linear attention, and any other registered ``model.attention.kind``
with its default fields (NSA, say, once registered); a design whose kind or mask is not
registered here, or whose config is refused, is listed as skipped with the reason.

For each context length L (1k-16k by default) and each design, interleaved within the length
(the design order rotates between repeats, medians over ``--repeats``):

- **KV cache**: bytes the model declares (:func:`lmlab.analysis.costs.kv_cache_bytes`, batch 1,
  while decoding token L + 1) and bytes the cache actually holds or hands back during that
  decode step (the larger of ``cache.nbytes()`` and what the layers' ``update`` returned, as
  the contract test measures); the two must be equal (column "check").
- **prefill**: seconds to run the L-token prompt through an empty cache, in chunks of
  ``--prefill-chunk`` tokens (chunked prefill, so that designs with a dense mask need at most
  chunk x L scores per head; 0 = one pass).
- **decode**: tokens/s of ``--new-tokens`` single-token steps after that prefill (logits of
  the last position only, fixed random token ids).
- **peak memory**: ``torch.cuda.max_memory_allocated`` above the weights on CUDA; not measured
  on CPU (torch's CPU allocator keeps no statistics and process RSS is a high-water mark).

Writes ``attention_scaling.md`` (conditions, the table, each design's ratio to full softmax at
the same length), ``attention_scaling.json`` and ``attention_scaling.png`` (log-log) to
``--out``. Timings on a shared machine are noisy: read the ratios, measured side by side.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmlab.analysis.costs import kv_cache_bytes
from lmlab.config import ModelConfig, config_from_dict
from lmlab.errors import LmlabError
from lmlab.models import build_model
from lmlab.registry import families

LENGTHS = (1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (128, 256)
VOCAB = 256


def designs(window: int, block: int) -> dict[str, dict[str, Any]]:
    """Design name -> ``model.attention`` overrides over the base model (4 heads of 32).

    ``window``: the sliding / local / streaming window (tokens); ``block``: MoBA's key block.
    MLA caches kv_lora_rank 48 + rope 16 = 64 numbers a token and layer, as GQA with 1 kv head
    (MQA) does, against full softmax's 2 x 4 x 32 = 256.
    """
    mla = {"kind": "mla", "head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32}
    return {
        "full": {"n_kv_heads": 4},
        "gqa": {"n_kv_heads": 2},
        "mqa": {"n_kv_heads": 1},
        "sliding_window": {"mask": "sliding_window", "window": window},
        "local_global": {"mask": "local_global", "window": window, "global_tokens": 4},
        "mla": {**mla, "kv_lora_rank": 48},
        "mla_absorb": {**mla, "kv_lora_rank": 48, "absorb": True},
        "differential": {"kind": "differential"},
        "sigmoid": {"kind": "sigmoid"},
        "sink_streaming": {"kind": "sink", "mask": "streaming", "window": window, "sink_tokens": 4},
        "moba": {"kind": "moba", "moba_block_size": block, "moba_top_k": 3},
        "linear": {"kind": "linear"},
    }


def all_designs(window: int, block: int) -> dict[str, dict[str, Any]]:
    """:func:`designs` plus every registered attention kind none of them names (default fields)."""
    table = designs(window, block)
    named = {d.get("kind", "softmax") for d in table.values()}
    for kind in families()["attention"]:
        if kind not in named:
            table[kind] = {"kind": kind}
    return table


def model_config(attention: dict[str, Any], max_seq_len: int, d_model: int = 128) -> ModelConfig:
    """The validated base model with ``attention`` overrides; raises LmlabError if refused."""
    data = {
        "name": "attention-scaling",
        "model": {
            "d_model": d_model,
            "n_layers": 2,
            "max_seq_len": max_seq_len,
            "vocab_size": VOCAB,
            "attention": {"n_heads": 4, **attention},
            "position": {"kind": "rope"},
        },
        "train": {"precision": "fp32", "device": "cpu"},
    }
    return config_from_dict(data).validate().model


def unregistered(attention: dict[str, Any]) -> str | None:
    """Why a design cannot run in this checkout (its kind or mask is not registered), or None."""
    fams = families()
    for key, family in (("kind", "attention"), ("mask", "mask")):
        name = attention.get(key)
        if name is not None and name not in fams[family]:
            return f"{family} {name!r} is not registered here"
    return None


@dataclass
class Point:
    """One design at one context length (medians over repeats)."""

    design: str
    length: int
    declared_bytes: int
    held_bytes: int
    prefill_s: float
    decode_tok_s: float
    peak_bytes: int | None = None
    prefill_runs: list[float] = field(default_factory=list)
    decode_runs: list[float] = field(default_factory=list)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _held_during_step(model: torch.nn.Module, cache: Any, token: torch.Tensor) -> int:
    """Bytes the cache holds or hands back while decoding ``token`` (B, 1): the larger of
    ``cache.nbytes()`` after the step and the keys/values the layers' ``update`` returned."""
    read: list[int] = []
    originals = []
    for layer in cache.layers:
        update = layer.update
        originals.append((layer, update))

        def spy(*a: Any, _update: Any = update) -> Any:
            out = _update(*a)
            tensors = out if isinstance(out, tuple) else ()
            read.append(sum(t.numel() * t.element_size() for t in tensors))
            return out

        layer.update = spy
    model(token, cache=cache, last_only=True)
    for layer, update in originals:
        layer.update = update
    return max(cache.nbytes(), sum(read))


@torch.no_grad()
def measure(
    model: torch.nn.Module,
    cfg: ModelConfig,
    prompt: torch.Tensor,
    new_ids: torch.Tensor,
    chunk: int,
    device: torch.device,
) -> tuple[int, float, float, int | None]:
    """(held bytes, prefill seconds, decode tokens/s, peak bytes or None) for one prompt (1, L)."""
    length = prompt.shape[1]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    cache = model.new_cache()  # type: ignore[operator]
    step = chunk or length
    _sync(device)
    t0 = time.perf_counter()
    for start in range(0, length, step):
        model(prompt[:, start : start + step], cache=cache, last_only=True)
    _sync(device)
    prefill = time.perf_counter() - t0
    held = _held_during_step(model, cache, new_ids[:, :1])
    n = new_ids.shape[1] - 1
    _sync(device)
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        model(new_ids[:, i : i + 1], cache=cache, last_only=True)
    _sync(device)
    decode = n / (time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    return held, prefill, decode, peak


def run(
    lengths: Sequence[int],
    new_tokens: int,
    repeats: int,
    chunk: int,
    window: int,
    block: int,
    device: torch.device,
    only: Sequence[str] = (),
    max_prefill_s: float = float("inf"),
    done: Callable[[list[Point], dict[str, str], dict[str, ModelConfig]], None] | None = None,
) -> tuple[list[Point], dict[str, str], dict[str, ModelConfig]]:
    """Measure every design at every length, interleaved within each length; ``done`` is called
    with the results so far after each length. A design whose prefill took longer than
    ``max_prefill_s`` is not run at the longer lengths (listed in skipped with its time).

    Returns (points, skipped design -> reason, design -> its config)."""
    max_len = max(lengths) + new_tokens + 1
    skipped: dict[str, str] = {}
    models: dict[str, tuple[ModelConfig, torch.nn.Module]] = {}
    for name, attention in all_designs(window, block).items():
        if only and name not in only:
            continue
        why = unregistered(attention)
        if why is None:
            try:
                cfg = model_config(copy.deepcopy(attention), max_len)
                torch.manual_seed(0)
                models[name] = (cfg, build_model(cfg).to(device).eval())
                continue
            except (LmlabError, ValueError) as e:
                why = f"refused: {e}"
        skipped[name] = why
    gen = torch.Generator().manual_seed(0)
    points: list[Point] = []
    order = list(models)
    for length in lengths:
        if not order:
            break
        prompt = torch.randint(0, VOCAB, (1, length), generator=gen).to(device)
        new_ids = torch.randint(0, VOCAB, (1, new_tokens + 1), generator=gen).to(device)
        runs: dict[str, list[tuple[int, float, float, int | None]]] = {n: [] for n in order}
        for r in range(repeats):
            for name in order[r % len(order) :] + order[: r % len(order)]:
                cfg, model = models[name]
                runs[name].append(measure(model, cfg, prompt, new_ids, chunk, device))
        for name in order:
            cfg, _ = models[name]
            held, prefills, decodes, peaks = zip(*runs[name], strict=True)
            peak = max(peaks) if peaks[0] is not None else None  # type: ignore[type-var]
            points.append(
                Point(
                    name, length, kv_cache_bytes(cfg, 1, length + 1), max(held),
                    statistics.median(prefills), statistics.median(decodes), peak,
                    list(prefills), list(decodes),
                )
            )  # fmt: skip
        for p in points[-len(order) :] if order else []:
            if p.prefill_s > max_prefill_s and length != lengths[-1]:
                order.remove(p.design)
                skipped[p.design] = (
                    f"not run past {length:,} tokens: its prefill took {p.prefill_s:.0f} s "
                    f"(> --max-prefill-s {max_prefill_s:g})"
                )
        if done is not None:
            done(points, skipped, {n: c for n, (c, _) in models.items()})
    return points, skipped, {n: c for n, (c, _) in models.items()}


def _bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,} B"


def markdown(
    points: list[Point], skipped: dict[str, str], conditions: list[str], designs_used: dict
) -> str:
    """The report: conditions, the designs' overrides, the table, ratios to full softmax."""
    full = {p.length: p for p in points if p.design == "full"}
    lines = ["# Attention designs: KV cache, prefill and decode vs context length", ""]
    lines += [f"- {c}" for c in conditions] + [""]
    lines += ["| design | `model.attention` overrides |", "|---|---|"]
    lines += [f"| `{n}` | `{json.dumps(a, sort_keys=True)}` |" for n, a in designs_used.items()]
    lines += [f"| `{n}` | skipped: {why} |" for n, why in skipped.items()]
    lines += [
        "",
        "KV cache = bytes while decoding the token after an L-token prompt (float32, 2 layers, "
        "batch 1): declared by the model; check = equal to what the cache held. x full = the "
        "design's value / full softmax's at the same length (prefill: < 1 is faster; decode: "
        "> 1 is faster).",
        "",
        "| design | context | KV cache | check | KV x full | prefill (s) | prefill x full "
        "| decode (tokens/s) | decode x full | peak memory |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for length in sorted(full) or sorted({p.length for p in points}):
        ref = full.get(length)
        for p in (q for q in points if q.length == length):
            ok = "ok" if p.declared_bytes == p.held_bytes else f"held {_bytes(p.held_bytes)}"
            kv_x = f"{p.declared_bytes / ref.declared_bytes:.3f}" if ref else ""
            pre_x = f"{p.prefill_s / ref.prefill_s:.2f}" if ref else ""
            dec_x = f"{p.decode_tok_s / ref.decode_tok_s:.2f}" if ref else ""
            lines.append(
                f"| `{p.design}` | {length:,} | {_bytes(p.declared_bytes)} | {ok} | {kv_x} "
                f"| {p.prefill_s:.3f} | {pre_x} | {p.decode_tok_s:,.1f} | {dec_x} "
                f"| {_bytes(p.peak_bytes)} |"
            )
    return "\n".join(lines) + "\n"


def plot(points: list[Point], path: Path) -> None:
    """Three log-log panels vs context length: KV-cache bytes, prefill seconds, decode tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    panels = (
        ("declared_bytes", "KV cache while decoding (bytes)"),
        ("prefill_s", "prefill (s)"),
        ("decode_tok_s", "decode (tokens/s)"),
    )
    names = list(dict.fromkeys(p.design for p in points))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for i, name in enumerate(names):
            pts = [p for p in points if p.design == name]
            ys = [max(getattr(p, key), 1e-9) for p in pts]
            style = "-" if i < 10 else "--"
            ax.plot([p.length for p in pts], ys, style, marker="o", ms=3, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("attention designs, d_model 128, 2 layers, 4 heads, float32, batch 1")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def describe(
    args: argparse.Namespace,
    device: torch.device,
    started: float,
    lengths: Sequence[int],
    new_tokens: int,
    repeats: int,
    window: int,
    block: int,
) -> list[str]:
    """The measurement conditions, one line each, for the report's head."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(started))
    cpu = platform.processor() or platform.machine()
    return [
        f"{when}, {cpu}, device {device}, torch {torch.__version__}, {args.threads} thread(s), "
        f"python {sys.version.split()[0]}",
        f"load average at the end (1, 5, 15 min): {load}; wall time {time.time() - started:.0f} s",
        "base model: d_model 128, 2 layers, 4 heads of 32, RoPE, random weights, float32, "
        f"batch 1, max_seq_len {max(lengths) + new_tokens + 1}, vocab {VOCAB}",
        f"prefill in chunks of {args.prefill_chunk or 'all'} tokens; decode {new_tokens} tokens; "
        f"medians of {repeats} interleaved repeat(s), design order rotated per repeat; "
        f"window {window}, MoBA block {block} (top_k 3)",
    ]


def main(argv: Sequence[str] | None = None) -> list[Point]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="runs/bench/attention_scaling")
    ap.add_argument("--lengths", type=int, nargs="+", default=None)
    ap.add_argument("--new-tokens", type=int, default=None, help="decode steps (default 64)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 2)")
    ap.add_argument("--prefill-chunk", type=int, default=2048, help="0: one pass")
    ap.add_argument("--window", type=int, default=None, help="sliding window (default 1024)")
    ap.add_argument("--block", type=int, default=None, help="MoBA block (default 512)")
    ap.add_argument("--max-prefill-s", type=float, default=30.0, help="drop slower designs")
    ap.add_argument("--designs", nargs="+", default=(), help="only these designs")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="smoke: lengths 128, 256, 4 tokens")
    args = ap.parse_args(argv)
    q = args.quick
    lengths = args.lengths or (QUICK_LENGTHS if q else LENGTHS)
    new_tokens = args.new_tokens or (4 if q else 64)
    repeats = args.repeats or (1 if q else 2)
    window = args.window or (64 if q else 1024)
    block = args.block or (32 if q else 512)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    started = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def write(points: list[Point], skipped: dict[str, str], cfgs: dict[str, ModelConfig]) -> None:
        conditions = describe(args, device, started, lengths, new_tokens, repeats, window, block)
        used = {n: a for n, a in all_designs(window, block).items() if n in cfgs}
        (out / "attention_scaling.md").write_text(markdown(points, skipped, conditions, used))
        data = {"conditions": conditions, "skipped": skipped, "points": [asdict(p) for p in points]}
        (out / "attention_scaling.json").write_text(json.dumps(data, indent=1))
        plot(points, out / "attention_scaling.png")

    chunk = args.prefill_chunk
    points, _, _ = run(
        lengths, new_tokens, repeats, chunk, window, block, device, args.designs,
        args.max_prefill_s, write,
    )  # fmt: skip
    print((out / "attention_scaling.md").read_text())
    return points


if __name__ == "__main__":
    main()
