"""Passkey retrieval accuracy against distance (``eval.passkey`` of an experiment).

For each distance d, ``samples`` prompts of :func:`lmlab.data.passkey.passkey_sample` (corpus
``passkey``) or :func:`lmlab.data.recall.recall_sample` (corpus ``recall``; the key is then the
queried key's value, d a multiple of 4) (exactly
``length`` characters, one key whose first digit lies d characters before the answer) are
continued greedily for ``KEY_LEN`` tokens; the accuracy is the fraction whose continuation equals
the key exactly (chance: 10**-KEY_LEN). Prompts are deterministic from (seed, d), so every
variant and seed of an experiment answers the same questions.

Legend: B prompts in a batch, T prompt tokens, V vocab.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lmlab.data import recall
from lmlab.data.passkey import CORPUS_NAME, KEY_LEN, KEY_PREFIX, MIN_DISTANCE, passkey_sample
from lmlab.errors import ConfigError
from lmlab.safeio import short_repr

FIELDS = ("distances", "samples", "seed", "batch_size")
MAX_SAMPLES = 10_000
MAX_DISTANCES = 64
PLOT = "passkey_accuracy_vs_distance.png"
CORPORA = (CORPUS_NAME, recall.CORPUS_NAME)

# prompts -> the model's continuation of each, ``KEY_LEN`` characters
Answerer = Callable[[list[str]], list[str]]


@dataclass
class PasskeyEval:
    """``distances``: ascending characters (tokens) from key to answer; ``samples`` prompts per
    distance; ``seed`` of the prompts; ``batch_size`` prompts per forward pass."""

    distances: list[int] = field(default_factory=list)
    samples: int = 100
    seed: int = 0
    batch_size: int = 50


def _int(raw: dict[str, Any], name: str, low: int, high: int, default: int, where: str) -> int:
    value = raw.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(
            f"{where}: eval.passkey.{name} must be an integer in [{low}, {high:,}], got "
            f"{short_repr(value)}"
        )
    return value


def parse_passkey_eval(raw: Any, where: str) -> PasskeyEval:
    """Validate ``eval.passkey`` -> PasskeyEval; one ConfigError naming the field at fault."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: eval.passkey must be a mapping ({', '.join(FIELDS)})")
    for key in raw:
        if key not in FIELDS:
            raise ConfigError(
                f"{where}: eval.passkey.{key} is unknown; allowed: {', '.join(FIELDS)}"
            )
    d = raw.get("distances")
    if (
        not isinstance(d, list)
        or not 1 <= len(d) <= MAX_DISTANCES
        or any(not isinstance(x, int) or isinstance(x, bool) for x in d)
    ):
        raise ConfigError(
            f"{where}: eval.passkey.distances must be a list of 1 to {MAX_DISTANCES} integers "
            f"(characters from key to answer), got {short_repr(d)}"
        )
    if d != sorted(set(d)) or d[0] < 1:
        raise ConfigError(
            f"{where}: eval.passkey.distances must be strictly ascending and >= 1, got "
            f"{short_repr(d)}"
        )
    return PasskeyEval(
        distances=list(d),
        samples=_int(raw, "samples", 1, MAX_SAMPLES, 100, where),
        seed=_int(raw, "seed", 0, 2**31 - 1, 0, where),
        batch_size=_int(raw, "batch_size", 1, MAX_SAMPLES, 50, where),
    )


def check_passkey_config(spec: PasskeyEval, corpus: str, max_seq_len: int, where: str) -> None:
    """A run evaluated with eval.passkey must train on the passkey or recall corpus, its
    distances must suit that corpus (passkey: >= MIN_DISTANCE; recall: multiples of
    :data:`lmlab.data.recall.SLOT`) and the farthest must fit its context (prompt + answer <=
    max_seq_len)."""
    if corpus not in CORPORA:
        raise ConfigError(
            f"{where}: eval.passkey needs data.corpus: {' or '.join(CORPORA)}, got "
            f"{short_repr(corpus)}"
        )
    d = spec.distances
    if corpus == recall.CORPUS_NAME:
        if any(x < recall.MIN_DISTANCE or x % recall.SLOT for x in d):
            raise ConfigError(
                f"{where}: eval.passkey.distances must be multiples of {recall.SLOT} (one fact "
                f"or query slot of the recall corpus), got {short_repr(d)}"
            )
        longest = recall.farthest(prompt_length(max_seq_len))
    else:
        if d[0] < MIN_DISTANCE:
            raise ConfigError(
                f"{where}: eval.passkey.distances must be >= {MIN_DISTANCE} (the key and the "
                f"question take {MIN_DISTANCE} characters), got {short_repr(d)}"
            )
        longest = prompt_length(max_seq_len) - len(KEY_PREFIX)
    if spec.distances[-1] > longest:
        raise ConfigError(
            f"{where}: eval.passkey.distances go to {spec.distances[-1]}, past the farthest key "
            f"a {max_seq_len}-token context holds ({longest})"
        )


