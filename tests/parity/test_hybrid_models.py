"""Hybrid models (Qwen3.5's and Qwen3-Next's Gated DeltaNet, Granite 4.0-H's Mamba-2): the recurrent states each
sequence keeps in pages of its own, as they start, continue, move to a decode engine and are computed again, against
transformers; and what is refused for them. Their logits and batched greedy tokens are test_transformers_parity.py's
(TINY_MODELS)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.lora import LoRAError
from engine.model_config_loader import ModelConfigError, load_model_config
from engine.sampling_params import SamplingParams
from engine.speculative import NgramDrafter, SpeculativeConfig
from tests.lora_adapters import make_adapter
from tests.parity.conftest import COMMON, LINEAR_HEADS, TINY_MODELS, decoded_from_handed_over_pages, greedy_outputs
from tests.parity.test_transformers_parity import (
    _check_greedy,
    _check_last_logits,
    _check_logits,
    _engine,
    _hf_model,
    _mixed_prompts,
    _prefill_logits,
    _random_prompt,
    transformers,
)

HYBRIDS = ("qwen3.5", "qwen3.5-moe", "qwen3-next", "granite4-h", "granite4-h-moe", "nemotron-h", "nemotron-h-moe",
           "lfm2", "lfm2-moe", "lfm3", "falcon-h1", "falcon-h1-unnormed", "bamba", "jamba", "kimi-linear",
           "olmo-hybrid", "qwen4-exp", "qwen4-exp-ngrams", "bailing-hybrid", "minimax", "zamba2", "mamba",
           "falcon-mamba", "mamba2")


def _greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    hf = _hf_model(model_dir)
    return [hf.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(p):].tolist()
            for p in prompts]


def test_a_sequence_holds_its_states_pages_beside_its_tokens_and_gives_them_back(tiny_model_dirs):
    # Pages of 4 tokens (2 layers x 2 KV x 2 heads x 4 x 16 floats: 2048 bytes) hold 2 layers' states
    # (convolution 96 channels x 3, recurrent 4 heads x 16 x 8: 3200 bytes each) in 4 pages.
    engine = _engine(tiny_model_dirs["qwen3.5"], block_size=4)
    layout = engine.model_config.linear_attention
    assert layout.state_shape.nbytes == 2 * (96 * 3 + 4 * 16 * 8) * 4
    assert engine.block_manager.num_state_blocks == 4
    assert engine.runner.kv_pool.tensor.shape[0] == 2  # the full-attention layers' pages alone
    engine.add_request("r", list(range(3, 13)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    seq = engine.scheduler.running[0]
    assert len(seq.state_blocks) == 4 and not set(seq.state_blocks) & set(seq.block_table)
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks - 4 - len(seq.block_table)
    engine.block_manager.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks
    engine.close()


def test_a_model_of_mamba_layers_alone_keeps_its_states_in_one_pool_layer_no_layer_attends_over(tiny_model_dirs):
    """Mamba's pages hold no layer's KV: its pool's one layer, one narrow head, holds the sequences' states (3 layers'
    convolution windows, 160 channels x 3, and states, 160 x 16: 36,480 bytes in pages of 4 tokens, 2,048 bytes)."""
    engine = _engine(tiny_model_dirs["mamba"], block_size=4)
    assert engine.model_config.kv_places == {}
    assert tuple(engine.runner.kv_pool.tensor.shape[:3]) == (1, 2, 1)
    assert engine.block_manager.num_state_blocks == -(-3 * (160 * 3 + 160 * 16) * 4 // (2 * 4 * 64 * 4)) == 18
    engine.close()


@pytest.mark.parametrize("name", HYBRIDS)
def test_states_laid_across_several_pages_give_transformers_tokens(tiny_model_dirs, name):
    """Pages of 4 tokens: each sequence's states span 4 (qwen3.5) or more pages."""
    _check_greedy(tiny_model_dirs[name], max_num_batched_tokens=32, block_size=4)


