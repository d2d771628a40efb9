"""`lmlab.load` of a Hugging Face DeepSeek-V3 folder equals transformers' DeepseekV3ForCausalLM.

Each model is built from a tiny random config (nothing downloaded, HF_HUB_OFFLINE=1), its weights
redrawn so no map hides behind an initial value, written with ``save_pretrained`` (safetensors)
and read back with :func:`lmlab.load`. Logits are compared in float32 to 1e-5: the full pass,
cached decoding one token at a time, greedy generation token for token, and a left-padded batch
with positions from the mask (also equal to each row alone). Configs lmlab cannot load exactly
(MoE layers, other eps, hostile values) give one ``error:`` line naming config.json and the field.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmlab import load  # noqa: E402
from lmlab.errors import LmlabError  # noqa: E402
from lmlab.generation.generate import SamplingParams, generate_ids  # noqa: E402
from lmlab.nn.masks import position_ids_from_attention_mask  # noqa: E402
from tests.helpers import assert_one_error, redraw, run_cli, write_hf_folder  # noqa: E402

VOCAB = 61
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=12,
    kv_lora_rank=20,
    qk_nope_head_dim=6,
    qk_rope_head_dim=8,
    v_head_dim=5,
    first_k_dense_replace=2,  # every layer dense
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    eos_token_id=None,
    bos_token_id=None,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 500.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,  # DeepSeek-V2's; attention_factor 1 only when they are equal
}


def hf_model(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(**{**BASE, **overrides})
    return redraw(transformers.DeepseekV3ForCausalLM(cfg))


def saved(tmp_path: Path, **overrides) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the HF model, lmlab.load of its save_pretrained folder)."""
    ref = hf_model(**overrides)
    ours, _ = load(write_hf_folder(tmp_path, ref))
    return ref, ours


def assert_equal_to_hf(ref, ours, x: torch.Tensor) -> None:
    """Full pass, cached decoding and a left-padded batch equal to 1e-5."""
    tol = dict(atol=1e-5, rtol=0)
    with torch.no_grad():
        want = ref(x).logits
        torch.testing.assert_close(ours(x).logits, want, **tol)
        cache = ours.new_cache()
        steps = [ours(x[:, :5], cache=cache).logits]
        steps += [ours(x[:, t : t + 1], cache=cache).logits for t in range(5, x.shape[1])]
        torch.testing.assert_close(torch.cat(steps, 1), want, **tol)
        mask = torch.ones_like(x)
        mask[0, :4] = 0  # row 0 left-padded by 4
        pos = position_ids_from_attention_mask(mask)
        keep = mask.bool()
        want_pad = ref(x, attention_mask=mask, position_ids=pos).logits
        got_pad = ours(x, attention_mask=mask, position_ids=pos).logits
        torch.testing.assert_close(got_pad[keep], want_pad[keep], **tol)
        alone = ref(x[:1, 4:]).logits[0]  # the padded row equals itself unpadded
        torch.testing.assert_close(got_pad[0, 4:], alone, **tol)


@pytest.mark.parametrize("q_lora_rank", [12, None])
@pytest.mark.parametrize("interleave", [True, False])
def test_load_equals_hf_full_cached_and_left_padded(tmp_path, q_lora_rank, interleave):
    """q through a latent (q_a_proj / q_a_layernorm / q_b_proj) or a plain q_proj; DeepSeek's
    interleaved RoPE checkpoint layout and the half-split one: no row reordering either way."""
    ref, ours = saved(tmp_path, q_lora_rank=q_lora_rank, rope_interleave=interleave)
    a = ours.cfg.attention
    assert (a.kind, a.q_lora_rank, ours.cfg.position.interleaved) == (
        "mla",
        q_lora_rank or 0,
        interleave,
    )
    assert (a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim) == (20, 6, 8, 5)
    assert_equal_to_hf(ref, ours, torch.randint(0, VOCAB, (2, 13)))


def test_tied_embeddings_and_attention_bias(tmp_path):
    ref, ours = saved(tmp_path, tie_word_embeddings=True, attention_bias=True, rope_theta=50.0)
    assert ours.cfg.tie_embeddings and ours.cfg.attention.bias
    assert ours.lm_head.weight.data_ptr() == ours.embed.weight.data_ptr()
    assert_equal_to_hf(ref, ours, torch.randint(0, VOCAB, (2, 11)))


def test_yarn_with_mscale_scales_the_softmax_as_deepseek(tmp_path):
    """YaRN with mscale / mscale_all_dim: cos/sin times mscale(s, 1) / mscale(s, 0.707) and the
    softmax scale 1/sqrt(n + r) times mscale(s, 0.707)^2 (model.attention.softmax_mscale)."""
    ref, ours = saved(tmp_path, rope_parameters=YARN, max_position_embeddings=64)
    s = ours.cfg.position.scaling
    assert (s.kind, s.factor, s.original_max_seq_len, s.mscale_all_dim) == ("yarn", 4.0, 16, 0.707)
    assert ours.cfg.attention.softmax_mscale
    scale = ours.layers[0].attn.scale
    assert scale == pytest.approx(14**-0.5 * (0.1 * 0.707 * torch.log(torch.tensor(4.0)) + 1) ** 2)
    assert scale == pytest.approx(ref.model.layers[0].self_attn.scaling, rel=1e-12)
    x = torch.randint(0, VOCAB, (2, 40))  # past the original 16 positions
    assert_equal_to_hf(ref, ours, x)
    for layer in ours.layers:  # the multiplier is what makes them equal: without it they differ
        layer.attn.scale = 14**-0.5
    with torch.no_grad():
        assert (ours(x).logits - ref(x).logits).abs().max() > 1e-3