def prompt_length(max_seq_len: int) -> int:
    """Characters per prompt: the context less the answer (its last digit is read at the last
    position)."""
    return max_seq_len - KEY_LEN + 1


def samples_at(
    spec: PasskeyEval, length: int, distance: int, corpus: str = CORPUS_NAME
) -> list[Any]:
    """The ``spec.samples`` prompts at one distance: passkey or recall ones (``corpus``)."""
    rng = random.Random(spec.seed * 1_000_003 + distance)
    make = recall.recall_sample if corpus == recall.CORPUS_NAME else passkey_sample
    return [make(rng, length, distance) for _ in range(spec.samples)]


def passkey_accuracy(
    answer: Answerer, spec: PasskeyEval, length: int, corpus: str = CORPUS_NAME
) -> dict[int, float]:
    """distance -> fraction of ``spec.samples`` prompts of ``length`` characters that ``answer``
    continues with exactly the key (the prompts of ``corpus``: passkey or recall)."""
    out: dict[int, float] = {}
    for d in spec.distances:
        samples = samples_at(spec, length, d, corpus)
        right = 0
        for i in range(0, len(samples), spec.batch_size):
            chunk = samples[i : i + spec.batch_size]
            got = answer([s.prompt for s in chunk])
            right += sum(g == s.answer for g, s in zip(got, chunk, strict=True))
        out[d] = right / len(samples)
    return out


def greedy_answerer(model: nn.Module, tokenizer: Any, n_tokens: int = KEY_LEN) -> Answerer:
    """An Answerer from a causal LM: prompts of equal token length are stacked (B, T) and
    continued greedily for ``n_tokens`` full forward passes (no cache), decoded to text."""
    dev = next(model.parameters()).device

    @torch.no_grad()
    def answer(prompts: list[str]) -> list[str]:
        was = model.training
        model.eval()
        ids = torch.tensor([tokenizer.encode(p) for p in prompts], dtype=torch.long, device=dev)
        new = []
        for _ in range(n_tokens):
            logits = model(ids, last_only=True).logits  # (B, 1, V)
            nxt = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            new.append(nxt)
            ids = torch.cat([ids, nxt], dim=1)
        model.train(was)
        cont = torch.cat(new, dim=1).tolist()
        return [tokenizer.decode(row) for row in cont]

    return answer


def plot_passkey(
    groups: dict[str, list[dict[str, float]]], out: Path, title: str, receptive: int | None = None
) -> Path:
    """Accuracy against distance, one line per variant (mean over seeds, min/max band).
    groups: variant -> one {distance (str or int): accuracy} per seed. ``receptive``: a dashed
    line at the sliding window's receptive field (tokens); a dotted one at chance, 10**-KEY_LEN."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, runs in groups.items():
        runs = [r for r in runs if r]
        if not runs:
            continue
        xs = sorted(int(k) for k in runs[0])
        ys = np.array([[float(r.get(str(x), math.nan)) for x in xs] for r in runs])
        (line,) = ax.plot(xs, ys.mean(0), "o-", ms=4, label=f"{name} (n={len(runs)})")
        if len(runs) > 1:
            ax.fill_between(xs, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.2)
    if receptive:
        ax.axvline(receptive, ls="--", color="gray", lw=1, label=f"window reach ({receptive})")
    ax.axhline(10.0**-KEY_LEN, ls=":", color="black", lw=1, label="chance")
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("distance from key to answer (tokens)")
    ax.set_ylabel(f"exact-match accuracy ({KEY_LEN}-digit key)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def accuracy_cells(runs: list[dict[str, Any]], distances: list[int]) -> list[str]:
    """Report cells: mean ± sample std over seeds of each distance's accuracy ("n/a" when a seed
    has none, e.g. diverged)."""
    cells = []
    for d in distances:
        got = [(r.get("passkey") or {}).get(str(d)) for r in runs]
        vals = [float(v) for v in got if v is not None]
        if not vals or len(vals) < len(got):
            cells.append("n/a")
            continue
        mean = float(np.mean(vals))
        std = f" ± {float(np.std(vals, ddof=1)):.2f}" if len(vals) > 1 else ""
        cells.append(f"{mean:.2f}{std}")
    return cells


def window_reach(models: list[Any]) -> int | None:
    """The farthest distance a sliding-window variant can carry a token, ``n_layers * (window -
    1) + 1`` tokens (the smallest over such variants), or None when none has a window."""
    reach = [
        m.n_layers * (m.attention.window - 1) + 1
        for m in models
        if m.attention.mask == "sliding_window" and m.attention.window
    ]
    return min(reach) if reach else None
