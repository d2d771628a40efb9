"""The contract every registered variant keeps, as checks on one model config.

``lmlab verify --plugin`` and the generated tests in ``tests/contract/`` run these on tiny models
(float32, random weights, random token ids x (B=2, T=14)); each check returns a pass / FAIL /
skip row with a one-line reason (:class:`lmlab.analysis.verify.Check`):

- causality: changing tokens t.. never changes the logits before t, and does change those from t
  (decoders and encoder-decoders whose mask is causal, i.e. no query sees a later key);
- kv_cache: prefill 5 tokens, then one at a time, through the model's cache == the full pass;
- chunked_prefill: prefill 5, then chunks of 3, then one at a time == the full pass;
- padding: a left-padded row, its positions taken from the mask
  (:func:`lmlab.nn.masks.position_ids_from_attention_mask`), gives the logits it gives alone
  (an encoder-decoder: a right-padded source with its mask, the encoder's positions being fixed);
- gradients: one backward pass gives every parameter a finite gradient;
- state_dict: safetensors save + load into a fresh model gives equal logits;
- yaml: the run config written as YAML and read back is equal;
- params: the parameter count of the model built on the meta device == the built model's
  (distinct parameters: tied weights once);
- cache_bytes: :func:`lmlab.analysis.costs.kv_cache_bytes` (batch, context) == what the cache
  holds while decoding the last token (its tensors after the step, or the keys/values the step
  read when more: a sliding window keeps window - 1 and reads them with the new one);
- training_memory: :func:`lmlab.training.memory.estimate_training_memory`'s activation term
  within 0.85-1.15x of the bytes autograd saves for backward in one fp32 training forward pass
  plus the float32 logits gradient backward starts with (the band and measurement of
  tests/unit/test_memory.py; decoders only: the estimate counts a decoder's layers).

A row is FAIL, never an exception, when a component raises: its reason is the last line.

The tiny configs come from :func:`tiny_run_config`; :func:`cases` lists every registry's
variants x their declared ``examples`` x the model kinds whose validation accepts them.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmlab.analysis import verify
from lmlab.analysis.costs import kv_cache_bytes
from lmlab.analysis.verify import ATOL, Check, _call, _max_diff, _model
from lmlab.config import RunConfig, TrainConfig, config_from_dict, config_to_yaml, load_config
from lmlab.errors import ConfigError, LmlabError
from lmlab.models.counting import num_params
from lmlab.nn.masks import MASKS, position_ids_from_attention_mask
from lmlab.training.memory import count_parameters, estimate_training_memory

BATCH, SEQ, PREFILL, CHUNK, PAD = 2, 14, 5, 3, 3  # sequences, tokens, prefill, chunk, padding
MEMORY_BAND = (0.85, 1.15)  # estimated / saved activation bytes (tests/unit/test_memory.py)

TINY: dict[str, Any] = {
    "name": "contract",
    "model": {
        "d_model": 32,
        "n_layers": 2,
        "max_seq_len": 32,
        "vocab_size": 37,
        "dropout": 0.0,
        "attention": {"n_heads": 4},
    },
    "train": {"precision": "fp32", "device": "cpu"},
}
# run-level overrides a model kind needs besides its name (an encoder is trained by mlm, which
# needs a [MASK] token, and attends both ways)
KIND_BASE: dict[str, dict[str, Any]] = {
    "encoder": {
        "model": {"attention": {"mask": "bidirectional"}},
        "data": {"tokenizer": {"kind": "wordlevel", "vocab_size": 512}},
    },
}

Result = tuple[bool | None, str]


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` with the nested mapping ``over`` merged in (a copy; ``over`` wins)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def nested(field: str, value: Any) -> dict[str, Any]:
    """``model.position.kind``, ``"rope"`` -> model overrides ``{"position": {"kind": "rope"}}``."""
    parts = field.split(".")[1:]
    out: dict[str, Any] = {parts[-1]: value}
    for part in reversed(parts[:-1]):
        out = {part: out}
    return out


def tiny_run_config(kind: str, model: dict[str, Any]) -> RunConfig:
    """The tiny run config of model kind ``kind`` with ``model`` overrides, validated.

    Raises ConfigError when the kind does not accept the overrides."""
    data = merge(merge(TINY, KIND_BASE.get(kind, {})), {"model": {"kind": kind}})
    return config_from_dict(merge(data, {"model": model})).validate()


# ----------------------------------------------------------------------------- the checks


def _is_causal(run: RunConfig) -> bool:
    """Whether the configured mask lets no query see a later key (checked on the mask itself)."""
    a = run.model.attention
    mask = MASKS.get(a.mask, "model.attention.mask")(SEQ, SEQ, None, a.window)
    return not bool(torch.triu(mask, diagonal=1).any())


def _needs_causal(run: RunConfig, what: str) -> Result | None:
    if run.model.kind == "encoder":
        return None, f"an encoder reads the whole sequence at once: no {what}"
    if not _is_causal(run):
        return None, f"model.attention.mask={run.model.attention.mask} lets a query see later keys"
    return None


def check_causality(run: RunConfig, x: torch.Tensor) -> Result:
    return _needs_causal(run, "causal order") or verify.check_causality(run.model, x)


def check_kv_cache(run: RunConfig, x: torch.Tensor) -> Result:
    sizes = [PREFILL] + [1] * (x.shape[1] - PREFILL)
    return _needs_causal(run, "KV cache") or verify.check_kv_cache(run.model, x, sizes)


def chunk_sizes(t: int) -> list[int]:
    """Prefill PREFILL tokens, then chunks of CHUNK while two fit, then one at a time (sum t)."""
    sizes = [PREFILL]
    while sum(sizes) + 2 * CHUNK <= t:
        sizes.append(CHUNK)
    return sizes + [1] * (t - sum(sizes))


def check_chunked_prefill(run: RunConfig, x: torch.Tensor) -> Result:
    sizes = chunk_sizes(x.shape[1])
    return _needs_causal(run, "KV cache") or verify.check_kv_cache(run.model, x, sizes)


def check_padding(run: RunConfig, x: torch.Tensor) -> Result:
    cfg = run.model
    model = _model(cfg)
    t = x.shape[1]
    ids, mask = x.clone(), torch.ones_like(x)
    with torch.no_grad():
        if cfg.kind == "encoder_decoder":  # pad the source on the right; decoder input unchanged
            ids[1, t - PAD :], mask[1, t - PAD :] = 0, 0
            got = model(ids, attention_mask=mask, decoder_input_ids=x).logits[1]
            alone = model(x[1:, : t - PAD], decoder_input_ids=x[1:]).logits[0]
            where = f"a source right-padded by {PAD}"
        else:
            ids[1, :PAD], mask[1, :PAD] = 0, 0
            positions = position_ids_from_attention_mask(mask)
            out = model(ids, attention_mask=mask, position_ids=positions).logits
            got = out[1, PAD:]
            alone = model(x[1:, PAD:]).logits[0]
            where = f"a row left-padded by {PAD}"
            full = model(x[:1]).logits[0]  # the unpadded row of the batch, too
            alone, got = torch.cat([alone, full]), torch.cat([got, out[0]])
    d = _max_diff(got, alone)
    return d <= ATOL, f"{where} vs alone: max |diff| {d:.1e}"


def check_gradients(run: RunConfig, x: torch.Tensor) -> Result:
    return verify.check_gradients(run.model, x)


def check_state_dict(run: RunConfig, x: torch.Tensor) -> Result:
    return verify.check_state_dict(run.model, x)


def check_yaml(run: RunConfig, x: torch.Tensor) -> Result:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(config_to_yaml(run))
        back = load_config(path)
    if back != run:
        diff = [k for k in vars(back.model) if getattr(back.model, k) != getattr(run.model, k)]
        return False, f"the config read back differs (model fields: {', '.join(diff) or '-'})"
    return True, "written as YAML and read back: equal"


def check_params(run: RunConfig, x: torch.Tensor) -> Result:
    meta, built = count_parameters(run), num_params(_model(run.model))
    return meta == built, f"meta-device build {meta:,}, built model {built:,} parameters"


def _held_while_decoding(model: torch.nn.Module, cfg: Any, x: torch.Tensor) -> int:
    """Bytes the cache holds while decoding x's last token (see the module docstring)."""
    _, cache = verify.decode_in_steps(model, cfg, x[:, :-1], [x.shape[1] - 1], x)
    read: list[int] = []
    for layer in cache.layers:  # record the keys/values each layer's last update hands back
        update = layer.update

        def spy(*a: Any, _update: Callable[..., Any] = update) -> Any:
            out = _update(*a)
            tensors = out if isinstance(out, tuple) else ()
            read.append(sum(t.numel() * t.element_size() for t in tensors))
            return out

        layer.update = spy
    with torch.no_grad():
        _call(model, cfg, x[:, -1:], source=x, cache=cache)
    cross = sum(c.nbytes() for c in getattr(cache, "cross", []))
    return max(cache.nbytes(), sum(read) + cross)