def test_greedy_generation_matches_token_for_token(tmp_path):
    ref, ours = saved(tmp_path, q_lora_rank=None)
    prompt = torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    got = list(generate_ids(ours, prompt[0].tolist(), params, max_seq_len=64))
    assert got == want[0, 6:].tolist()
    assert len(set(got)) > 1  # a real sequence, not one token repeated


def test_absorbed_decoding_equals_hf_too(tmp_path):
    """model.attention.absorb (attention over the latent) is the same function."""
    ref = hf_model()
    folder = write_hf_folder(tmp_path, ref)
    ours, _ = load(folder)
    for layer in ours.layers:
        layer.attn.absorb = True
    assert_equal_to_hf(ref, ours, torch.randint(0, VOCAB, (2, 9)))


def test_inspect_and_generate_on_the_folder(tmp_path, capsys):
    from lmlab.config import TokenizerConfig
    from lmlab.data.tokenizer import train_tokenizer

    tok = train_tokenizer("abcdefgh ", TokenizerConfig(kind="char"))
    assert tok.vocab_size <= VOCAB
    ref = hf_model(vocab_size=tok.vocab_size)  # every id it can generate has a text
    folder = write_hf_folder(tmp_path / "m", ref, tok)
    code, out, err = run_cli(capsys, "inspect", folder)
    assert code == 0, err
    assert f"{sum(p.numel() for p in ref.parameters()):,} parameters" in out  # HF's count
    assert "224 B per token (112 per layer)" in out  # the latent cache: (c + r) x 4 B x 2 layers
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    want = tok.decode(list(generate_ids(load(folder)[0], tok.encode("ab"), params, 64)))
    code, out, err = run_cli(
        capsys, "generate", folder, "--prompt", "ab", "--max-new-tokens", "3", "--temperature", "0"
    )
    assert code == 0, err
    assert out.strip() == ("ab" + want).strip()


def test_moe_layers_are_refused_by_name(tmp_path, capsys):
    """first_k_dense_replace < num_hidden_layers: DeepSeek's MoE layers (sigmoid, group-limited,
    bias-corrected routing with shared experts) have no lmlab counterpart."""
    ref = hf_model(
        first_k_dense_replace=1, n_routed_experts=4, n_group=2, topk_group=1,
        num_experts_per_tok=2, moe_intermediate_size=16,
    )  # fmt: skip
    folder = write_hf_folder(tmp_path / "moe", ref)
    code, _, err = run_cli(capsys, "inspect", folder)
    assert_one_error(
        code,
        err,
        "config.json",
        "DeepSeek-V3 MoE layers (n_routed_experts=4, first_k_dense_replace=1",
        "not supported",
    )


BAD = [
    ("kv_lora_rank", "abc", "kv_lora_rank is 'abc'"),
    ("kv_lora_rank", -3, "kv_lora_rank is -3"),
    ("kv_lora_rank", 10**9, "kv_lora_rank is 1000000000"),
    ("q_lora_rank", 0, "q_lora_rank is 0"),
    ("qk_nope_head_dim", 2.5, "qk_nope_head_dim is 2.5"),
    ("v_head_dim", None, "v_head_dim is null"),
    ("qk_rope_head_dim", True, "qk_rope_head_dim is True"),
    ("first_k_dense_replace", None, "first_k_dense_replace is null"),
    ("rope_interleave", "yes", "rope_interleave is 'yes'"),
    ("n_routed_experts", -1, "n_routed_experts is -1"),
    ("rms_norm_eps", 1e-5, "rms_norm_eps is 1e-05"),
    ("hidden_act", "gelu", "hidden_act is 'gelu'"),
    ("num_key_value_heads", 2, "num_key_value_heads (2) must equal"),
    ("num_hidden_layers", 3, "DeepSeek-V3 MoE layers"),
    ("rope_parameters", {**YARN, "mscale": None}, "mscale / mscale_all_dim"),
    ("rope_parameters", {"rope_type": "llama3", "factor": 8.0}, "rope_type 'llama3' has no"),
    ("qk_rope_head_dim", 7, "head_dim (8) differs from qk_rope_head_dim (7)"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "mscale_all_dim": 1.0}, "yarn only"),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_hf_folder(tmp_path_factory.mktemp("dsv3"), hf_model())