@pytest.mark.parametrize("name", HYBRIDS)
def test_prompts_continue_from_a_cached_prefix_where_its_states_were_kept(tiny_model_dirs, name):
    """Chunks of 32 tokens keep the states at each chunk's end (a block's end): two prompts sharing 40 tokens with
    a computed one continue from its first 32, cached, and give transformers' tokens."""
    model_dir = tiny_model_dirs[name]
    engine = _engine(model_dir, max_num_batched_tokens=32)
    prompts = _mixed_prompts(engine.model_config.vocab_size)
    first, later = {"r2": (prompts[2], {})}, {"r3": (prompts[3], {}), "r7": (prompts[7], {})}
    outputs = {**greedy_outputs(engine, first, 8), **greedy_outputs(engine, later, 8)}
    assert engine.block_manager.num_prefix_hit_tokens == 2 * 32
    for rid, expected in zip(("r2", "r3", "r7"), _greedy(model_dir, [prompts[2], prompts[3], prompts[7]], 8)):
        assert outputs[rid] == expected, rid
    engine.close()


@pytest.mark.parametrize("name", ["qwen3.5", "qwen3-next", "granite4-h", "lfm2", "falcon-h1", "jamba", "kimi-linear",
                                  "minimax"])
def test_a_prompt_computed_in_one_chunk_keeps_its_states_every_interval_for_prompts_sharing_its_prefix(
        tiny_model_dirs, name):
    """A 300-token prompt in one chunk keeps its states every 64 tokens (the run cut there): a prompt sharing its
    first 200 continues from its 192nd, its logits transformers', and both give transformers' tokens."""
    model_dir = tiny_model_dirs[name]
    engine = _engine(model_dir, state_snapshot_interval=64)
    shared = _random_prompt(300, 512, seed=300)
    other = [*shared[:200], *_random_prompt(30, 512, seed=30)]
    outputs = greedy_outputs(engine, {"shared": (shared, {})}, 8)
    assert len(engine.state_snapshots) == 4 + 1  # at 64, 128, 192 and 256; and 304, its output's last block end
    with torch.no_grad():
        expected = _hf_model(model_dir)(torch.tensor([other])).logits[0, -1]
    assert (_prefill_logits(engine, other) - expected).abs().max().item() < 1e-4
    assert engine.block_manager.num_prefix_hit_tokens == 192
    outputs |= greedy_outputs(engine, {"other": (other, {})}, 8)
    assert [outputs["shared"], outputs["other"]] == _greedy(model_dir, [shared, other], 8)
    engine.close()


def test_without_room_for_kept_states_no_prefix_is_continued_from(tiny_model_dirs):
    engine = _engine(tiny_model_dirs["qwen3.5"], max_num_batched_tokens=32, state_cache_bytes=0)
    prompt = _random_prompt(100, 512, seed=100)
    greedy_outputs(engine, {"first": (prompt, {})}, 4)
    assert len(engine.state_snapshots) == 0 and engine.block_manager.num_cached_prefix_tokens(prompt) == 0
    engine.close()


def test_a_conversations_next_turn_continues_from_the_states_its_last_turn_left(tiny_model_dirs):
    """A prompt computed in one chunk keeps no states inside it, but its output's last block end does (kept as the
    request finishes): the next turn (prompt, answer, more) continues from there."""
    model_dir = tiny_model_dirs["qwen3-next"]
    engine = _engine(model_dir)
    turn = _random_prompt(45, 512, seed=45)
    answer = greedy_outputs(engine, {"turn1": (turn, {})}, 30)["turn1"]
    assert engine.block_manager.num_prefix_hit_tokens == 0
    next_turn = [*turn, *answer, *_random_prompt(10, 512, seed=10)]
    assert engine.block_manager.num_cached_prefix_tokens(next_turn) == 64  # 45 + 30 computed: its 4th block's end
    assert greedy_outputs(engine, {"turn2": (next_turn, {})}, 8)["turn2"] == _greedy(model_dir, [next_turn], 8)[0]
    assert engine.block_manager.num_prefix_hit_tokens == 64
    assert engine.reset_prefix_cache() is not None  # the kept states go with the cached blocks
    assert len(engine.state_snapshots) == 0 and engine.block_manager.num_cached_prefix_tokens(next_turn) == 0
    engine.close()


