"""``lmlab verify``: run the correctness proofs on a user's own model configuration.

For a config (or every shipped preset), with random weights (the residual projections too,
which ``model.init_zero_residual`` would zero) and random token ids:

- causality: changing tokens t+1.. never changes the logits at positions <= t;
- kv_cache: incremental cached decoding equals the full forward pass;
- gradients: one backward pass gives finite gradients for every parameter;
- state_dict: weights saved with safetensors and loaded into a fresh model give equal logits;
- reference: where lmlab's config has an exact Hugging Face counterpart (``lmlab list
  hf_family``) and ``transformers`` is installed, a reference model built from the equivalent
  config with random weights, converted into lmlab, gives equal logits (float32, 1e-5).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model
from torch import nn

from lmlab.config import ModelConfig, RunConfig, load_config
from lmlab.errors import LmlabError
from lmlab.interop.families import HF_FAMILIES, NotRepresentable
from lmlab.models.build import build_model

ATOL = 1e-5
CONFIGS_DIR = Path(__file__).resolve().parents[3] / "configs"


@dataclass
class Check:
    """One proof's outcome: status is pass, FAIL or skip."""

    config: str
    name: str
    status: str
    detail: str


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _model(cfg: ModelConfig, seed: int = 0) -> nn.Module:
    """The model of ``cfg`` with random weights, its residual projections random too: under
    ``model.init_zero_residual`` they start at zero, every block adds nothing, and causality
    and the KV cache would pass whatever the attention computes."""
    torch.manual_seed(seed)
    if cfg.init_zero_residual:
        cfg = dataclasses.replace(cfg, init_zero_residual=False)
    return build_model(cfg).eval()


def _call(model: nn.Module, cfg: ModelConfig, tokens: torch.Tensor, **kw: Any) -> Any:
    """``model(tokens)``; an encoder-decoder reads the random ``source`` (default: ``tokens``)
    and gets ``tokens`` as its decoder input (with a filled cache the source is not re-read)."""
    source = kw.pop("source", None)
    if cfg.kind != "encoder_decoder":
        return model(tokens, **kw)
    return model(tokens if source is None else source, decoder_input_ids=tokens, **kw)


def check_causality(cfg: ModelConfig, x: torch.Tensor) -> tuple[bool | None, str]:
    if cfg.kind == "encoder":
        return None, "an encoder attends both ways by design (model.attention.mask=bidirectional)"
    model = _model(cfg)
    t = x.shape[1] // 2
    y = x.clone()
    y[:, t:] = torch.randint(0, cfg.vocab_size or 2, y[:, t:].shape)
    with torch.no_grad():  # an encoder-decoder keeps its source x: only the decoder input changes
        a, b = _call(model, cfg, x, source=x).logits, _call(model, cfg, y, source=x).logits
    d = _max_diff(a[:, :t], b[:, :t])
    if d <= ATOL and _max_diff(a[:, t:], b[:, t:]) <= ATOL:  # a model that ignores its input
        return False, f"the logits at positions >= {t} do not depend on the tokens there"
    return d <= ATOL, f"max |change| at positions < {t}: {d:.1e}"


def decode_in_steps(
    model: nn.Module,
    cfg: ModelConfig,
    x: torch.Tensor,
    sizes: list[int],
    source: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Any]:
    """Feed x (B, T) through one cache in steps of ``sizes`` tokens (summing to T; an
    encoder-decoder reads ``source``, default x, on the first). Returns (logits (B, T, V), the
    cache)."""
    cache = model.new_cache()  # type: ignore[operator]
    parts, start = [], 0
    source = x if source is None else source
    with torch.no_grad():
        for n in sizes:
            step = x[:, start : start + n]
            parts.append(_call(model, cfg, step, source=source, cache=cache).logits)
            start += n
    return torch.cat(parts, 1), cache


def check_kv_cache(
    cfg: ModelConfig, x: torch.Tensor, sizes: list[int] | None = None
) -> tuple[bool | None, str]:
    """Cached decoding in steps of ``sizes`` tokens (default: half of x, then one at a time)
    equals the full forward pass, and the cache has seen every token."""
    if cfg.kind == "encoder":
        return None, "an encoder reads the whole sequence at once: it has no KV cache"
    model = _model(cfg)
    t = x.shape[1]
    sizes = sizes or [t // 2] + [1] * (t - t // 2)
    with torch.no_grad():
        full = _call(model, cfg, x, source=x).logits
    steps, cache = decode_in_steps(model, cfg, x, sizes)
    d = _max_diff(steps, full)
    if cache.seq_len != t:
        return False, f"the cache has seen {cache.seq_len} tokens after {t}"
    return d <= ATOL, f"max |cached - full| in steps {sizes[:4]}...: {d:.1e}"


def check_gradients(cfg: ModelConfig, x: torch.Tensor) -> tuple[bool, str]:
    model = _model(cfg).train()
    out = _call(model, cfg, x, targets=x, output_hidden_states=True)
    loss = out.loss
    if getattr(model, "pooler", None) is not None:  # BERT's pooler is off the MLM loss path
        loss = loss + model.pool(out.hidden_states[-1]).sum()  # type: ignore[operator]
    loss.backward()
    bad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.isfinite().all()]
    return not bad, f"{len(bad)} parameters without a finite gradient" + (
        f": {bad[0]}" if bad else ""
    )


