"""The optimizers (AdamW with decoupled weight decay on matrices only; Muon for the hidden
matrices with AdamW for the rest) and the LR schedules (warmup + cosine; warmup-stable-decay).

Steps are optimizer steps (0-based); learning rates are per unit gradient (AdamW) or per unit
orthogonalised update (Muon)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lmlab.config import TrainConfig
from lmlab.training.hardware import has_fast_bf16

OPTIMIZERS = ("adamw", "muon")  # train.optimizer
SCHEDULES = ("cosine", "wsd")  # train.schedule
DECAY_SHAPES = ("linear", "sqrt")  # train.decay_shape (wsd)


def param_groups(
    model: nn.Module, weight_decay: float, exclude: set[int] | None = None
) -> list[dict[str, Any]]:
    """Two AdamW groups: weight decay on the 2-D weights of linear layers; none on norms, biases
    and embeddings (token embeddings, a tied LM head, learned positions). Parameters whose id is
    in ``exclude`` (those Muon holds) are left out."""
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in (exclude or ()):
            continue
        if p.ndim >= 2 and id(p) not in embedding_ids and not name.startswith("position."):
            decay.append(p)
        else:
            no_decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def muon_param_names(model: nn.Module) -> list[str]:
    """The parameters Muon updates under ``train.optimizer: muon``: the 2-D weight of every
    nn.Linear inside a transformer block (a BLOCK or, in an encoder-decoder, a DECODER_BLOCK:
    attention q/k/v/o, cross-attention and MLA projections, FFN
    gate/up/down, each MoE expert's own (F, D) / (D, F) matrices), as Keller Jordan's Muon and
    modded-nanogpt do for the hidden layers. Left to AdamW: the token embedding, the LM head
    (tied or not), learned positions, norms, biases, per-head scalars and vectors, an MoE
    router (a classifier over experts, not a hidden layer) and any Linear outside the blocks
    (an encoder's pooler and MLM head)."""
    from lmlab.models.counting import variant_types
    from lmlab.nn.block import BLOCK, DECODER_BLOCK

    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    block_types = variant_types(BLOCK) + variant_types(DECODER_BLOCK)
    names: list[str] = []
    seen: set[int] = set()
    for bname, block in model.named_modules():
        if not isinstance(block, block_types) or not isinstance(block, nn.Module):
            continue
        for mname, m in block.named_modules():
            if not isinstance(m, nn.Linear) or mname.rpartition(".")[2] == "router":
                continue
            w = m.weight
            if w.ndim == 2 and w.requires_grad and id(w) not in embedding_ids | seen:
                seen.add(id(w))
                names.append(f"{bname}.{mname}.weight")
    return names


class GroupedMuon(torch.optim.Muon):
    """``torch.optim.Muon``'s update with the matrices of one shape orthogonalised together.

    torch steps Muon one matrix at a time (about 30 small kernels per matrix per step); this
    stacks every matrix of a shape (R, C) into one (N, R, C) batch and runs the same bfloat16
    Newton-Schulz iteration on it with batched matmuls (``baddbmm``), then applies the same
    parameter update, so a step costs a few dozen kernels whatever the depth. Per matrix it
    computes what torch's ``_single_tensor_muon`` does: the momentum buffer
    B <- B + (1 - mu)(g - B) (float32, the parameter's dtype), the Nesterov input
    u = g + mu (B - g), X = u / max(||u||_F, eps) in bfloat16 (transposed when tall, R > C),
    ``ns_steps`` times X <- a X + (b A + c A^2) X with A = X X^T, then
    p <- p (1 - lr weight_decay) - lr adj X with adj = sqrt(max(1, R / C)) ("original") or
    0.2 sqrt(max(R, C)) ("match_rms_adamw"). The state (``momentum_buffer`` per parameter) and
    the state dict are torch's. Outputs equal torch's within bfloat16 rounding (batched and
    single matmuls may sum in another order: tests/unit/test_muon_wsd.py). Dense, real 2-D
    parameters only (torch.optim.Muon's own rule); ``maximize`` and a tensor lr are not
    supported.

    ``ns_dtype`` is the dtype of the Newton-Schulz iteration: bfloat16 (torch's choice, and
    the default) where bf16 matmuls are fast; float32 on a CPU without bf16 units, where
    bfloat16 matmuls are emulated and one Newton-Schulz step of a Mini-GPT cost seconds
    (:func:`build_optimizer` chooses by :func:`lmlab.training.hardware.has_fast_bf16`). The
    same iteration in either dtype; float32 only rounds less."""

    def __init__(self, params: Any, *, ns_dtype: torch.dtype = torch.bfloat16, **kw: Any) -> None:
        if ns_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"ns_dtype must be bfloat16 or float32, not {ns_dtype}")
        super().__init__(params, **kw)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            lr, wd, mu = float(group["lr"]), group["weight_decay"], group["momentum"]
            grads = [p.grad for p in params]
            if any(g.ndim != 2 or g.is_sparse or g.is_complex() for g in grads):
                raise ValueError("Muon updates dense, real 2-D parameters only")
            bufs = []
            for p, g in zip(params, grads, strict=True):
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(
                        g, memory_format=torch.preserve_format
                    )
                bufs.append(state["momentum_buffer"])
            torch._foreach_lerp_(bufs, grads, 1 - mu)
            updates = torch._foreach_lerp(grads, bufs, mu) if group["nesterov"] else bufs
            by_shape: dict[tuple[int, int], list[int]] = {}
            for i, p in enumerate(params):
                by_shape.setdefault((p.shape[0], p.shape[1]), []).append(i)
            for (rows, cols), idx in by_shape.items():
                ortho = _newton_schulz_batched(
                    torch.stack([updates[i] for i in idx]),
                    group["ns_coefficients"],
                    group["ns_steps"],
                    group["eps"],
                    self.ns_dtype,
                )
                adjust = group["adjust_lr_fn"]
                if adjust == "match_rms_adamw":
                    ratio = 0.2 * math.sqrt(max(rows, cols))
                elif adjust is None or adjust == "original":
                    ratio = math.sqrt(max(1.0, rows / cols))
                else:
                    ratio = 1.0
                group_params = [params[i] for i in idx]
                torch._foreach_mul_(group_params, 1 - lr * wd)
                steps = ortho.to(group_params[0].dtype).unbind(0)
                torch._foreach_add_(group_params, steps, alpha=-lr * ratio)
        return loss


def _newton_schulz_batched(
    u: torch.Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """(N, R, C) -> (N, R, C) in ``dtype``: each matrix through torch.optim.Muon's quintic
    Newton-Schulz iteration (Jordan et al. 2024), batched."""
    a, b, c = coefficients
    x = u.to(dtype)
    tall = x.shape[1] > x.shape[2]
    if tall:
        x = x.mT
    x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT  # (N, r, r), r = min(R, C)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon (:class:`GroupedMuon`) over :func:`muon_param_names`, AdamW over the rest, stepped
    together as one optimizer.

    ``param_groups`` is Muon's group followed by AdamW's two (the same dicts the two hold, so
    setting a group's ``lr`` reaches the optimizer that owns it); ``state_dict`` numbers the
    parameters in that order, as one torch optimizer would, and ``load_state_dict`` splits it
    back. Muon's state is ``momentum_buffer`` (the parameter's shape); AdamW's ``step``,
    ``exp_avg``, ``exp_avg_sq``. Muon's groups carry ``base_lr`` (``train.muon_lr``), which
    :func:`set_lr` scales by the schedule. Only ``step``, ``zero_grad``, ``state_dict`` and
    ``load_state_dict`` are its own: torch's optimizer hooks and ``add_param_group`` are not
    supported (the base class is not initialised)."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW) -> None:
        self.muon, self.adamw = muon, adamw
        self.optimizers = (muon, adamw)
        self.param_groups = [*muon.param_groups, *adamw.param_groups]
        self.defaults = {}

    @property
    def state(self) -> Any:  # type: ignore[override]  # each part keeps its own: a merged view
        return {**self.muon.state, **self.adamw.state}

    def __repr__(self) -> str:
        return f"MuonWithAdamW({self.muon!r}, {self.adamw!r})"

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        self.muon.step()
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for opt in self.optimizers:
            sd = opt.state_dict()
            for i, s in sd["state"].items():
                state[i + offset] = s
            for g in sd["param_groups"]:
                groups.append({**g, "params": [i + offset for i in g["params"]]})
            offset += sum(len(g["params"]) for g in opt.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        offset, g0 = 0, 0
        for opt in self.optimizers:
            n = sum(len(g["params"]) for g in opt.param_groups)
            k = len(opt.param_groups)
            groups = [
                {**g, "params": [i - offset for i in g["params"]]}
                for g in state_dict["param_groups"][g0 : g0 + k]
            ]
            state = {
                int(i) - offset: s
                for i, s in state_dict["state"].items()
                if offset <= int(i) < offset + n
            }
            opt.load_state_dict({"state": state, "param_groups": groups})
            offset, g0 = offset + n, g0 + k
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]


ADAMW_KERNEL = True
"""Whether :class:`AdamW` may step through lmlab's one-call C++ kernel (an A/B switch for
benchmarks and tests; off: torch's fused kernel, tensor by tensor)."""

_PLAIN_PARAMS = (torch.Tensor, nn.Parameter)


class AdamW(torch.optim.AdamW):
    """torch's ``AdamW(fused=True)`` (Loshchilov & Hutter 2019), whose CPU step is one C++ call
    for all its parameters (``torch.ops.lmlab.adamw_step_``, ``train_kernels.cpp``): the step
    counts, the bias corrections and every element's update in one threaded pass, split evenly
    over the threads. torch's fused CPU step opens one parallel region per parameter and counts
    the steps with a foreach add that runs tensor by tensor on the CPU (some 6 us each): with
    the 51 small tensors of nanoGPT's CPU shape that was about half of its 1.3 ms.

    Its arithmetic is torch's fused kernel's, operation by operation: where torch runs that
    kernel sixteen lanes wide (its AVX512 CPU capability; its AVX2 build measured the same),
    the same bits; where torch runs its scalar build, float32 roundings differ anywhere in a
    tensor. The same state (``step`` a float32 scalar, ``exp_avg``, ``exp_avg_sq``), so
    checkpoints move between the two. Taken when :data:`ADAMW_KERNEL` is on, no closure is
    given and no GradScaler's ``grad_scale`` / ``found_inf`` is set, every group was built
    ``fused=True`` (the trainer's are; ``foreach`` or plain groups keep torch's own arithmetic)
    with plain numbers for lr, betas, eps and weight decay and amsgrad, maximize, capturable
    and differentiable off, every parameter with a gradient is a plain dense contiguous
    float32 CPU tensor (not a DTensor shard) whose state exists (torch's step creates it, so
    the first step is torch's, and so is a step in which a parameter gets its first gradient),
    its gradient and state alike, none sharing memory, and the kernels are compiled
    (:func:`lmlab.nn.train_kernel.available`, asked last: a step the kernel could not take for
    its parameters' dtype or device, its options or its state never builds them; one the C++
    operator refuses, e.g. for non-contiguous or overlapping tensors, may). Under
    torch.compile or a torch dispatch mode the step is torch's. Otherwise (CUDA, FSDP2, bf16
    parameters ...) the step is torch's own. Optimizer hooks run as for any torch optimizer."""

    def step(self, closure: Any = None) -> Any:
        from lmlab.nn.train_kernel import traced

        # traced (torch.compile, a dispatch mode): torch's step, whose ops a tracer sees
        kernel = ADAMW_KERNEL and closure is None and not traced()
        lists = self._kernel_lists() if kernel else None
        if lists is not None:
            with torch.no_grad():
                if torch.ops.lmlab.adamw_step_(*lists):
                    return None
        return _torch_adamw_step(self, closure)

    def _kernel_lists(self) -> tuple[list[Any], ...] | None:
        """The arguments of ``torch.ops.lmlab.adamw_step_`` for every parameter with a
        gradient, or None where the step must be torch's (the class docstring's conditions the
        C++ operator does not check itself). The kernels are compiled (on first use) only once
        everything else says the kernel could take this step."""
        if getattr(self, "grad_scale", None) is not None:
            return None
        if getattr(self, "found_inf", None) is not None:
            return None
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        avgs: list[torch.Tensor] = []
        sqs: list[torch.Tensor] = []
        steps: list[torch.Tensor] = []
        lrs: list[float] = []
        b1s: list[float] = []
        b2s: list[float] = []
        wds: list[float] = []
        epss: list[float] = []
        number = (float, int)
        f32 = torch.float32
        for group in self.param_groups:
            lr, (b1, b2), wd, eps = group["lr"], group["betas"], group["weight_decay"], group["eps"]
            if not all(type(x) in number for x in (lr, b1, b2, wd, eps)):
                return None
            # the fused kernel's arithmetic only where the group asked for torch's fused one
            if not group["fused"] or group["amsgrad"] or group["maximize"]:
                return None
            if group["capturable"] or group["differentiable"]:
                return None
            if not group["decoupled_weight_decay"]:
                return None
            count = len(params)
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                state = self.state.get(p)
                if type(p) not in _PLAIN_PARAMS or type(g) is not torch.Tensor or not state:
                    return None
                if p.dtype is not f32 or not p.is_cpu:  # bf16, CUDA: torch's step, no build
                    return None
                params.append(p)
                grads.append(g)
                avgs.append(state["exp_avg"])
                sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            n = len(params) - count
            lrs += [float(lr)] * n
            b1s += [float(b1)] * n
            b2s += [float(b2)] * n
            wds += [float(wd)] * n
            epss += [float(eps)] * n
        if not params:
            return None
        from lmlab.nn import train_kernel

        if not train_kernel.available():
            return None
        return params, grads, avgs, sqs, steps, lrs, b1s, b2s, wds, epss


def _torch_adamw_step(opt: torch.optim.AdamW, closure: Any) -> Any:
    """torch's AdamW step on ``opt``, without the optimizer-hook wrapper torch puts around a
    class's ``step`` (the wrapper around :meth:`AdamW.step` already runs the hooks once)."""
    fn = torch.optim.AdamW.step
    while getattr(fn, "hooked", False):
        fn = fn.__wrapped__  # type: ignore[attr-defined]
    return fn(opt, closure)


def _adamw(groups: list[dict[str, Any]], cfg: TrainConfig) -> torch.optim.AdamW:
    kwargs: dict[str, Any] = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": 1e-8}
    try:
        return AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, **kwargs)


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """``train.optimizer``: adamw = AdamW (Loshchilov & Hutter 2019) over :func:`param_groups`,
    the fused kernel when the parameters' device supports it; muon = :class:`MuonWithAdamW`
    (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/): Muon (torch.optim.Muon's
    update, batched by shape: :class:`GroupedMuon`) at
    ``train.muon_lr`` with momentum ``train.muon_momentum`` (Nesterov), 5 Newton-Schulz steps,
    the Newton-Schulz iteration in bfloat16 where the device has fast bf16 (else float32),
    torch's "original" lr adjustment sqrt(max(1, rows / cols)) and decoupled weight decay
    ``train.muon_weight_decay`` (the parameter x (1 - lr x decay) each step), over
    :func:`muon_param_names`; AdamW as above over the rest. The defaults (lr 0.02, decay 0.01,
    momentum 0.95) are those of Keller Jordan's Muon README; 0.02 x 0.01 shrinks a matrix per
    step as much as AdamW's default 2e-3 x 0.1. torch's own default lr, 1e-3, is not used."""
    if cfg.optimizer != "muon":
        return _adamw(param_groups(model, cfg.weight_decay), cfg)
    params = dict(model.named_parameters())
    hidden = [params[n] for n in muon_param_names(model)]
    fast_bf16 = not hidden or has_fast_bf16(hidden[0].device)
    muon = GroupedMuon(
        [{"params": hidden, "base_lr": cfg.muon_lr}],
        ns_dtype=torch.bfloat16 if fast_bf16 else torch.float32,
        lr=cfg.muon_lr,
        weight_decay=cfg.muon_weight_decay,
        momentum=cfg.muon_momentum,
        nesterov=True,
    )
    rest = _adamw(param_groups(model, cfg.weight_decay, {id(p) for p in hidden}), cfg)
    return MuonWithAdamW(muon, rest)


def set_lr(optimizer: torch.optim.Optimizer, step: int, cfg: TrainConfig) -> float:
    """Set every group's lr for optimizer step ``step``; return the schedule's lr
    (:func:`lr_at`). A group with ``base_lr`` (Muon's) gets base_lr * lr_at / train.lr: the
    schedule's factor, the same as AdamW's groups."""
    lr = lr_at(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * (lr / cfg.lr) if "base_lr" in group else lr
    return lr


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based) under ``train.schedule`` (cosine:
    :func:`cosine_lr_at`; wsd: :func:`wsd_lr_at`)."""
    if cfg.schedule == "wsd":
        return wsd_lr_at(step, cfg)
    return cosine_lr_at(step, cfg)


def cosine_lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of a run with D = ``lr_decay_steps``
    (default ``max_steps``) decay steps and W = ``warmup_steps``.

    Linear warmup lr * (s + 1) / W for s < W, so step W - 1 is the one step at the peak ``lr``
    (step 0 when W = 0); then a cosine from the peak down to ``min_lr``, reached exactly at the
    last step D - 1; ``min_lr`` after it (an extended run). When W >= D the warmup fills the run
    and ``min_lr`` follows it.
    """
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    peak = max(cfg.warmup_steps - 1, 0)  # the step at full lr
    last = decay_steps - 1  # the step at min_lr
    if step >= last:
        return cfg.min_lr
    progress = (step - peak) / (last - peak)  # 0 at the peak, 1 at the last step
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def wsd_lr_at(step: int, cfg: TrainConfig) -> float:
    """Warmup-stable-decay (Hu et al. 2024, MiniCPM; Hägele et al. 2024, "Scaling Laws and
    Compute-Optimal Training Beyond Fixed Training Durations") for step ``step`` (0-based) of a
    run of D = ``lr_decay_steps`` (default ``max_steps``) steps, W = ``warmup_steps``.

    Warmup lr * (s + 1) / W for s < W (as the cosine's); then ``lr`` held; then the last
    N = max(1, round(``decay_fraction`` * D)) steps, from step E = D - N to the last step
    D - 1, decay from ``lr`` (the step before E) to ``min_lr`` (at D - 1): progress
    x = (s - E + 1) / N, lr = min_lr + (lr - min_lr) * f(x) with f(x) = 1 - x (linear) or
    1 - sqrt(x) (sqrt, Hägele et al.'s "1-sqrt"). ``min_lr`` after D - 1. As in the cosine,
    at least one step is at the peak ``lr`` (W - 1; step 0 when W = 0) before the decay: a
    decay that would start earlier starts after it, E = max(D - N, W, 1)."""
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    last = decay_steps - 1
    if step >= last:
        return cfg.min_lr
    n = max(1, round(cfg.decay_fraction * decay_steps))
    start = max(decay_steps - n, cfg.warmup_steps, 1)  # the first step below lr
    if step < start:
        return cfg.lr
    x = (step - start + 1) / (last - start + 1)  # (0, 1]: 1 at the last step
    f = 1.0 - (math.sqrt(x) if cfg.decay_shape == "sqrt" else x)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * f