@pytest.mark.parametrize("name", ["qwen3-next", "granite4-h", "nemotron-h", "lfm2", "falcon-h1", "jamba",
                                  "kimi-linear", "olmo-hybrid", "qwen4-exp-ngrams", "bailing-hybrid", "minimax",
                                  "zamba2", "falcon-mamba", "mamba2"])
def test_a_decode_engine_continues_from_the_pages_and_states_prefill_handed_over(tiny_model_dirs, name):
    model_dir = tiny_model_dirs[name]
    prefill = _engine(model_dir, block_size=4, max_num_batched_tokens=32)  # the prompts in several chunks
    decode = _engine(model_dir, block_size=4)
    prompts = [_random_prompt(n, 512, seed=n) for n in (1, 45, 130)]
    requests = {f"r{i}": (p, 10, {}, {}) for i, p in enumerate(prompts)}
    outputs = decoded_from_handed_over_pages(prefill, decode, requests)
    for i, expected in enumerate(_greedy(model_dir, prompts, 10)):  # the first token prefill's, then decode's
        assert outputs[f"r{i}"].token_ids == expected, i
    prefill.close()
    decode.close()


@pytest.mark.parametrize("name", ["qwen3.5", "qwen3-next", "granite4-h-moe", "olmo-hybrid", "qwen4-exp-ngrams"])
def test_n_gram_drafts_give_transformers_tokens(tiny_model_dirs, name):
    """The tiny models' outputs do not repeat, so their n-gram drafts are refused: each drafted step computes the
    last token and its drafts, and the next goes on from the states after the last token alone."""
    model_dir = tiny_model_dirs[name]
    engine = _engine(model_dir, speculative=SpeculativeConfig(num_speculative_tokens=3))
    prompts = [_random_prompt(n, 512, seed=n) for n in (5, 20, 40)]
    outputs = greedy_outputs(engine, {f"r{i}": (p, {}) for i, p in enumerate(prompts)}, 48)
    assert engine.scheduler.drafting.num_draft_tokens > 0
    for i, expected in enumerate(_greedy(model_dir, prompts, 48)):
        assert outputs[f"r{i}"] == expected, i
    engine.close()