@pytest.mark.parametrize(("field", "value", "needle"), BAD, ids=[f"{b[0]}={b[1]}" for b in BAD])
def test_bad_config_values_give_one_error_naming_file_and_field(
    folder, tmp_path, capsys, field, value, needle
):
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(folder / "model.safetensors", bad / "model.safetensors")
    raw = json.loads((folder / "config.json").read_text())
    raw[field] = value
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(LmlabError, match="config.json"):
        load(bad)
    code, _, err = run_cli(capsys, "inspect", bad)
    assert_one_error(code, err, "config.json", needle)


def test_verify_runs_the_deepseek_reference_on_the_preset():
    from lmlab.analysis.verify import verify

    checks = {c.name: c for c in verify("configs/deepseek-mla.yaml")}
    assert checks["reference"].status == "pass", checks["reference"].detail
    assert "vs transformers DeepseekV3ForCausalLM" in checks["reference"].detail


def test_state_dict_round_trips_to_the_transformers_layout(tmp_path):
    from lmlab.interop.hf_deepseek_v3 import deepseek_v3_hf_state_dict

    ref, ours = saved(tmp_path, tie_word_embeddings=True)
    back = deepseek_v3_hf_state_dict(ours.state_dict(), ours.cfg)
    want = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    assert back.keys() == want.keys()
    assert all(torch.equal(back[k], v) for k, v in want.items())


def test_deepseek_config_json_layout_with_rope_scaling_loads_as_transformers_reads_it(tmp_path):
    """DeepSeek's own config.json keeps YaRN under the older ``rope_scaling`` ("type": "yarn")
    with a top-level rope_theta: lmlab reads it as transformers' from_pretrained of the same
    local folder does."""
    folder = write_hf_folder(tmp_path, hf_model(rope_parameters=YARN))
    raw = json.loads((folder / "config.json").read_text())
    yarn = {k: v for k, v in YARN.items() if k not in ("rope_type", "rope_theta")}
    del raw["rope_parameters"]
    raw.update(rope_theta=500.0, rope_scaling={"type": "yarn", **yarn})
    (folder / "config.json").write_text(json.dumps(raw))
    ref = transformers.DeepseekV3ForCausalLM.from_pretrained(str(folder)).eval()
    assert ref.config.rope_parameters["mscale_all_dim"] == 0.707
    ours, _ = load(folder)
    assert ours.cfg.position.scaling.kind == "yarn" and ours.cfg.attention.softmax_mscale
    assert_equal_to_hf(ref, ours, torch.randint(0, VOCAB, (2, 30)))


def test_an_lmlab_mla_model_exports_to_deepseek_v3_with_equal_logits(tmp_path):
    """The other direction: the deepseek-mla preset with YaRN + mscale (softmax_mscale on) ->
    DeepseekV3Config kwargs and HF tensor names -> equal logits; lmlab export's folder loads back
    into transformers itself."""
    from lmlab.config import load_config
    from lmlab.interop.export import export_model
    from lmlab.interop.families import match_family
    from lmlab.models.build import build_model

    run = load_config("configs/deepseek-mla.yaml")
    cfg = run.model
    cfg.vocab_size, cfg.n_layers = VOCAB, 1
    s = cfg.position.scaling
    s.kind, s.factor, s.original_max_seq_len, s.mscale, s.mscale_all_dim = "yarn", 4.0, 32, 1.0, 0.5
    cfg.attention._extra["softmax_mscale"] = True
    torch.manual_seed(0)
    ours = redraw(build_model(cfg))
    family, kwargs = match_family(ours.cfg)
    assert family.model_type == "deepseek_v3"
    ref = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kwargs)).eval()
    ref.load_state_dict(family.from_state(ours.state_dict(), ours.cfg), strict=True)
    x = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, ref(x).logits, atol=1e-5, rtol=0)
    result = export_model(write_hf_folder(tmp_path / "src", ref), tmp_path / "out")
    assert result.model_type == "deepseek_v3" and result.max_abs_diff is not None
    assert result.max_abs_diff <= 1e-5, result.verify_note


def test_a_tensor_beyond_the_last_layer_is_refused(tmp_path, capsys):
    """A stray tensor past the last layer (not a multi-token-prediction layer, which holds an
    eh_proj and is skipped: tests/unit/test_hf_load_review.py) is named, not silently dropped."""
    from safetensors.torch import load_file, save_file

    folder = write_hf_folder(tmp_path, hf_model())
    sd = load_file(str(folder / "model.safetensors"))
    stray = sd["model.layers.1.self_attn.kv_b_proj.weight"].clone()
    sd["model.layers.2.self_attn.kv_b_proj.weight"] = stray
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    code, _, err = run_cli(capsys, "inspect", folder)
    assert_one_error(code, err, "layers.2.attn.kv_b_proj.weight")


def test_softmax_mscale_without_yarn_mscale_all_dim_is_refused():
    """The field multiplies by yarn_mscale(factor, mscale_all_dim)^2: with no such scaling it
    would silently do nothing, so validation refuses it by name."""
    from lmlab.config import load_config
    from lmlab.errors import ConfigError

    run = load_config("configs/deepseek-mla.yaml")
    run.model.vocab_size = VOCAB
    run.model.attention._extra["softmax_mscale"] = True
    with pytest.raises(ConfigError, match="softmax_mscale .* needs model.position.scaling.kind"):
        run.validate()