def check_cache_bytes(run: RunConfig, x: torch.Tensor) -> Result:
    cfg = run.model
    b, t = x.shape
    declared = kv_cache_bytes(cfg, b, t)
    if cfg.kind == "encoder":
        return declared == 0, f"an encoder has no KV cache: declared {declared} bytes"
    held = _held_while_decoding(_model(cfg), cfg, x)
    return declared == held, f"declared {declared:,} bytes, held {held:,} (batch {b}, {t} tokens)"


def saved_activation_bytes(model: torch.nn.Module, cfg: Any, x: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for backward in one training forward pass of x,
    the parameters (the weights' own term) excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and tuple(t.shape) not in shapes:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _call(model.train(), cfg, x, targets=x)
    return sum(seen.values())


def check_training_memory(run: RunConfig, x: torch.Tensor) -> Result:
    cfg = run.model
    if cfg.kind != "decoder":
        return None, f"the estimate counts a decoder's layers, not model.kind={cfg.kind}"
    b, t = x.shape
    train = TrainConfig(batch_size=b, seq_len=t, precision="fp32", device="cpu")
    estimate = estimate_training_memory(RunConfig(model=cfg, train=train)).activations
    # what autograd saves, plus the float32 logits gradient backward starts with (the formula's
    # (a + 8) V counts the logits, their log-probabilities and that gradient)
    saved = saved_activation_bytes(_model(cfg), cfg, x) + b * t * (cfg.vocab_size or 0) * 4
    ratio = estimate / max(saved, 1)
    low, high = MEMORY_BAND
    return low < ratio < high, (
        f"estimated activations {estimate:,} bytes = {ratio:.2f} x the {saved:,} measured "
        f"(band {low}-{high})"
    )


CHECKS: dict[str, Callable[[RunConfig, torch.Tensor], Result]] = {
    "causality": check_causality,
    "kv_cache": check_kv_cache,
    "chunked_prefill": check_chunked_prefill,
    "padding": check_padding,
    "gradients": check_gradients,
    "state_dict": check_state_dict,
    "yaml": check_yaml,
    "params": check_params,
    "cache_bytes": check_cache_bytes,
    "training_memory": check_training_memory,
}


def tokens(run: RunConfig, t: int = SEQ) -> torch.Tensor:
    """The (BATCH, t) random token ids every check reads (seeded: the same ids each call)."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, run.model.vocab_size or 2, (BATCH, t), generator=g)


def run_check(name: str, run: RunConfig, label: str = "") -> Check:
    """One check of :data:`CHECKS` on ``run``; an LmlabError or a bug in a component is a FAIL
    whose reason is the exception's last line."""
    run = copy.deepcopy(run)
    run.model.dropout = run.model.attention.dropout = 0.0
    t = min(SEQ, run.model.max_seq_len)
    try:
        ok, detail = CHECKS[name](run, tokens(run, t))
    except (LmlabError, Exception) as e:  # a broken component must give a row, not a crash
        text = str(e).strip().splitlines()
        ok, detail = False, f"{type(e).__name__}: {text[-1] if text else ''}"
    status = "skip" if ok is None else ("pass" if ok else "FAIL")
    return Check(label, name, status, detail)


def run_contract(run: RunConfig, label: str = "") -> list[Check]:
    """Every check of the contract on ``run.model`` (vocab_size must be set)."""
    return [run_check(name, run, label) for name in CHECKS]


# ----------------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class Case:
    """One variant example on one model kind: ``label`` reads family=name[i]/kind."""

    label: str
    kind: str
    model: dict[str, Any]  # the model overrides, the variant's own name included

    def config(self) -> RunConfig:
        return tiny_run_config(self.kind, self.model)


def example_cases(registry: Any, name: str, kinds: list[str]) -> list[tuple[list[Case], str]]:
    """Per declared example of a variant: (its cases on the model kinds accepting it, the
    first kind's ConfigError, "" when some kind accepts it)."""
    out = []
    for i, example in enumerate(registry.contract(name).examples):
        model = merge(example, nested(registry.field, name))
        found, refused = [], ""
        for kind in kinds:
            try:
                run = tiny_run_config(kind, model)
            except ConfigError as e:
                refused = refused or f"{kind}: {e}"
                continue  # this kind does not accept the example
            if run.model.kind == kind:  # an example naming another kind is that kind's case
                found.append(Case(f"{registry.family}={name}[{i}]/{kind}", kind, model))
        out.append((found, "" if found else refused))
    return out


def variant_cases(registry: Any, name: str, kinds: list[str]) -> Iterator[Case]:
    """The cases of one variant: its declared examples x the model kinds accepting each."""
    for found, _ in example_cases(registry, name, kinds):
        yield from found


def cases(only: set[tuple[str, str]] | None = None) -> list[Case]:
    """Every registry with a ``model.*`` field x its variants (or the (family, name) pairs of
    ``only``) x their examples x accepting model kinds; cases giving the same config once."""
    import lmlab.models  # noqa: F401  (registers every component and model kind)
    import lmlab.models.init  # noqa: F401
    from lmlab.models.build import MODELS
    from lmlab.registry import families

    kinds = MODELS.names()
    out, seen = [], set()
    for family, registry in families().items():
        if not (registry.field or "").startswith("model."):
            continue
        for name in registry.names():
            if only is not None and (family, name) not in only:
                continue
            for case in variant_cases(registry, name, kinds):
                key = config_to_yaml(case.config())
                if key not in seen:
                    seen.add(key)
                    out.append(case)
    return out


def verify_plugin(config: str | None, registered: list[tuple[Any, str]]) -> list[Check]:
    """``lmlab verify --plugin``: the contract on ``config`` (a YAML path; vocab 37 if unset)
    and on every example x accepting model kind of each plugin variant in ``registered``."""
    from lmlab.models.build import MODELS

    rows = []
    if config is not None:
        run = load_config(config)
        run.model.vocab_size = run.model.vocab_size or TINY["model"]["vocab_size"]
        rows += run_contract(run, Path(config).stem)
    for registry, name in registered:
        for i, (found, refused) in enumerate(example_cases(registry, name, MODELS.names())):
            if refused:
                label = f"{registry.family}={name}[{i}]"
                rows.append(
                    Check(label, "examples", "FAIL", f"no model kind accepts it: {refused}")
                )
            for case in found:
                rows += run_contract(case.config(), case.label)
    return rows