class KnowingDrafter(NgramDrafter):
    """Drafts what transformers makes next, the first `n` of them right and the rest off by one, `n` going 0, 1, 2,
    3 from step to step: drafts taken in every number, so each step goes on from the states after a different
    token of the last (what n-gram drafts of a model that repeats itself would give)."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]]) -> None:
        super().__init__(SpeculativeConfig(num_speculative_tokens=3))
        self.expected = expected  # each prompt's transformers tokens
        self.num_right = 0

    def propose(self, wanted):
        drafts = {}
        for seq, room in wanted:
            prompt = tuple(seq.token_ids[:seq.num_prompt_tokens])
            made = len(seq.token_ids) - len(prompt)
            right = self.expected[prompt][made:made + room]
            drafts[seq.request_id] = [t if i < self.num_right else (t + 1) % 512 for i, t in enumerate(right)]
        self.num_right = (self.num_right + 1) % 4
        return drafts


def test_each_drafted_step_goes_on_from_the_states_after_the_last_token_it_kept(tiny_model_dirs):
    model_dir = tiny_model_dirs["qwen3-next"]
    prompts = [_random_prompt(n, 512, seed=n) for n in (5, 20, 40)]
    expected = _greedy(model_dir, prompts, 40)
    engine = _engine(model_dir, speculative=SpeculativeConfig(num_speculative_tokens=3))
    engine.scheduler.drafter = engine.scheduler.drafting.drafter = KnowingDrafter(
        {tuple(p): e for p, e in zip(prompts, expected)})
    outputs = greedy_outputs(engine, {f"r{i}": (p, {}) for i, p in enumerate(prompts)}, 40)
    drafting = engine.scheduler.drafting
    assert 0 < drafting.num_accepted_tokens < drafting.num_draft_tokens
    assert all(drafting.num_accepted_tokens_per_position[:3])  # some steps took one, two and three
    assert [outputs[f"r{i}"] for i in range(3)] == expected
    engine.close()


@pytest.mark.parametrize("name, num_pages", [("qwen3.5", 20), ("granite4-h-moe", 22)])
def test_preempted_sequences_compute_their_states_again(tiny_model_dirs, name, num_pages):
    """A pool too small for every sequence at once (its states take 1 page a sequence in qwen3.5, 6 in
    granite4-h-moe): sequences are preempted (their pages, states among them, freed) and computed again from their
    tokens, from fresh states."""
    model_dir = tiny_model_dirs[name]
    engine = _engine(model_dir, num_kv_blocks=num_pages, max_num_batched_tokens=64)
    prompts = [_random_prompt(n, 512, seed=200 + n) for n in (60, 70, 80, 90)]
    outputs = greedy_outputs(engine, {f"r{i}": (p, {}) for i, p in enumerate(prompts)}, 40)
    assert engine.scheduler.num_preemptions > 0
    for i, expected in enumerate(_greedy(model_dir, prompts, 40)):
        assert outputs[f"r{i}"] == expected, i
    engine.close()


@pytest.mark.parametrize("name, prefix, seed, serves_images", [("qwen3.5", "Qwen3_5", 35, True),
                                                               ("qwen4-exp", "Qwen4Exp", 4, False)])
def test_a_multimodal_checkpoint_serves_its_text_model_leaving_its_mtp_layer_unread(tmp_path, name, prefix, seed,
                                                                                    serves_images):
    """Qwen3.5 and Qwen4-Exp as released (a ...ForConditionalGeneration: its text model under
    `model.language_model.`, its vision tower under `model.visual.`, its MTP layer under `mtp.`); Qwen4-Exp's images
    not served yet."""
    from safetensors.torch import load_file, save_file

    text = getattr(transformers, f"{prefix}TextConfig")(**{**COMMON, **TINY_MODELS[name][1]})
    vision = getattr(transformers, f"{prefix}VisionConfig")(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                           out_hidden_size=64)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(getattr(transformers, f"{prefix}Config")(
        text_config=text.to_dict(), vision_config=vision.to_dict())).eval()
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert any(name.startswith("model.visual.") for name in tensors)
    save_file({**tensors, "mtp.fc.weight": torch.zeros(64, 128)}, tmp_path / "model.safetensors")
    engine = _engine(tmp_path, max_num_batched_tokens=32)
    assert engine.model_config.architecture == f"{prefix}ForCausalLM"
    assert (engine.model_config.vision is not None) == serves_images
    _check_last_logits(engine, model)
    engine.close()


@pytest.mark.parametrize("name, overrides, refused", [
    ("qwen3.5", dict(tensor_parallel_size=2), "tensor parallelism does not split .* yet"),
    ("granite4-h", dict(tensor_parallel_size=2), "does not split models with recurrent layers"),
    ("qwen3.5", dict(num_kv_blocks=1), "its recurrent states alone take 1 pages"),
])
def test_what_a_hybrid_model_cannot_do_yet_is_refused_by_name(tiny_model_dirs, name, overrides, refused):
    with pytest.raises(ValueError, match=refused):
        LLMEngine(EngineConfig(model=str(tiny_model_dirs[name]), dtype="float32", **overrides))


@pytest.mark.parametrize("name, target", [("kimi-linear", "self_attn.q_proj"), ("qwen4-exp", "linear_attn.out_proj")])
def test_a_lora_adapter_for_a_hybrid_model_is_refused_by_name(tiny_model_dirs, tmp_path, name, target):
    model_dir = tiny_model_dirs[name]
    make_adapter(tmp_path / "adapter", _hf_model(model_dir), [target], rank=2, alpha=4.0, rslora=False, seed=0)
    architecture = load_model_config(model_dir).architecture
    with pytest.raises(LoRAError, match=f"LoRA adapters are not supported for {architecture}"):
        _engine(model_dir, lora_modules=(("tuned", str(tmp_path / "adapter")),))


@pytest.mark.parametrize("layer_types, refused", [
    (["linear_attention"] * 4, "linear-attention layers alone"),
    (["linear_attention", "mamba", "linear_attention", "full_attention"], "layer_types must name"),
])
def test_a_layout_not_of_linear_and_full_attention_layers_is_refused(tiny_model_dirs, tmp_path, layer_types, refused):
    model_dir = shutil.copytree(tiny_model_dirs["qwen3.5"], tmp_path / "bad")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "layer_types": layer_types}))
    with pytest.raises(ModelConfigError, match=refused):
        load_model_config(model_dir)


def test_ling3s_forget_gate_unbounded_where_its_config_says_is_transformers(tiny_model_dirs, tmp_path):
    """kda_safe_gate false: Ling 3's KDA forget gate's log is Kimi-Linear's, -exp(A_log) softplus(...), unbounded."""
    model_dir = shutil.copytree(tiny_model_dirs["bailing-hybrid"], tmp_path / "ling")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "kda_safe_gate": False}))
    assert load_model_config(model_dir).linear_attention.forget_gate_bound is None
    _check_logits(model_dir, prompt_lengths=(17, 300))


