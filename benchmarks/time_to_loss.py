"""Time to nanoGPT's README loss: nanoGPT's CPU recipe vs lmlab's speedrun preset, one process.

    python benchmarks/time_to_loss.py [--config configs/speedrun.yaml] [--quick]

Both runs train on tinyshakespeare, char-level, the same split (the first 90% of the characters
for training, the last 10% for validation: nanoGPT's ``prepare.py`` and lmlab's
``data.val_fraction: 0.1`` cut at the same character), and stop at the first evaluation whose
validation loss is <= ``--target`` (1.886 nats/char, the README's "loss of only 1.88" figure as
issue 14 states it) or at the end of their schedule. Each prints the training seconds to target
(optimizer steps only), the evaluation seconds, the wall seconds (both), optimizer steps, tokens,
and then the ratio ``time_to_loss nanogpt/lmlab = N.NNx`` of the wall seconds (and of the training
seconds). The anchor is nanoGPT's wall time for its README recipe: to the target, or, when its
20 random val batches put even the last evaluation above 1.886 (1.9018 in one run here: the
README's "1.88" is one draw), to the end of the recipe, 2000 steps, said next to the ratio. An
lmlab run that never reaches the target makes the ratio ``n/a``.

**nanoGPT** (karpathy/nanoGPT ``train.py config/train_shakespeare_char.py --device=cpu
--compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4
--n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0``), reimplemented
from its model.py and train.py (nothing imported from a checkout): GPT-2 Pre-LN blocks without
biases (``bias=False``, train.py's default, which that config keeps: no bias in Linear or
LayerNorm), fused c_attn q/k/v, exact GELU MLP 4x, learned positions, the LM head tied to the token
embedding, N(0, 0.02) init with c_proj N(0, 0.02/sqrt(2 L)); vocabulary = the sorted characters
of the whole text (65); fp32 (nanoGPT autocasts on CUDA only); AdamW(lr 1e-3, betas (0.9, 0.99),
weight decay 0.1 on every >= 2-D parameter, embeddings included, none on LayerNorm weights,
torch's default CPU implementation as nanoGPT asks for ``fused`` on CUDA only), lr warmup
lr (it + 1) / (warmup + 1) for it < 100 then cosine to 1e-4 at it = 2000, grad-norm clip 1.0;
batches of 12 random windows of 64 drawn with torch.randint from the global generator seeded
1337; evaluation at every it % 250 == 0 (it = 0 included), before that iteration's step: the mean
loss of 20 random val batches. Difference, stated: nanoGPT's ``estimate_loss`` also scores 20
train batches at every evaluation; only the val split is scored here (eval seconds are reported
apart anyway). The loop runs it = 0..max_iters like nanoGPT's (2001 steps; the last evaluation
is at it = 2000, after 2000 steps). It runs first, under glibc's own malloc policy, as in its own
process: lmlab's Trainer raises the malloc thresholds (:mod:`lmlab.training.allocator`) only
when the lmlab run starts.

**lmlab**: the preset through lmlab's own API: ``fit_tokenizer`` / ``resolve_run`` /
``build_token_cache`` / ``build_objective`` / ``build_model`` / ``build_optimizer`` and
:class:`lmlab.training.loop.Trainer`, whose ``train_step`` takes every optimizer step (batch
sampling, autocast at ``train.precision``, clipping, optimizer, schedule); evaluation every
``train.eval_every`` steps (and after the last) with lmlab's ``estimate_loss`` over
``train.eval_batches`` fixed val batches of ``train.batch_size`` x ``train.seq_len``. Nothing is
checkpointed or plotted (the benchmark times steps, not file writes).

Same kind of cadence on both sides: an evaluation every N optimizer steps of ``eval_batches``
val batches (20 each by default), its time counted apart. The lmlab run folder is a temporary
directory. Threads: torch's default unless ``--threads``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

TARGET = 1.886  # nats/char: nanoGPT README's CPU-recipe result, as issue 14 states it


# ----------------------------------------------------------------------------- nanoGPT model


@dataclass
class NanoConfig:
    """nanoGPT's GPTConfig at its README CPU shape (bias False: train.py's default)."""

    vocab_size: int = 65
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    bias: bool = False


class NanoLayerNorm(nn.Module):
    """LayerNorm with an optional bias (eps 1e-5), as nanoGPT's."""

    def __init__(self, d: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class NanoBlock(nn.Module):
    """x + attn(ln_1(x)), then x + mlp(ln_2(x)); causal sdpa over fused q/k/v."""

    def __init__(self, c: NanoConfig) -> None:
        super().__init__()
        d = c.n_embd
        self.n_head = c.n_head
        self.ln_1 = NanoLayerNorm(d, c.bias)
        self.c_attn = nn.Linear(d, 3 * d, bias=c.bias)
        self.attn_proj = nn.Linear(d, d, bias=c.bias)
        self.ln_2 = NanoLayerNorm(d, c.bias)
        self.c_fc = nn.Linear(d, 4 * d, bias=c.bias)
        self.mlp_proj = nn.Linear(4 * d, d, bias=c.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(D, dim=2)
        q, k, v = (t.view(B, T, self.n_head, D // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(B, T, D))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    """nanoGPT's GPT: token + learned position embeddings, blocks, ln_f, tied lm_head."""

    def __init__(self, c: NanoConfig) -> None:
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.h = nn.ModuleList(NanoBlock(c) for _ in range(c.n_layer))
        self.ln_f = NanoLayerNorm(c.n_embd, c.bias)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)
        for name, p in self.named_parameters():  # nanoGPT's c_proj (attention and MLP)
            if name.endswith(("attn_proj.weight", "mlp_proj.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * c.n_layer))

    def num_params(self, non_embedding: bool = True) -> int:
        """nanoGPT's ``get_num_params``: the position table left out by default."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """idx, targets (B, T) int64 -> mean cross-entropy, nats/token."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def nanogpt_param_formula(c: NanoConfig) -> int:
    """nanoGPT's reported count (non-embedding: the tied wte counted once, wpe left out):
    L (12 d^2 [+ 13 d biases]) + (2 L + 1) d LayerNorm weights [+ biases] + V d."""
    d, L = c.n_embd, c.n_layer
    biases = (9 * d + 2 * d) * L + d if c.bias else 0  # Linear biases 9d, LayerNorm 2d per layer
    return L * 12 * d * d + (2 * L + 1) * d + c.vocab_size * d + biases


def nanogpt_optimizer(model: NanoGPT, lr: float, wd: float) -> torch.optim.AdamW:
    """configure_optimizers: decay every >= 2-D parameter, none on the rest; no fused on CPU."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": wd},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99))


def nanogpt_lr(it: int, lr: float, min_lr: float, warmup: int, decay_iters: int) -> float:
    """train.py's get_lr."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay_iters:
        return min_lr
    ratio = (it - warmup) / (decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


# ----------------------------------------------------------------------------- results


@dataclass
class Result:
    """One run: seconds to the first evaluation at or below target (or to the end)."""

    name: str
    reached: bool
    steps: int  # optimizer steps taken before that evaluation
    tokens: int  # training tokens of those steps
    train_s: float  # optimizer-step seconds to it
    eval_s: float  # evaluation seconds to it (the target's evaluation included)
    val_loss: float  # that evaluation's loss, nats/char
    history: list[tuple[int, float]]  # (step, val loss) of every evaluation

    @property
    def wall_s(self) -> float:
        return self.train_s + self.eval_s

    @property
    def step_ms(self) -> float:
        return 1000 * self.train_s / max(self.steps, 1)


def _text() -> str:
    from lmlab.data.corpus import load_corpus

    splits = load_corpus("tinyshakespeare", 0.1).splits
    return splits["train"] + splits["val"]


def run_nanogpt(args: argparse.Namespace, text: str) -> Result:
    """nanoGPT's train.py loop at the README CPU recipe (see the module docstring)."""
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    n = len(text)
    ids = np.array([stoi[c] for c in text], dtype=np.int64)
    train_ids = torch.from_numpy(ids[: int(n * 0.9)])
    val_ids = torch.from_numpy(ids[int(n * 0.9) :])
    c = NanoConfig(vocab_size=len(chars))
    bs, T = 12, c.block_size
    torch.manual_seed(1337)

    def get_batch(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - T, (bs,))
        x = torch.stack([data[i : i + T] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + T] for i in ix])
        return x, y

    model = NanoGPT(c)
    opt = nanogpt_optimizer(model, 1e-3, 0.1)
    max_iters, eval_interval = args.nanogpt_iters, args.eval_every
    train_s = eval_s = 0.0
    history: list[tuple[int, float]] = []
    x, y = get_batch(train_ids)
    for it in range(max_iters + 1):
        lr = nanogpt_lr(it, 1e-3, 1e-4, 100, max_iters)
        for g in opt.param_groups:
            g["lr"] = lr
        if it % eval_interval == 0:
            t0 = time.perf_counter()
            model.eval()
            with torch.no_grad():
                val = float(
                    np.mean([float(model(*get_batch(val_ids))) for _ in range(args.eval_batches)])
                )
            model.train()
            eval_s += time.perf_counter() - t0
            history.append((it, val))
            _progress("nanogpt", it, val, train_s)
            if val <= args.target:
                return Result("nanogpt", True, it, it * bs * T, train_s, eval_s, val, history)
        t0 = time.perf_counter()
        loss = model(x, y)
        x, y = get_batch(train_ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        train_s += time.perf_counter() - t0
    last = history[-1]
    return Result("nanogpt", False, last[0], last[0] * bs * T, train_s, eval_s, last[1], history)


# ----------------------------------------------------------------------------- lmlab


@dataclass
class LmlabRun:
    """What :func:`lmlab_session` built: the Trainer (``train_step(step)`` takes one optimizer
    step) and what ``estimate_loss`` needs."""

    trainer: Any
    model: nn.Module
    cfg: Any  # the resolved RunConfig
    seq_len: int
    val: np.ndarray
    par: Any
    objective: Any

    def evaluate(self) -> float:
        from lmlab.training.evaluate import estimate_loss

        dev = self.trainer.dev
        return estimate_loss(
            self.model, self.val, self.cfg, dev, self.seq_len, self.par, self.objective
        )


@contextmanager
def lmlab_session(config: str, overrides: list[str]) -> Iterator[LmlabRun]:
    """Build the run ``lmlab train --config CONFIG --set ...`` would train, as
    :func:`lmlab.training.trainer.train` does (new run, one process), in a temporary folder."""
    from lmlab.config import load_config
    from lmlab.data.corpus import load_corpus
    from lmlab.data.dataset import build_token_cache
    from lmlab.data.tokenizer import fit_tokenizer
    from lmlab.models.build import build_model
    from lmlab.training.distributed import session
    from lmlab.training.hardware import resolve_device
    from lmlab.training.loop import Trainer
    from lmlab.training.objectives import build_objective, prepare_tokenizer
    from lmlab.training.optim import build_optimizer
    from lmlab.training.resolve import prepare_run, resolve_run

    cfg = load_config(config, overrides)
    with tempfile.TemporaryDirectory() as tmp, session() as par:
        run = prepare_run(cfg, Path(tmp) / "run", None, None)
        try:
            dev = resolve_device(cfg.train.device)
            corpus = load_corpus(cfg.data.corpus, cfg.data.val_fraction)
            tok = prepare_tokenizer(cfg, fit_tokenizer(corpus.splits, cfg.data.tokenizer))
            res = resolve_run(cfg, tok, dev)
            splits = build_token_cache(corpus, tok, Path(tmp) / "data")
            objective = build_objective(res.cfg, tok, splits, res.seq_len)
            torch.manual_seed(res.cfg.train.seed)
            model = build_model(res.cfg.model).to(dev)
            opt = build_optimizer(model, res.cfg.train)
            trainer = Trainer(par, run, res, objective, splits["val"], model, opt)
            trainer._start(progress=False)  # the forward function and counters train_step uses
            trainer.logger = None  # no metrics file: steps are what is timed
            yield LmlabRun(trainer, model, res.cfg, res.seq_len, splits["val"], par, objective)
        finally:
            run.folder.release()


def run_lmlab(args: argparse.Namespace) -> Result:
    """The preset through lmlab's trainer (``Trainer.train_step``) and ``estimate_loss``."""
    with lmlab_session(args.config, args.set) as lm:
        tc = lm.cfg.train
        n_params = sum(p.numel() for p in lm.model.parameters())
        print(
            f"lmlab: {args.config} {' '.join(args.set)} vocab {lm.cfg.model.vocab_size}, "
            f"precision {tc.precision}, {n_params:,} parameters",
            file=sys.stderr,
        )
        per_step = lm.trainer.tokens_per_step
        train_s = eval_s = 0.0
        history: list[tuple[int, float]] = []
        for step in range(tc.max_steps + 1):
            if step % tc.eval_every == 0 or step == tc.max_steps:
                t0 = time.perf_counter()
                val = lm.evaluate()
                eval_s += time.perf_counter() - t0
                history.append((step, val))
                _progress("lmlab", step, val, train_s)
                if val <= args.target:
                    return Result(
                        "lmlab", True, step, step * per_step, train_s, eval_s, val, history
                    )
            if step == tc.max_steps:
                break
            t0 = time.perf_counter()
            lm.trainer.train_step(step)
            train_s += time.perf_counter() - t0
        steps = tc.max_steps
        return Result(
            "lmlab", False, steps, steps * per_step, train_s, eval_s, history[-1][1], history
        )


# ----------------------------------------------------------------------------- main


def _progress(name: str, step: int, val: float, train_s: float) -> None:
    print(f"  {name:<8} step {step:>5}  val {val:.4f}  train {train_s:7.1f} s", file=sys.stderr)


def _row(r: Result) -> str:
    hit = "yes" if r.reached else "NO"
    return (
        f"{r.name:<9}{hit:>8}{r.val_loss:>9.4f}{r.train_s:>10.1f}{r.eval_s:>8.1f}{r.wall_s:>8.1f}"
        f"{r.steps:>7}{r.tokens:>11,}{r.step_ms:>9.1f}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default="configs/speedrun.yaml", help="the lmlab preset")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field of the lmlab preset (repeatable)",
    )
    ap.add_argument("--target", type=float, default=TARGET, help="val loss, nats/char")
    ap.add_argument("--eval-every", type=int, default=250, help="nanoGPT's eval_interval")
    ap.add_argument("--eval-batches", type=int, default=20, help="nanoGPT's eval_iters")
    ap.add_argument("--nanogpt-iters", type=int, default=2000, help="max_iters = lr_decay_iters")
    ap.add_argument("--only", choices=("nanogpt", "lmlab"), help="run one side only")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 20 nanoGPT iterations, 20 lmlab steps, evals every 10 of 2 "
        "batches (the target is not reached; checks the benchmark runs)",
    )
    args = ap.parse_args(argv)
    if args.quick:  # the user's --set come last: they win
        args.nanogpt_iters, args.eval_every, args.eval_batches = 20, 10, 2
        quick = ["train.max_steps=20", "train.eval_every=10", "train.eval_batches=2"]
        args.set = [*quick, "train.warmup_steps=5", *args.set]
    return args


def main(argv: list[str] | None = None) -> list[Result]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {load:.2f}, "
        f"target val <= {args.target}",
        file=sys.stderr,
    )
    results = []
    if args.only != "lmlab":
        results.append(run_nanogpt(args, _text()))
    if args.only != "nanogpt":
        results.append(run_lmlab(args))
    print(
        f"{'run':<9}{'reached':>8}{'val':>9}{'train_s':>10}{'eval_s':>8}{'wall_s':>8}"
        f"{'steps':>7}{'tokens':>11}{'ms/step':>9}"
    )
    for r in results:
        print(_row(r))
    if len(results) == 2:
        nano, lm = results
        if lm.reached:  # nanoGPT's time: to the target, or its whole README recipe
            note = (
                ""
                if nano.reached
                else (
                    f"  [nanoGPT's recipe ended at val {nano.val_loss:.4f} > {args.target}: "
                    "its whole run is the anchor]"
                )
            )
            print(
                f"time_to_loss nanogpt/lmlab = {nano.wall_s / lm.wall_s:.2f}x  "
                f"(training seconds: {nano.train_s / lm.train_s:.2f}x){note}"
            )
        else:
            print("time_to_loss nanogpt/lmlab = n/a (lmlab did not reach the target)")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "load_start": load,
                    "load_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                    "results": [{**asdict(r), "wall_s": r.wall_s} for r in results],
                },
                indent=1,
            )
        )
    return results


if __name__ == "__main__":
    main()
