"""Step cost of training recipes relative to the first one, measured side by side in one process.

    python benchmarks/recipe_step_cost.py [--rounds 6] [--steps 4] \
        [--recipe NAME=[@CONFIG,]key=value,key=value ...]

A recipe is the library's default config (the tutorial Mini-GPT: tied embeddings, AdamW, what
the default run trained before configs/minigpt.yaml had its own recipe), or ``@CONFIG`` (a
YAML file), with ``--set``-style overrides. Without ``--recipe``: the library defaults against
configs/minigpt.yaml (the default run's recipe). The script builds every
recipe's model and optimizer once, then times ``--steps`` optimizer steps (forward, backward,
grad-norm clip, optimizer step, at the config's precision and batch) of each recipe in turn,
``--rounds`` times (interleaved, so load changes hit every recipe alike), and prints each
recipe's median ms/step and its ratio to the first recipe. A recipe's wall time is then its
steps x its ms/step: with the ratio r, N steps cost as much as N x r steps of the first recipe.
Timings are noisy on shared machines; the ratios much less so.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmlab.config import load_config
from lmlab.models import build_model
from lmlab.training.hardware import autocast, resolve_precision
from lmlab.training.optim import build_optimizer

DEFAULT_RECIPES = ["defaults=", "minigpt.yaml=@configs/minigpt.yaml"]


def parse_recipe(text: str) -> tuple[str, str | None, list[str]]:
    """``NAME=[@CONFIG,]k=v,k=v`` -> (name, config path or None, overrides)."""
    name, _, rest = text.partition("=")
    parts = [s for s in rest.split(",") if s]
    config = parts.pop(0)[1:] if parts and parts[0].startswith("@") else None
    return name, config, parts


class Recipe:
    def __init__(self, name: str, config: str | None, overrides: list[str]) -> None:
        self.name = name
        cfg = load_config(config, overrides)
        cfg.model.vocab_size = cfg.model.vocab_size or 65
        torch.manual_seed(0)
        self.cfg = cfg
        self.model = build_model(cfg.model)
        self.opt = build_optimizer(self.model, cfg.train)
        self.precision = resolve_precision(cfg.train.precision, torch.device("cpu"))
        seq = cfg.train.seq_len or cfg.model.max_seq_len
        self.tokens = cfg.train.batch_size * seq
        self.x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, seq + 1))
        self.times: list[float] = []

    def steps(self, n: int, record: bool) -> None:
        x, y = self.x[:, :-1], self.x[:, 1:]
        for _ in range(n):
            t = time.perf_counter()
            with autocast(torch.device("cpu"), self.precision):
                loss = self.model(x, targets=y).loss
            loss.backward()
            if self.cfg.train.grad_clip:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            if record:
                self.times.append(time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--recipe", action="append", help="NAME=[@CONFIG,]k=v,k=v (repeatable)")
    args = ap.parse_args()
    recipes = [Recipe(*parse_recipe(r)) for r in args.recipe or DEFAULT_RECIPES]
    for r in recipes:  # warm-up
        r.steps(2, record=False)
    for _ in range(args.rounds):
        for r in recipes:
            r.steps(args.steps, record=True)
    base = statistics.median(recipes[0].times)
    print(f"threads {torch.get_num_threads()}, precision {recipes[0].precision}")
    print(f"{'recipe':<28}{'ms/step':>9}{'chars/s':>9}{'ratio':>8}")
    for r in recipes:
        med = statistics.median(r.times)
        print(f"{r.name:<28}{1000 * med:>9.1f}{r.tokens / med:>9,.0f}{med / base:>8.3f}")


if __name__ == "__main__":
    main()