@pytest.mark.parametrize("given", [{}, {"layer_group_size": 3, "first_k_dense_replace": 3}])
def test_ling3s_config_as_released_lays_its_layers_out_as_transformers_does(tmp_path, given):
    """Ling 3's config.json as released: by Ling's names, its KDA heads' width its `head_dim`, no layer types (the
    last of every `layer_group_size` layers latent attention, the first `first_k_dense_replace` MLPs dense)."""
    cfg = {"architectures": ["BailingHybridForCausalLM"], "model_type": "bailing_hybrid", "vocab_size": 512,
           "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 7, "num_attention_heads": 4,
           "head_dim": 16, "kv_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 20,
           "num_experts": 8, "num_experts_per_token": 2, "num_expert_group": 2, "num_shared_experts": 1,
           "topk_group": 1, "moe_intermediate_size": 48, "model_max_length": 4096, "kda_lower_bound": -4.0,
           "pad_token_id": 0, "eos_token_id": 2, **given}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    expected = transformers.BailingHybridConfig(**cfg)
    config = load_model_config(tmp_path)
    layout = config.linear_attention
    assert layout.layer_types == tuple(expected.layer_types)
    assert (layout.num_key_heads, layout.key_head_dim, layout.conv_kernel) == (expected.linear_num_heads,
                                                                               expected.linear_head_dim, 4)
    assert layout.forget_gate_bound == -4.0
    assert config.moe.dense_layers == {i for i, kind in enumerate(expected.mlp_layer_types) if kind == "dense"}
    assert (config.moe.num_experts, config.moe.num_experts_per_tok, config.moe.num_groups, config.moe.topk_groups,
            config.moe.routed_scaling_factor) == (8, 2, 2, expected.topk_group, expected.routed_scaling_factor)
    assert config.max_position_embeddings == 4096 and config.rope_theta == expected.rope_parameters["rope_theta"]


@pytest.mark.parametrize("changes, linear_layers, refused", [
    ({"num_hidden_layers": 5}, (1, 3), None),  # transformers' default: every other layer, from the first, softmax's
    ({"layer_types": ["linear_attention"] * 4}, None, "at least one 'full_attention'"),
    ({"block_size": 0}, None, "block_size must be positive"),
])
def test_minimaxs_layers_default_as_transformers_and_what_it_cannot_serve_is_refused(tiny_model_dirs, tmp_path,
                                                                                     changes, linear_layers, refused):
    model_dir = shutil.copytree(tiny_model_dirs["minimax"], tmp_path / "minimax")
    config = {key: value for key, value in json.loads((model_dir / "config.json").read_text()).items()
              if key != "layer_types"}
    (model_dir / "config.json").write_text(json.dumps({**config, **changes}))
    if refused is not None:
        with pytest.raises(ModelConfigError, match=refused):
            load_model_config(model_dir)
        return
    expected = transformers.MiniMaxConfig(**{**config, **changes}).layer_types
    layout = load_model_config(model_dir).minimax
    assert layout.linear_layers == linear_layers == tuple(i for i, kind in enumerate(expected)
                                                          if kind == "linear_attention")


