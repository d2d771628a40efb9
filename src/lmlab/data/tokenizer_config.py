"""``tokenizer_config.json`` beside a ``tokenizer.json``: a chat model's template and specials.

A pretrained chat model's tokenizer carries more than ``tokenizer.json`` holds: its Jinja chat
template, which spellings are its bos / eos / pad tokens (for a ChatML model the eos is the
end-of-turn ``<|im_end|>``, not ``<|endoftext|>``), and every id that ends a reply. lmlab keeps
them as Hugging Face does, so the same folder works in both:

- ``tokenizer_config.json``: ``chat_template`` (Jinja source), ``bos_token``, ``eos_token``,
  ``pad_token`` (a token's text, or ``{"content": text}``);
- ``generation_config.json``: ``eos_token_id``, an id or a list of ids; every one ends
  generation (``stop_ids``), as in ``transformers``.

:func:`save_tokenizer` writes them (with ``tokenizer.json``) for a tokenizer that carries a
template or its own specials (a GGUF model's, or one read with them); lmlab's own char / bpe /
wordlevel tokenizers get ``tokenizer.json`` alone, as before. :func:`apply_tokenizer_config`
reads them back onto a loaded tokenizer. Both files are untrusted: bounded reads
(:mod:`lmlab.safeio`), every field type-checked, a token not in the vocabulary refused, naming
the file and field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmlab.data.tokenizer import Tokenizer
from lmlab.errors import DataError
from lmlab.safeio import read_json_object

CONFIG_FILE = "tokenizer_config.json"
GENERATION_FILE = "generation_config.json"
MAX_TEMPLATE_CHARS = 1 << 20  # a chat template longer than 1 Mi characters is refused
ROLES = ("bos", "eos", "pad")


def carries_chat_spec(tokenizer: Tokenizer) -> bool:
    """Whether ``tokenizer`` has a chat template or its own specials to keep (``stop_ids``):
    a GGUF model's tokenizer, or one loaded with a tokenizer_config.json."""
    return bool(getattr(tokenizer, "chat_template", None)) or (
        getattr(tokenizer, "stop_ids", None) is not None
    )


def spelling(tokenizer: Tokenizer, token_id: int) -> str:
    """The text of token ``token_id`` as it appears in a template (``<|im_end|>``)."""
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        return str(hf.id_to_token(token_id))
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def tokenizer_config_json(tokenizer: Tokenizer, max_len: int | None = None) -> dict[str, Any]:
    """The ``tokenizer_config.json`` of ``tokenizer`` in Hugging Face's layout
    (``PreTrainedTokenizerFast``, so ``AutoTokenizer`` loads it and ``apply_chat_template``
    renders its template): its bos / eos / pad spellings and chat template where it has them."""
    spec: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }
    if max_len is not None:
        spec["model_max_length"] = max_len
    for role in ROLES:
        token_id = tokenizer.eos_id if role == "eos" else tokenizer.special_id(role)
        if token_id is not None:
            spec[f"{role}_token"] = spelling(tokenizer, token_id)
    template = getattr(tokenizer, "chat_template", None)
    if template:
        spec["chat_template"] = str(template)
    return spec


def generation_config_json(tokenizer: Tokenizer) -> dict[str, Any] | None:
    """``generation_config.json``: ``eos_token_id`` (one id, or the sorted list of every stop
    id when there are several) and ``bos_token_id``; None without an end token."""
    stops = sorted(set(getattr(tokenizer, "stop_ids", None) or ()) | _set(tokenizer.eos_id))
    if not stops:
        return None
    eos: int | list[int] = stops[0] if len(stops) == 1 else stops
    return {"eos_token_id": eos, "bos_token_id": tokenizer.bos_id, "pad_token_id": None}


