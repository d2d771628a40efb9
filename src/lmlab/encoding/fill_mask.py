"""Fill-mask: the most likely tokens at each mask position of a text, with probabilities
(the masked-LM task of Devlin et al. 2019)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from lmlab.encoding.common import encode_batch, load_encoder
from lmlab.errors import LmlabError

GENERIC_MASK = "[MASK]"


@dataclass
class Fill:
    """One candidate for one mask: the token's text, its probability (softmax over the whole
    vocabulary at that position) and the text with the mask replaced by it."""

    token: str
    probability: float
    text: str


@torch.no_grad()
def fill_mask(
    path: str | Path, text: str, top_k: int = 5, device: str = "auto"
) -> list[list[Fill]]:
    """For each mask in ``text`` (in order), its ``top_k`` most likely fills (special tokens
    excluded). The mask may be spelled as the tokenizer spells it or as ``[MASK]``.

    Raises LmlabError for a path that is not an encoder with a masked-LM head, a text without a
    mask, a text longer than the context, or top_k < 1."""
    if top_k < 1:
        raise LmlabError(f"--top-k must be >= 1, got {top_k}")
    model, tokenizer = load_encoder(path, "fill-mask", device)
    if getattr(model, "lm_head", None) is None:
        raise LmlabError(
            f"{path} has no masked-LM head (model.mlm_head=false, e.g. a sentence-embedding "
            "model), so it cannot fill masks"
        )
    spelling = tokenizer.mask_token()
    if spelling is None or tokenizer.mask_id is None:
        raise LmlabError(f"the tokenizer of {path} has no mask token")
    if spelling != GENERIC_MASK:
        text = text.replace(GENERIC_MASK, spelling)
    if spelling not in text:
        also = f" (or {GENERIC_MASK})" if spelling != GENERIC_MASK else ""
        raise LmlabError(f"the text has no mask token {spelling}{also} to fill")
    dev = next(model.parameters()).device
    ids, mask = encode_batch(tokenizer, [text], model.cfg.max_seq_len, dev)
    positions = (ids[0] == tokenizer.mask_id).nonzero().flatten().tolist()
    probs = torch.softmax(model(ids, attention_mask=mask).logits[0].float(), dim=-1)  # (T, V)
    special = sorted(tokenizer.special_ids())
    probs[:, special] = 0.0  # never propose [PAD], [CLS] ... as a fill
    plain = ids[0].tolist()
    frame = {tokenizer.cls_id, tokenizer.sep_id} - {None}
    out: list[list[Fill]] = []
    for pos in positions:
        p, top = probs[pos].topk(min(top_k, probs.size(-1)))
        fills = []
        for prob, tok in zip(p.tolist(), top.tolist(), strict=True):
            filled = [tok if i == pos else t for i, t in enumerate(plain)]
            filled = [t for t in filled if t not in frame]
            fills.append(Fill(tokenizer.decode([tok]), prob, tokenizer.decode(filled)))
        out.append(fills)
    return out