@pytest.mark.parametrize("changes, refused", [
    ({"layers_block_type": ["mamba"] * 6}, "without hybrid layers is not supported"),
    ({"num_key_value_heads": 2}, "adapters need as many k and v heads as q heads"),
    ({"layers_block_type": ["mamba", "attention"] * 3}, "must name a Mamba-2 or hybrid layer"),
])
def test_zamba2_layouts_it_cannot_serve_are_refused_by_name(tiny_model_dirs, tmp_path, changes, refused):
    model_dir = shutil.copytree(tiny_model_dirs["zamba2"], tmp_path / "zamba2")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(ModelConfigError, match=refused):
        load_model_config(model_dir)


def test_qwen3_nexts_layers_default_to_one_full_attention_layer_in_four(tiny_model_dirs, tmp_path):
    model_dir = shutil.copytree(tiny_model_dirs["qwen3-next"], tmp_path / "next")
    config = json.loads((model_dir / "config.json").read_text())
    del config["layer_types"]
    (model_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 8,
                                                       "full_attention_interval": 4, **LINEAR_HEADS}))
    layout = load_model_config(model_dir).linear_attention
    assert layout.linear_layers == (0, 1, 2, 4, 5, 6) and layout.kv_places == {3: 0, 7: 1}


def test_olmo_hybrids_config_defaults_are_transformers(tiny_model_dirs, tmp_path):
    """Without layer types, every fourth layer full, and the last where no layer would be; heads as many as
    attention's, keys 3/4 of the hidden size across them, values twice as wide; write strengths up to 2 unless
    linear_allow_neg_eigval is off."""
    model_dir = shutil.copytree(tiny_model_dirs["olmo-hybrid"], tmp_path / "olmo")
    config = json.loads((model_dir / "config.json").read_text())
    for key in ("layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim"):
        config.pop(key, None)
    for num_layers, linear in ((8, (0, 1, 2, 4, 5, 6)), (2, (0,))):
        (model_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}))
        layout = load_model_config(model_dir).linear_attention
        assert layout.linear_layers == linear
        assert (layout.num_key_heads, layout.key_head_dim, layout.value_head_dim, layout.beta_scale) == (4, 12, 24, 2)
    (model_dir / "config.json").write_text(json.dumps({**config, "linear_allow_neg_eigval": False}))
    assert load_model_config(model_dir).linear_attention.beta_scale == 1.0


def test_nemotron_hs_released_config_lays_its_layers_out_by_its_pattern(tiny_model_dirs, tmp_path):
    """Nemotron-H as released: its layers by `hybrid_override_pattern` (M, * and -), its tensors under `backbone.`
    (as transformers saves them too)."""
    source = tiny_model_dirs["nemotron-h"]
    model_dir = shutil.copytree(source, tmp_path / "released")
    config = json.loads((model_dir / "config.json").read_text())
    del config["layers_block_type"]
    (model_dir / "config.json").write_text(json.dumps({**config, "hybrid_override_pattern": "M-*-M-",
                                                       "num_hidden_layers": 6}))
    assert load_model_config(model_dir).mamba.kv_places == {2: 0}
    engine = _engine(model_dir, max_num_batched_tokens=32)
    _check_last_logits(engine, _hf_model(source))
    engine.close()


@pytest.mark.parametrize("pattern, refused", [
    ("M-*-MX", r"Nemotron-H's \['X'\] layers are not supported"),
    ("--*---", "needs Mamba-2 and attention layers both"),
])
def test_nemotron_hs_layers_it_does_not_serve_are_refused_by_name(tiny_model_dirs, tmp_path, pattern, refused):
    model_dir = shutil.copytree(tiny_model_dirs["nemotron-h"], tmp_path / "refused")
    config = json.loads((model_dir / "config.json").read_text())
    del config["layers_block_type"]
    (model_dir / "config.json").write_text(json.dumps({**config, "hybrid_override_pattern": pattern}))
    with pytest.raises(ModelConfigError, match=refused):
        load_model_config(model_dir)


