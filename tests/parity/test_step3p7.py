"""Step-3.7's text model (Step3p7ForConditionalGeneration's) against transformers on the same weights: logits and
greedy tokens, as transformers saves it and as StepFun released its config; what it refuses by name."""
from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model_config_loader import ModelConfigError, load_model_config
from tests.lora_adapters import ALL_PROJECTIONS, make_adapter
from tests.parity.conftest import COMMON, transformers
from tests.parity.test_transformers_parity import (
    PROMPT_LENGTHS,
    _engine,
    _mixed_greedy,
    _mixed_prompts,
    _prefill_logits,
    _random_prompt,
)

# Sliding-window layers (8 q heads, RoPE over whole heads at theta 10^4) and full ones (4 q heads, RoPE over half of
# each at 5 * 10^4, scaled), a dense first layer, the third's GLUs clamped where tiny random weights cross the limits.
TEXT = {**{k: v for k, v in COMMON.items() if k != "num_key_value_heads"}, "num_key_value_heads": 2, "head_dim": 16,
        "num_hidden_layers": 4, "moe_intermediate_size": 48, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "share_expert_dim": 40, "layer_types": ["sliding_attention", "full_attention"] * 2,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "sliding_window": 48,
        "num_sliding_attention_heads": 8, "swiglu_limits": [0, 0, 0.4, 0], "swiglu_limits_shared": [0.5, 0, 0.3, 0],
        "moe_router_scaling_factor": 2.5, "query_pre_attn_scalar": 20,
        "rope_parameters": {"full_attention": {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                               "partial_rotary_factor": 0.5, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=56,
              patch_size=14)


def _make(path: Path, **text_changes) -> Path:
    config = transformers.Step3p7Config(text_config={**TEXT, **text_changes}, vision_config=VISION,
                                        image_token_id=500)
    torch.manual_seed(37)
    model = transformers.Step3p7ForConditionalGeneration(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif "vision" not in name and "projector" not in name:
                p.normal_(0.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.2)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def step3p7(tmp_path_factory) -> Path:
    return _make(tmp_path_factory.mktemp("step3p7") / "tiny")


@functools.cache
def _hf(model_dir: Path):
    model = transformers.Step3p7ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def _check_logits(engine, reference: Path) -> None:
    hf = _hf(reference)
    for n in PROMPT_LENGTHS:
        prompt = _random_prompt(n, 512, seed=n)
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([prompt])).logits[0, -1]
        diff = (_prefill_logits(engine, prompt) - ref).abs().max().item()
        assert diff < 1e-4, f"prompt of {n} tokens: max |logit diff| {diff}"


def _hf_greedy(reference: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = _hf(reference).generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                      do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("budget", [512, 32])
def test_logits_and_greedy_tokens_are_transformers(step3p7, budget):
    """Chunked or not; the greedy batch with a prefix served from the cache."""
    engine = _engine(step3p7, max_num_batched_tokens=budget)
    _check_logits(engine, step3p7)
    results = _mixed_greedy(engine)
    for i, prompt in enumerate(_mixed_prompts(512)):
        assert results[i] == _hf_greedy(step3p7, prompt, len(results[i])), f"request {i} ({len(prompt)} tokens)"
    engine.close()


def _released(model_dir: Path, into: Path) -> Path:
    """`model_dir` as StepFun's release writes its config: the older names, per-layer lists (RoPE's among them) that
    run on over an MTP layer, whose tensors the checkpoint holds and the model leaves unread."""
    copy = Path(shutil.copytree(model_dir, into / "released"))
    config = json.loads((copy / "config.json").read_text())
    text = config["text_config"]
    for key in ("layer_types", "mlp_layer_types", "per_layer_config", "num_sliding_attention_heads", "rope_parameters",
                "num_key_value_heads", "n_routed_experts", "num_experts_per_tok", "share_expert_dim"):
        text.pop(key)
    full, sliding = TEXT["rope_parameters"]["full_attention"], TEXT["rope_parameters"]["sliding_attention"]
    text.update({
        "model_type": "step3p5", "num_attention_groups": 2, "moe_num_experts": 4, "moe_top_k": 2,
        "share_expert_dim": 40, "num_nextn_predict_layers": 1, "moe_layers_enum": "1,2,3,4",
        "attention_other_setting": {"num_attention_heads": 8, "num_attention_groups": 2},
        "layer_types": TEXT["layer_types"] + ["full_attention"],
        "swiglu_limits": TEXT["swiglu_limits"] + [0], "swiglu_limits_shared": TEXT["swiglu_limits_shared"] + [0],
        "rope_theta": [sliding["rope_theta"], full["rope_theta"]] * 2 + [full["rope_theta"]],
        "partial_rotary_factors": [1.0, 0.5] * 2 + [0.5],
        "rope_scaling": {k: v for k, v in full.items() if k not in ("rope_theta", "partial_rotary_factor")}})
    (copy / "config.json").write_text(json.dumps(config))
    tensors = load_file(copy / "model.safetensors")
    mtp = {name.replace("model.layers.3.", "model.layers.4."): t.clone() for name, t in tensors.items()
           if name.startswith("model.layers.3.")}
    save_file({**tensors, **mtp}, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def test_the_released_configs_names_read_as_transformers_reads_them(step3p7, tmp_path):
    released = _released(step3p7, tmp_path)
    ours, theirs = load_model_config(released), load_model_config(step3p7)
    assert ours == theirs
    assert (ours.layer_num_heads, ours.rotary_dim, ours.local_rotary_dim) == ((8, 4, 8, 4), 8, 16)
    assert ours.moe.dense_layers == {0} and ours.step3p7.swiglu_limits == (None, None, 0.4, None)
    engine = _engine(released)
    _check_logits(engine, step3p7)
    engine.close()


def _with_text(model_dir: Path, into: Path, changes: dict) -> Path:
    copy = Path(shutil.copytree(model_dir, into / model_dir.name))
    config = json.loads((copy / "config.json").read_text())
    config["text_config"].update(changes)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize("changes, refused", [
    ({"layer_types": ["full_attention", "minimax_m3_sparse"] * 2}, "layer_types must name"),
    ({"sliding_window": None}, "without a sliding_window"),
    ({"attention_other_setting": {"num_attention_heads": 8, "num_attention_groups": 1}}, "num_attention_groups"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "scaled RoPE for sliding-window layers"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"gating": "per-element"}, "a head at a time only"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
])
def test_what_it_cannot_serve_is_refused_by_name(step3p7, tmp_path, changes, refused):
    with pytest.raises(ModelConfigError, match=refused):
        load_model_config(_with_text(step3p7, tmp_path, changes))


@pytest.mark.usefixtures("forked_ranks")  # (tests/parity/conftest.py)
@pytest.mark.parametrize("size", [1, 2])
def test_an_adapter_computes_as_its_merged_model_whole_and_split_across_two_ranks(step3p7, tmp_path, size):
    """Each rank its share of every layer's own q heads, gates, stacked experts and shared expert; an adapter on
    every attention and dense MLP projection (a sliding layer's q twice as wide as a full one's) named as PEFT names
    the multimodal model's, beside the base model."""
    merged = make_adapter(tmp_path / "adapter", _hf(step3p7), ALL_PROJECTIONS, 4, 8.0, False, seed=3,
                          layers="model.language_model.layers")
    engine = _engine(step3p7, max_num_batched_tokens=32, tensor_parallel_size=size,
                     lora_modules=(("tuned", str(tmp_path / "adapter")),))
    if size == 2:
        _check_logits(engine, step3p7)
        results = _mixed_greedy(engine)
        for i, prompt in enumerate(_mixed_prompts(512)):
            assert results[i] == _hf_greedy(step3p7, prompt, len(results[i])), f"request {i} ({len(prompt)} tokens)"
    for n in (17, 40):
        prompt = _random_prompt(n, 512, seed=n)
        with torch.no_grad():
            ref = merged(input_ids=torch.tensor([prompt])).logits[0, -1]
        assert (_prefill_logits(engine, prompt, "tuned") - ref).abs().max().item() < 1e-4
    engine.close()