def save_tokenizer(tokenizer: Tokenizer, folder: str | Path, max_len: int | None = None) -> None:
    """Write ``folder/tokenizer.json``, and, for a tokenizer that :func:`carries_chat_spec`,
    ``tokenizer_config.json`` and ``generation_config.json`` (see the module docstring)."""
    out = Path(folder)
    tokenizer.save(out / "tokenizer.json")
    if not carries_chat_spec(tokenizer):
        return
    _write_json(out / CONFIG_FILE, tokenizer_config_json(tokenizer, max_len))
    generation = generation_config_json(tokenizer)
    if generation is not None:
        _write_json(out / GENERATION_FILE, generation)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _set(value: int | None) -> set[int]:
    return set() if value is None else {value}


def apply_tokenizer_config(tokenizer: Tokenizer, folder: str | Path) -> Tokenizer:
    """Give ``tokenizer`` (just read from ``folder/tokenizer.json``) the chat template, specials
    and stop ids of ``folder``'s tokenizer_config.json and generation_config.json, where they
    exist (neither file: ``tokenizer`` unchanged). Sets ``chat_template`` (str or None),
    ``stop_ids`` (set of ids), ``bos_token`` / ``eos_token`` (text) and the bos / eos / pad
    roles. Raises DataError naming the file and field for a value of the wrong type, a template
    over 1 Mi characters or a token / id outside the vocabulary."""
    base = Path(folder)
    path = base / CONFIG_FILE
    if not path.exists() and not path.is_symlink():
        return tokenizer
    raw = read_json_object(path, "tokenizer config", error=DataError)
    roles = dict(tokenizer.roles)
    for role in ROLES:
        if raw.get(f"{role}_token") is not None:
            roles[role] = _token_id(tokenizer, raw[f"{role}_token"], path, f"{role}_token")
    tokenizer.roles = roles
    template = _template(raw.get("chat_template"), path)
    stops = _set(roles.get("eos")) | _generation_stops(tokenizer, base / GENERATION_FILE)
    fields = {
        "chat_template": template,
        "stop_ids": stops,
        "bos_token": "" if "bos" not in roles else spelling(tokenizer, roles["bos"]),
        "eos_token": "" if "eos" not in roles else spelling(tokenizer, roles["eos"]),
    }
    for name, value in fields.items():
        setattr(tokenizer, name, value)
    return tokenizer


def _token_id(tokenizer: Tokenizer, value: Any, path: Path, field: str) -> int:
    """The id of a special token given as its text or as ``{"content": text}``."""
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str) or not value:
        raise DataError(f"{path}: {field} must be a token's text, got {value!r:.80}")
    hf = getattr(tokenizer, "hf", None)
    token_id = hf.token_to_id(value) if hf is not None else None
    if token_id is None and hf is None:  # a char vocabulary: the text must be one character
        try:
            ids = tokenizer.encode(value)
        except DataError:
            ids = []
        token_id = ids[0] if len(ids) == 1 else None
    if token_id is None:
        raise DataError(f"{path}: {field} {value!r:.80} is not a token of tokenizer.json")
    return int(token_id)


def _template(value: Any, path: Path) -> str | None:
    """``chat_template``: a string, or Hugging Face's list of ``{"name", "template"}`` (the one
    named ``default``, else the first)."""
    if isinstance(value, list) and value:
        named = [t for t in value if isinstance(t, dict) and t.get("name") == "default"]
        value = (named or value)[0]
        value = value.get("template") if isinstance(value, dict) else value
    if value is None:
        return None
    if not isinstance(value, str):
        raise DataError(f"{path}: chat_template must be a string, got {type(value).__name__}")
    if len(value) > MAX_TEMPLATE_CHARS:
        raise DataError(
            f"{path}: chat_template has {len(value)} characters, more than {MAX_TEMPLATE_CHARS}"
        )
    return value or None


def _generation_stops(tokenizer: Tokenizer, path: Path) -> set[int]:
    """The ids ``generation_config.json``'s ``eos_token_id`` names (an id or a list)."""
    if not path.exists() and not path.is_symlink():
        return set()
    value = read_json_object(path, "generation config", error=DataError).get("eos_token_id")
    values = value if isinstance(value, list) else [] if value is None else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < tokenizer.vocab_size:
            raise DataError(
                f"{path}: eos_token_id must be ids in 0..{tokenizer.vocab_size - 1}, got {v!r:.80}"
            )
    return set(values)