def test_a_mamba_layers_steps_are_clamped_in_prompts_and_not_in_decoded_tokens(tiny_model_dirs, tmp_path):
    """With dt_bias far below zero every step's dt falls under Nemotron-H's time_step_min: transformers clamps a
    prompt's (its chunked scan) and not a decoded token's (its one-token update), and so does every step here,
    decoded tokens beside prompt chunks too, and a prompt's token computed alone: a prompt of one, a chunk's last."""
    from safetensors.torch import load_file, save_file

    model_dir = shutil.copytree(tiny_model_dirs["nemotron-h"], tmp_path / "slow")
    tensors = load_file(model_dir / "model.safetensors")
    save_file({name: torch.full_like(t, -10.0) if name.endswith("mixer.dt_bias") else t
               for name, t in tensors.items()}, model_dir / "model.safetensors")
    _check_logits(model_dir, max_num_batched_tokens=32, prompt_lengths=(1, 33))
    _check_greedy(model_dir, max_num_batched_tokens=32)


def test_lfm2s_released_config_reads_its_attention_layers_and_its_mlps_width_as_transformers_does(tiny_model_dirs,
                                                                                                 tmp_path):
    """LFM2 as released: `full_attn_idxs` for its attention layers (convolutions elsewhere), `block_ff_dim` for the
    width two thirds of which (rounded up to `block_multiple_of`) its MLPs are, `tie_embedding`."""
    source = tiny_model_dirs["lfm2"]
    model_dir = shutil.copytree(source, tmp_path / "released")
    config = json.loads((model_dir / "config.json").read_text())
    for key in ("layer_types", "intermediate_size", "tie_word_embeddings"):
        del config[key]
    (model_dir / "config.json").write_text(json.dumps({**config, "full_attn_idxs": [1, 3], "block_ff_dim": 160,
                                                       "tie_embedding": True}))
    loaded = load_model_config(model_dir)
    assert loaded.short_conv.conv_layers == (0, 2) and loaded.kv_places == {1: 0, 3: 1}
    assert loaded.intermediate_size == 112 and loaded.tie_word_embeddings  # 106, rounded up to a multiple of 16
    engine = _engine(model_dir, max_num_batched_tokens=32)
    _check_last_logits(engine, _hf_model(source))
    engine.close()


@pytest.mark.parametrize("name, changes, refused", [
    ("lfm2", {"layer_types": ["conv"] * 4}, "of one kind of layer alone is not supported"),
    ("lfm2", {"layer_types": ["conv", "mamba", "conv", "full_attention"]},
     r"must name convolution or attention layers, one a layer of 4, got \['mamba'\]"),
    ("lfm2-moe", {"use_expert_bias": False}, r"without its expert bias \(use_expert_bias false\) is not supported"),
    ("jamba", {"attn_layer_period": 1, "attn_layer_offset": 0}, "Jamba needs Mamba and attention layers both"),
])
def test_lfm2_and_jamba_layouts_it_does_not_serve_are_refused_by_name(tiny_model_dirs, tmp_path, name, changes,
                                                                      refused):
    model_dir = shutil.copytree(tiny_model_dirs[name], tmp_path / "refused")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(ModelConfigError, match=refused):
        load_model_config(model_dir)


def test_falcon_h1s_mamba_output_normed_before_its_gate_is_transformers(tiny_model_dirs, tmp_path):
    """mamba_norm_before_gate: the Mamba-2 layer's output RMS-normed in groups, then gated by SiLU of z."""
    model_dir = shutil.copytree(tiny_model_dirs["falcon-h1"], tmp_path / "before-gate")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "mamba_norm_before_gate": True}))
    engine = _engine(model_dir, max_num_batched_tokens=32)
    _check_last_logits(engine, _hf_model(model_dir))
    engine.close()


