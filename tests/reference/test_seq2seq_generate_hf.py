"""`lmlab generate --source` on a Hugging Face T5 folder (tiny config, random weights, nothing
downloaded; a character tokenizer.json saved beside it) prints what HF's own greedy
``generate`` produces for that source."""

from __future__ import annotations

import string

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenizers import Regex, decoders, models, pre_tokenizers  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

from lmlab.cli import main  # noqa: E402
from tests.helpers import hf_config, redraw  # noqa: E402

SYMBOLS = string.ascii_letters + "0123456"  # 59 characters + <pad> + </s> = 61 tokens


def _tokenizer() -> HFTokenizer:
    vocab = {"<pad>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(SYMBOLS)}}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<pad>", "</s>"])
    return tok


def test_generate_source_on_a_t5_folder_equals_hf_generate(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = hf_config("t5", feed_forward_proj="relu", tie_word_embeddings=True)
    hf_model = redraw(transformers.T5ForConditionalGeneration(cfg))
    hf_model.save_pretrained(tmp_path)
    _tokenizer().save(str(tmp_path / "tokenizer.json"))
    for source in ("abcXYZ", "Hello0123"):
        ids = torch.tensor([[SYMBOLS.index(c) + 2 for c in source]])
        with torch.no_grad():
            ref = hf_model.generate(input_ids=ids, do_sample=False, num_beams=1, max_new_tokens=10)
        row = ref[0, 1:].tolist()
        row = row[: row.index(1)] if 1 in row else row
        expected = "".join("<pad>" if i == 0 else SYMBOLS[i - 2] for i in row)
        code = main(
            ["generate", str(tmp_path), "--source", source, "--temperature", "0",
             "--max-new-tokens", "10", "--device", "cpu"]
        )  # fmt: skip
        out, err = capsys.readouterr()
        assert code == 0, err
        assert out == expected + "\n" and expected
