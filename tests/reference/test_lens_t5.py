"""The logit lens of an encoder-decoder against Hugging Face T5: lmlab's lens rows are HF's own
final norm and head on HF's own decoder hidden states (lmlab.analysis.lens; the tiny random
models of tests/unit/test_lens_encdec.py check the rest)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmlab.analysis.lens import direct_logit_attribution, logit_lens
from lmlab.models import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def near(got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    assert got.shape == want.shape
    err = float((got.detach().double() - want.detach().double()).abs().max())
    assert err <= atol, f"max |difference| {err:.3g} > {atol}"


def test_a_hugging_face_t5s_lens_is_its_own_head_on_its_own_hidden_states():
    """A tiny random HF T5 (tied: the d_model**-0.5 rescale), converted: each lens row equals
    HF's final_layer_norm and lm_head (with its rescale) on HF's decoder_hidden_states, the last
    row HF's logits, to 1e-5; the attribution sums to HF's logit."""
    transformers = pytest.importorskip("transformers")
    from lmlab.interop.hf_t5 import t5_model_config, t5_state_dict
    from tests.helpers import hf_config, redraw

    torch.manual_seed(0)
    hf_cfg = hf_config("t5", feed_forward_proj="relu", tie_word_embeddings=True)
    hf = redraw(transformers.T5ForConditionalGeneration(hf_cfg))
    cfg = t5_model_config(hf_cfg)
    ours = build_model(cfg).eval()
    ours.load_state_dict(t5_state_dict(hf.state_dict(), cfg), strict=True)
    assert cfg.seq2seq.scale_decoder_output
    g = torch.Generator().manual_seed(3)
    src, dec = torch.randint(3, 60, (1, 8), generator=g), torch.randint(3, 60, (1, 5), generator=g)
    with torch.no_grad():
        out = hf(input_ids=src, decoder_input_ids=dec, output_hidden_states=True)
        hidden = out.decoder_hidden_states  # embed, after each layer (the last one normed)
        rows = [hf.lm_head(hf.decoder.final_layer_norm(h) * hf_cfg.d_model**-0.5)
                for h in hidden[:-1]] + [out.logits]  # fmt: skip
    lens = logit_lens(ours, dec, top_k=2, source_ids=src)
    assert lens.log_probs is not None and lens.log_probs.shape[1] == len(rows)
    for r, want in enumerate(rows):
        near(lens.log_probs[:, r], F.log_softmax(want, -1), 1e-5)
    target = int(out.logits[0, -1].argmax())
    d = direct_logit_attribution(ours, dec, target, source_ids=src)
    assert abs(d.total - float(out.logits[0, -1, target])) < 1e-4