def _minimax_as_released(model_dir, tmp_path, **changes):
    """The tiny MiniMax checkpoint with its config.json as MiniMax-M1's release writes it (for its own modeling code):
    `attn_type_list`, `layernorm_*_alpha`/`_beta`, `postnorm`, `rotary_dim`, its RoPE base at the top."""
    released_dir = shutil.copytree(model_dir, tmp_path / "released")
    config = json.loads((released_dir / "config.json").read_text())
    released = {key: value for key, value in config.items() if key not in ("layer_types", "rope_parameters")
                and not key.endswith(("_alpha_factor", "_beta_factor"))}
    for kind, name in (("full_attn", "full_attention"), ("linear_attn", "linear_attention"), ("mlp", "mlp")):
        released |= {f"layernorm_{name}_alpha": config[f"{kind}_alpha_factor"],
                     f"layernorm_{name}_beta": config[f"{kind}_beta_factor"]}
    released |= {"architectures": ["MiniMaxM1ForCausalLM"], "model_type": "minimax_m1", "postnorm": True,
                 "attn_type_list": [int(kind == "full_attention") for kind in config["layer_types"]],
                 "rotary_dim": config["head_dim"], "rope_theta": config["rope_parameters"]["rope_theta"],
                 "shared_intermediate_size": 0, "shared_moe_mode": "sigmoid", **changes}
    (released_dir / "config.json").write_text(json.dumps(released))
    return released_dir


def test_minimax_as_released_for_its_own_code_is_read_as_transformers_reads_its_hf_checkpoint(tiny_model_dirs,
                                                                                             tmp_path):
    """The same tensors under MiniMax-M1's own config.json (every head turned whole by RoPE here): transformers'
    logits and greedy tokens of the `-hf` form of it."""
    released = _minimax_as_released(tiny_model_dirs["minimax"], tmp_path)
    config = load_model_config(released)
    assert config.architecture == "MiniMaxM1ForCausalLM" and config.minimax.linear_layers == (1, 3)
    assert config.minimax.full_factors == (1.5, 0.75) and config.minimax.mlp_factors == (1.25, 0.5)
    _check_logits(released, max_num_batched_tokens=32, reference_dir=tiny_model_dirs["minimax"])
    _check_greedy(released, max_num_batched_tokens=32, reference_dir=tiny_model_dirs["minimax"])


def test_minimax_as_released_turns_the_first_rotary_dim_dimensions_of_each_head(tiny_model_dirs, tmp_path,
                                                                                monkeypatch):
    """Its releases turn 64 of a head's 128 dimensions (`rotary_dim`), as their own code and vLLM do: the first ones,
    by rotating their halves, at the rates of a head that wide. transformers' MiniMax turns whole heads; its model made
    to turn the first half of each, as MiniMax's code does, is the reference."""
    from transformers.models.minimax import modeling_minimax

    released = _minimax_as_released(tiny_model_dirs["minimax"], tmp_path, rotary_dim=8)  # of 16

    def partly_turned(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin, turned = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim), cos.shape[-1]
        return tuple(torch.cat((x[..., :turned] * cos + modeling_minimax.rotate_half(x[..., :turned]) * sin,
                                x[..., turned:]), dim=-1) for x in (q, k))

    monkeypatch.setattr(modeling_minimax, "apply_rotary_pos_emb", partly_turned)
    model = _hf_model(tiny_model_dirs["minimax"])
    theta = json.loads((released / "config.json").read_text())["rope_theta"]
    model.model.rotary_emb.inv_freq = 1.0 / theta ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    engine = _engine(released, max_num_batched_tokens=32)
    assert engine.model_config.rotary_dim == 8
    _check_last_logits(engine, model)
    engine.close()


@pytest.mark.parametrize("changes, refused", [
    ({"postnorm": False}, "postnorm false"),
    ({"shared_intermediate_size": 32}, "shared experts"),
    ({"num_local_experts": [4, 4, 4, 4]}, "a list"),
    ({"attn_type_list": [1, 2, 1, 0]}, "must hold 0"),
])
def test_what_minimaxs_own_code_computes_and_transformers_does_not_is_refused_by_name(tiny_model_dirs, tmp_path,
                                                                                       changes, refused):
    with pytest.raises(ModelConfigError, match=refused):
        load_model_config(_minimax_as_released(tiny_model_dirs["minimax"], tmp_path, **changes))