def check_state_dict(cfg: ModelConfig, x: torch.Tensor) -> tuple[bool, str]:
    model, other = _model(cfg, 0), _model(cfg, 1)
    with tempfile.TemporaryDirectory() as tmp:
        save_model(model, f"{tmp}/m.safetensors")
        load_model(other, f"{tmp}/m.safetensors")
    with torch.no_grad():
        d = _max_diff(_call(model, cfg, x).logits, _call(other, cfg, x).logits)
    return d == 0.0, f"max |reloaded - original|: {d:.1e}"


def check_reference(cfg: ModelConfig, x: torch.Tensor) -> tuple[bool | None, str]:
    """None when there is no reference (no matching family, or transformers is missing)."""
    reasons = []
    for name in HF_FAMILIES.names():
        family = HF_FAMILIES.get(name)
        if family.model_kind != cfg.kind:
            continue
        if family.from_config is None:  # its folders load into lmlab; no config the other way
            reasons.append(f"{name}: lmlab reads its Hugging Face folders, but writes no config")
            continue
        try:
            kwargs = family.from_config(cfg)
        except NotRepresentable as e:
            reasons.append(str(e))
            continue
        try:
            transformers = importlib.import_module("transformers")
        except ImportError:
            return None, "transformers is not installed (pip install 'lmlab[test]')"
        torch.manual_seed(0)
        hf_cfg = getattr(transformers, family.hf_config_class)(**kwargs)
        hf_model = getattr(transformers, family.hf_class)(hf_cfg).eval()
        with torch.no_grad():  # move norm weights and biases off their 1 / 0 initial values
            for p in hf_model.parameters():
                if p.ndim == 1:
                    p.add_(torch.randn_like(p) * 0.1)
        ours_cfg = family.to_config(hf_cfg)
        ours = build_model(ours_cfg).eval()
        ours.load_state_dict(family.to_state(hf_model.state_dict(), ours_cfg), strict=True)
        with torch.no_grad():
            if cfg.kind == "encoder_decoder":
                ref = hf_model(input_ids=x, decoder_input_ids=x).logits
            else:
                ref = hf_model(x).logits
            d = _max_diff(_call(ours, ours_cfg, x).logits, ref)
        return d <= ATOL, f"vs transformers {family.hf_class}: max |diff| {d:.1e}"
    return None, "no Hugging Face counterpart (" + "; ".join(reasons[:2]) + ")"


CHECKS = {
    "causality": check_causality,
    "kv_cache": check_kv_cache,
    "gradients": check_gradients,
    "state_dict": check_state_dict,
    "reference": check_reference,
}


def verify_config(cfg: RunConfig, label: str, seq_len: int = 16) -> list[Check]:
    """Run every check on ``cfg.model`` (float32, random weights; vocab 256 if unset)."""
    mcfg = copy.deepcopy(cfg.model)
    mcfg.vocab_size = mcfg.vocab_size or 256
    mcfg.dropout = 0.0
    if mcfg.kind == "encoder_decoder":  # ids for teacher forcing; any in-vocabulary ids do
        s = mcfg.seq2seq
        s.pad_token_id = 0 if s.pad_token_id is None else s.pad_token_id
        s.decoder_start_token_id = (
            s.pad_token_id if s.decoder_start_token_id is None else (s.decoder_start_token_id)
        )
    # longer than a sliding window, so the window is in play
    t = min(max(seq_len, (mcfg.attention.window or 0) + 8), mcfg.max_seq_len)
    torch.manual_seed(1234)
    x = torch.randint(0, mcfg.vocab_size, (2, t))
    out = []
    for name, fn in CHECKS.items():
        try:
            ok, detail = fn(mcfg, x)
        except LmlabError as e:
            ok, detail = False, str(e)
        status = "skip" if ok is None else ("pass" if ok else "FAIL")
        out.append(Check(label, name, status, detail))
    return out


def verify(config: str | None = None) -> list[Check]:
    """Verify one config file, or every shipped preset in ``configs/`` when None."""
    if config is not None:
        return verify_config(load_config(config), Path(config).stem)
    files = sorted(CONFIGS_DIR.glob("*.yaml"))
    if not files:
        raise LmlabError(f"no presets found in {CONFIGS_DIR}; give --config FILE")
    return [c for f in files for c in verify_config(load_config(f), f.stem)]


def format_table(checks: list[Check]) -> str:
    """A plain-text table: config, check, status, detail."""
    w = max([len("config")] + [len(c.config) for c in checks])
    n = max([10] + [len(c.name) for c in checks])
    lines = [f"{'config':<{w}}  {'check':<{n}}  {'result':<6}  detail"]
    lines += [f"{c.config:<{w}}  {c.name:<{n}}  {c.status:<6}  {c.detail}" for c in checks]
    return "\n".join(lines)
