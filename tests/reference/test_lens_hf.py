"""The logit lens against Hugging Face: every intermediate row of lmlab's lens on a model loaded
from a tiny random GPT-2 / GPT-NeoX (parallel) / Llama folder equals HF's own hidden state put
through HF's final norm and head (``output_hidden_states``), to 1e-5; the attribution of a
logit sums to HF's logit. transformers builds the reference (random weights, nothing
downloaded)."""

from __future__ import annotations

import pytest
import torch

from lmlab.analysis.lens import direct_logit_attribution, logit_lens
from lmlab.interop.load import load
from tests.helpers import hf_config, perturb_vectors, write_hf_folder

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
FINAL_NORM = {"gpt2": "transformer.ln_f", "gpt_neox": "gpt_neox.final_layer_norm",
              "llama": "model.norm"}  # fmt: skip


@pytest.mark.parametrize("family", list(FINAL_NORM))
def test_each_lens_row_is_hfs_hidden_state_through_hfs_final_norm_and_head(family, tmp_path):
    torch.manual_seed(0)
    hf = perturb_vectors(transformers.AutoModelForCausalLM.from_config(hf_config(family)).eval())
    model, _ = load(write_hf_folder(tmp_path / family, hf))
    ids = torch.randint(0, hf.config.vocab_size, (1, 9))
    lens = logit_lens(model, ids)
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
        norm, head = hf.get_submodule(FINAL_NORM[family]), hf.get_output_embeddings()
        # HF's last hidden state is already normed; the others are the raw residual stream
        rows = [head(norm(h)) for h in out.hidden_states[:-1]] + [out.logits]
    assert lens.log_probs is not None and lens.log_probs.shape[1] == len(rows) >= 3
    for i, ref in enumerate(rows):
        err = float((lens.log_probs[0, i] - torch.log_softmax(ref[0].float(), -1)).abs().max())
        assert err <= 1e-5, (family, i, err)
    target, versus = int(out.logits[0, -1].argmax()), int(out.logits[0, -1].argmin())
    d = direct_logit_attribution(model, ids, target, versus)
    want = float(out.logits[0, -1, target] - out.logits[0, -1, versus])
    assert abs(d.total - want) < 1e-4 and abs(want) > 0.1
