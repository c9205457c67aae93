"""LoRA adapters served beside the base model (engine/lora.py), against `transformers` running the
same model with each adapter's delta merged into its weights: logits, and greedy tokens of a batch
that mixes the base model and two adapters; a prompt's cached KV never crosses adapters."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.lora import LoRAError
from engine.lora_manager import LoRAConflictError
from engine.sampling_params import SamplingParams
from tests.lora_adapters import ALL_PROJECTIONS, make_adapter
from tests.parity.conftest import transformers
from tests.parity.test_transformers_parity import _hf_model, _prefill_logits, _random_prompt

pytestmark = pytest.mark.usefixtures("forked_ranks")  # (tests/parity/conftest.py)


@pytest.fixture(scope="module")
def served(tiny_model_dirs, tmp_path_factory):
    """The model with two adapters (all projections, rank 4; q and v only, rank 2, rsLoRA), an engine
    serving both, and transformers' merged models by name (None: the base)."""
    model_dir = tiny_model_dirs["llama-gqa-untied"]
    base, root = _hf_model(model_dir), tmp_path_factory.mktemp("adapters")
    merged = {None: base,
              "tuned": make_adapter(root / "tuned", base, ALL_PROJECTIONS, 4, 8.0, False, seed=1),
              "qv": make_adapter(root / "qv", base, ("self_attn.q_proj", "self_attn.v_proj"), 2, 4.0, True, seed=2)}
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=256,
                                    max_num_batched_tokens=64,
                                    lora_modules=(("tuned", str(root / "tuned")), ("qv", str(root / "qv")))))
    return engine, merged, root


@pytest.mark.parametrize("lora_name", [None, "tuned", "qv"])
def test_each_adapter_gives_transformers_logits_with_its_delta_merged(served, lora_name):
    engine, merged, _ = served
    for n in (1, 17, 100):  # 100: chunked by the budget of 64
        prompt = _random_prompt(n, engine.model_config.vocab_size, seed=n)
        with torch.no_grad():
            ref = merged[lora_name](torch.tensor([prompt])).logits[0, -1]
        diff = (_prefill_logits(engine, prompt, lora_name) - ref).abs().max().item()
        assert diff < 1e-4, f"adapter {lora_name}: prompt of {n} tokens, max |logit diff| {diff}"
    others = {name: merged[name] for name in merged if name != lora_name}
    prompt = _random_prompt(17, engine.model_config.vocab_size, seed=17)
    ours = _prefill_logits(engine, prompt, lora_name)
    with torch.no_grad():  # and the adapters differ enough for this to tell them apart
        assert all((other(torch.tensor([prompt])).logits[0, -1] - ours).abs().max() > 1e-2 for other in others.values())


UNGATED_TARGETS = {"arcee": ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj", "mlp.down_proj"),
                   "starcoder2": ("self_attn.q_proj", "self_attn.v_proj", "mlp.c_fc", "mlp.c_proj"),
                   "phi": ("self_attn.q_proj", "self_attn.dense", "mlp.fc1", "mlp.fc2"),
                   "opt": ("self_attn.q_proj", "self_attn.out_proj", "fc1", "fc2")}


@pytest.mark.parametrize("name", ["ernie4.5", "glm", "arcee", "starcoder2", "phi", "opt"])
def test_an_adapter_on_a_model_whose_projections_load_otherwise(tiny_model_dirs, tmp_path, name):
    """Ernie 4.5's and GLM-4's q and k rows are reordered as they load (RoPE's pairs, side by side in the checkpoint,
    half a head apart in the kernels): an adapter's B rows of q and k are reordered alike. Arcee's, StarCoder 2's and
    Phi-2's MLPs are up, the activation, down (StarCoder 2's named c_fc and c_proj, Phi-2's fc1 and fc2, its o dense;
    OPT's fc1 and fc2 directly under each layer, under model.decoder): an adapter's up rows are the MLP's first, not
    those after a gate."""
    model_dir = tiny_model_dirs[name]
    base = _hf_model(model_dir)
    targets = UNGATED_TARGETS.get(name, tuple(f"self_attn.{x}_proj" for x in "qkvo"))
    merged = make_adapter(tmp_path / "adapter", base, targets, 4, 8.0, False, seed=3,
                          layers="model.decoder.layers" if name == "opt" else "model.layers")
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64,
                                    lora_modules=(("adapter", str(tmp_path / "adapter")),)))
    prompt = _random_prompt(17, engine.model_config.vocab_size, seed=17)
    with torch.no_grad():
        ref = merged(torch.tensor([prompt])).logits[0, -1]
    assert (_prefill_logits(engine, prompt, "adapter") - ref).abs().max().item() < 1e-4
    engine.close()


# The projections of layers of their own names: LongCat-Flash's two sublayers' dense MLPs, MiniMax-M3's dense MLPs'
# gate and up fused, Qwen3.5's and Qwen3-Next's linear attention's, Granite 4.0-H's and Bamba's Mamba-2 layers'
# and MLPs'.
OWN_PROJECTIONS = {
    "longcat-flash": tuple(f"mlps.{k}.{x}_proj" for k in (0, 1) for x in ("gate", "up", "down")),
    "minimax-m3": (*(f"self_attn.{x}_proj" for x in "qkvo"), "mlp.gate_up_proj", "mlp.down_proj"),
    "qwen3.5": (*ALL_PROJECTIONS,
                *(f"linear_attn.{x}" for x in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"))),
    "qwen3-next": (*ALL_PROJECTIONS, *(f"linear_attn.{x}" for x in ("in_proj_qkvz", "in_proj_ba", "out_proj"))),
    "granite4-h": (*(f"self_attn.{x}_proj" for x in "qkvo"), "mamba.in_proj", "mamba.out_proj",
                   "shared_mlp.input_linear", "shared_mlp.output_linear"),
    "bamba": (*(f"self_attn.{x}_proj" for x in "qkvo"), "mamba.in_proj", "mamba.out_proj",
              *(f"feed_forward.{x}_proj" for x in ("gate", "up", "down"))),
    "nemotron-h": tuple(f"mixer.{x}_proj" for x in ("q", "k", "v", "o", "in", "out", "up", "down")),
    "falcon-h1": (*(f"self_attn.{x}_proj" for x in "qkvo"), "mamba.in_proj", "mamba.out_proj",
                  *(f"feed_forward.{x}_proj" for x in ("gate", "up", "down"))),
    "lfm2": (*(f"self_attn.{x}_proj" for x in ("q", "k", "v", "out")), "conv.in_proj", "conv.out_proj",
             *(f"feed_forward.{x}" for x in ("w1", "w3", "w2"))),
    "jamba": (*(f"self_attn.{x}_proj" for x in "qkvo"), *(f"mamba.{x}_proj" for x in ("in", "x", "dt", "out")),
              *(f"feed_forward.{x}_proj" for x in ("gate", "up", "down"))),
    "olmo-hybrid": (*ALL_PROJECTIONS, *(f"linear_attn.{x}_proj" for x in ("q", "k", "v", "g", "b", "a", "o"))),
    "mamba": tuple(f"mixer.{x}_proj" for x in ("in", "x", "dt", "out")),
    "mamba2": ("mixer.in_proj", "mixer.out_proj")}
# Where transformers' model holds its layers, where not under `model.` (pure Mamba's, as released: `backbone.`).
ADAPTED_LAYERS = {"mamba": "backbone.layers", "mamba2": "backbone.layers"}


@pytest.mark.parametrize("name, size", [("gemma4-e", 1), ("gemma4-e", 2), ("gemma4-k-eq-v", 1), ("mimo-v2-flash", 1),
                                        ("mimo-v2-flash", 2), ("laguna", 1), ("laguna", 2), ("longcat-flash", 1),
                                        ("longcat-flash", 2), ("minimax-m3", 1), ("minimax-m3", 2), ("qwen3.5", 1),
                                        ("qwen3-next", 1), ("granite4-h", 1), ("bamba", 1),
                                        ("nemotron-h", 1), ("falcon-h1", 1), ("lfm2", 1),
                                        ("jamba", 1), ("olmo-hybrid", 1), ("gemma3n", 1), ("gemma3n", 2), ("beam", 1),
                                        ("beam", 2), ("mamba", 1), ("mamba2", 1)])
def test_an_adapter_on_layers_of_their_own_shapes(tiny_model_dirs, tmp_path, name, size):
    """Gemma 4's layers differ: wider full-attention heads, no k or v where a layer shares another's KV, no v where
    values are keys, MLPs twice as wide in the sharing layers; MiMo-V2-Flash's full layers have half the sliding
    ones' KV heads, its v heads are narrower than k's and scaled, and only its first MLP is dense; Laguna's layers
    each have their own q heads; LongCat-Flash's two sublayers' MLPs each; MiniMax-M3's block-sparse attention (its
    indexer's projections not adapted) and dense MLPs' gate and up fused; Qwen3.5's and Qwen3-Next's gated attention
    (q's rows each head's q and gate) and linear attention's projections in (Qwen3-Next's fused and grouped by key
    head) and out; Granite 4.0-H's Mamba-2 layers' projections in and out and its dense MLP under the shared MLP's
    names (gate and up fused); Bamba's Mamba-2 layers' and MLPs (`feed_forward`); Nemotron-H's blocks' mixers, each
    by its kind; Falcon-H1's, each delta scaled by its projection's muP multipliers; LFM2's convolution layers'
    projections in and out, by LFM2's names; Jamba's Mamba-1 layers' four projections; OLMo Hybrid's linear
    attention's projections, each apart; Gemma 3n's Gemma 4 attention under AltUp and its MLPs each of its own width;
    Beam's gated attention; pure Mamba's and Mamba-2's mixers (`backbone.` names). An adapter on every projection
    each has that Baton serves adapters on (`size`: the model split across that many ranks), prefilled and decoded."""
    model_dir = tiny_model_dirs[name]
    base = _hf_model(model_dir)
    merged = make_adapter(tmp_path / "all", base, OWN_PROJECTIONS.get(name, ALL_PROJECTIONS), 4, 8.0, False, seed=5,
                          layers=ADAPTED_LAYERS.get(name, "model.layers"))
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, tensor_parallel_size=size,
                                    lora_modules=(("all", str(tmp_path / "all")),)))
    for n in (17, 40):
        prompt = _random_prompt(n, engine.model_config.vocab_size, seed=n)
        with torch.no_grad():
            ref = merged(torch.tensor([prompt])).logits[0, -1]
        assert (_prefill_logits(engine, prompt, "all") - ref).abs().max().item() < 1e-4
    # Decoded under the adapter too (a recurrent layer's step by step): transformers' greedy tokens of the merged model.
    prompt = _random_prompt(23, engine.model_config.vocab_size, seed=23)
    engine.add_request("r", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, lora_name="all"))
    tokens = []
    while engine.has_unfinished_requests():
        tokens = next((out.token_ids for out in engine.step() if out.finished), tokens)
    with torch.no_grad():
        expected = merged.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert tokens == expected[0, len(prompt):].tolist()
    engine.close()


def test_an_adapter_on_a_multimodal_models_language_model(tmp_path):
    """Named as PEFT names the multimodal model's (Gemma4ForConditionalGeneration's `model.language_model.layers`),
    the adapter adds to the text model served; one on its image tower is refused by name."""
    from safetensors.torch import load_file, save_file

    from tests.parity.test_gemma4 import _tiny_gemma4_multimodal

    base = _tiny_gemma4_multimodal(seed=6)
    base.save_pretrained(tmp_path / "model")
    merged = make_adapter(tmp_path / "text", base, ALL_PROJECTIONS, 4, 8.0, False, seed=7,
                          layers="model.language_model.layers")
    engine = LLMEngine(EngineConfig(model=str(tmp_path / "model"), dtype="float32", num_kv_blocks=64,
                                    lora_modules=(("text", str(tmp_path / "text")),)))
    prompt = _random_prompt(40, engine.model_config.vocab_size, seed=40)
    with torch.no_grad():
        ref = merged(input_ids=torch.tensor([prompt])).logits[0, -1]
    assert (_prefill_logits(engine, prompt, "text") - ref).abs().max().item() < 1e-4
    tower = tmp_path / "tower"
    tower.mkdir()
    (tower / "adapter_config.json").write_text((tmp_path / "text" / "adapter_config.json").read_text())
    key = "base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj.linear"
    save_file({**load_file(tmp_path / "text" / "adapter_model.safetensors"),
               key + ".lora_A.weight": torch.zeros(4, 32), key + ".lora_B.weight": torch.zeros(32, 4)},
              tower / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match="vision_tower"):
        engine.loras.read("tower", tower)
    engine.close()


@pytest.mark.parametrize("name, target, refusal", [
    ("longcat-flash", "self_attn.0.q_b_proj", r"LoRA on 'model.layers.0.self_attn.0.q_b_proj' is not served"),
    ("minimax-m3", "self_attn.indexer.q_proj", r"LoRA on 'model.layers.1.self_attn.indexer.q_proj' is not served")])
def test_an_adapter_on_projections_a_model_does_not_serve_is_refused_by_name(tiny_model_dirs, tmp_path, name, target,
                                                                               refusal):
    model_dir = tiny_model_dirs[name]
    make_adapter(tmp_path / "adapter", _hf_model(model_dir), [target], rank=2, alpha=4.0, rslora=False, seed=0)
    with pytest.raises(LoRAError, match=refusal):
        LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=16,
                               lora_modules=(("tuned", str(tmp_path / "adapter")),)))


def test_a_batch_mixing_adapters_decodes_each_as_its_model_and_shares_no_cached_prefix(served):
    engine, merged, _ = served
    vocab = engine.model_config.vocab_size
    shared = _random_prompt(40, vocab, seed=7)  # the same prompt under each: its blocks must not be shared
    requests = [(f"{name}-{i}", name, prompt) for name in merged for i, prompt in
                enumerate((shared, _random_prompt(23, vocab, seed=8)))]
    params = {name: SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, lora_name=name) for name in merged}
    hits_before = engine.block_manager.num_prefix_hit_tokens
    for request_id, name, prompt in requests:
        engine.add_request(request_id, prompt, params[name])
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.token_ids
    assert engine.block_manager.num_prefix_hit_tokens == hits_before  # nothing read across adapters
    for request_id, name, prompt in requests:
        with torch.no_grad():
            ref = merged[name].generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert results[request_id] == ref[0, len(prompt):].tolist(), f"{request_id} diverges from transformers"
    # Under the same adapter again, the prompt's blocks are read from the cache.
    engine.add_request("tuned-again", shared, params["tuned"])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_prefix_hit_tokens - hits_before == 32  # two full blocks of 16
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


def test_adapters_and_requests_the_engine_cannot_serve_are_refused(served, tiny_model_dirs, tmp_path):
    engine, merged, root = served
    with pytest.raises(ValueError, match="LoRA adapter 'other' is not served here \\(served: tuned, qv\\)"):
        engine.add_request("x", [5, 6], SamplingParams(lora_name="other"))
    model_dir = str(tiny_model_dirs["llama-gqa-untied"])

    def load(adapter: Path) -> None:
        LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=8, lora_modules=(("a", str(adapter)),)))

    embedding = tmp_path / "embedding"
    embedding.mkdir()
    save_file({"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(2, 512),
               "base_model.model.model.embed_tokens.lora_B.weight": torch.zeros(64, 2)},
              embedding / "adapter_model.safetensors")
    (embedding / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 2}))
    with pytest.raises(LoRAError, match="LoRA on 'model.embed_tokens' is not served"):
        load(embedding)
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_config.json").write_text(json.dumps({"r": 2, "use_dora": True}))
    with pytest.raises(LoRAError, match="DoRA"):
        load(dora)
    wrong_rank = tmp_path / "rank"
    wrong_rank.mkdir()
    (wrong_rank / "adapter_config.json").write_text(json.dumps({"r": 3, "lora_alpha": 3}))
    (wrong_rank / "adapter_model.safetensors").write_bytes((root / "qv" / "adapter_model.safetensors").read_bytes())
    with pytest.raises(LoRAError, match="do not make a rank-3 delta"):
        load(wrong_rank)


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]],
         before_each_step=lambda: None) -> dict[str, list[int]]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    results = {}
    while engine.has_unfinished_requests():
        before_each_step()
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.token_ids
    return results


def test_adapters_load_and_unload_at_run_time(served, tiny_model_dirs):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, in the engine: an adapter loaded into a
    running engine computes as one served from the start; unloaded while a request uses it, that request
    finishes with it, no new one may name it, and once it is gone its cached blocks are too, so another
    adapter loaded under its name reads none of them."""
    _, merged, root = served
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dirs["llama-gqa-untied"]), dtype="float32",
                                    num_kv_blocks=256, max_num_batched_tokens=64))
    vocab = engine.model_config.vocab_size
    prompt = _random_prompt(40, vocab, seed=11)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, lora_name="x")

    def expected(name: str) -> list[int]:
        with torch.no_grad():
            made = merged[name].generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0)
        return made[0, len(prompt):].tolist()

    with pytest.raises(ValueError, match="'x' is not served here \\(served: none\\)"):
        engine.add_request("early", prompt, greedy)
    engine.loras.add(engine.loras.read("x", root / "tuned"))
    assert engine.loras.id_of("x") == 1  # vLLM's numbering: from 1, in the order adapters are served
    with pytest.raises(LoRAConflictError, match="already loaded"):
        engine.loras.add(engine.loras.read("x", root / "qv"))
    assert _run(engine, {"first": (prompt, greedy)}) == {"first": expected("tuned")}

    def unload_once_running() -> None:  # after the first step: the request is running
        if engine.is_adapter_in_use("x") and engine.loras.is_served("x"):
            assert engine.loras.remove("x", engine.is_adapter_in_use)
            with pytest.raises(ValueError, match="not served here"):
                engine.add_request("refused", prompt, greedy)
            with pytest.raises(LoRAConflictError, match="still finishing its requests"):
                engine.loras.add(engine.loras.read("x", root / "qv"))

    hits_before = engine.block_manager.num_prefix_hit_tokens
    assert _run(engine, {"second": (prompt, greedy)}, unload_once_running) == {"second": expected("tuned")}
    assert engine.block_manager.num_prefix_hit_tokens - hits_before == 32  # read the first run's two blocks
    assert not engine.loras.is_served("x") and "x" not in engine.runner.loras
    assert not engine.loras.remove("x", engine.is_adapter_in_use)
    assert engine.loras.id_of("x") is None
    engine.loras.add(engine.loras.read("x", root / "qv"))  # another adapter under the name, and a new id
    assert engine.loras.id_of("x") == 2
    hits_before = engine.block_manager.num_prefix_hit_tokens
    assert _run(engine, {"third": (prompt, greedy)}) == {"third": expected("qv")}
    assert engine.block_manager.num_prefix_hit_tokens == hits_before
    engine.block_manager.check_integrity()


def test_max_loras_bounds_the_adapters_of_a_step_and_max_lora_rank_refuses_higher_ranks(served, tiny_model_dirs):
    """vLLM's --max-loras: with 1, no step computes with two adapters (requests for the other wait),
    and every request makes what it would unbounded; --max-lora-rank refuses a higher rank by name."""
    engine, merged, root = served
    model_dir = str(tiny_model_dirs["llama-gqa-untied"])
    vocab = engine.model_config.vocab_size
    requests = {f"{name}-{i}": (_random_prompt(20 + i, vocab, seed=30 + i),
                                SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, lora_name=name))
                for i, name in enumerate(["tuned", "qv", None, "tuned", "qv"])}
    unbounded_steps: list[int] = []
    unbounded = _run(engine, requests, lambda: unbounded_steps.append(len(engine.runner.model.lora_batch.active)))
    modules = (("tuned", str(root / "tuned")), ("qv", str(root / "qv")))
    bounded = LLMEngine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=256, max_loras=1,
                                     lora_modules=modules))
    bounded_steps: list[int] = []  # each step's adapters, read before the next
    assert _run(bounded, requests, lambda: bounded_steps.append(len(bounded.runner.model.lora_batch.active))) == \
        unbounded
    assert max(bounded_steps) == 1 and max(unbounded_steps) == 2 and len(bounded_steps) > len(unbounded_steps)
    with pytest.raises(LoRAError, match="LoRA rank 4 is greater than max_lora_rank 2"):
        LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=8, max_lora_rank=2, lora_modules=modules))


def test_max_cpu_loras_keeps_the_most_recently_asked_for_and_reads_others_again(served, tiny_model_dirs):
    """vLLM's --max-cpu-loras: with 1, only the adapter last asked for stays in memory; one let go is
    read again when a request names it and computes as before, its cached blocks still read (the same
    weights make the same KV); adapters computing requests at once all stay."""
    engine, merged, root = served
    modules = (("tuned", str(root / "tuned")), ("qv", str(root / "qv")))
    bounded = LLMEngine(EngineConfig(model=str(tiny_model_dirs["llama-gqa-untied"]), dtype="float32",
                                     num_kv_blocks=256, max_cpu_loras=1, lora_modules=modules))
    assert bounded.loras.served == ["tuned", "qv"] and bounded.loras.loaded == ["qv"]
    vocab = engine.model_config.vocab_size
    prompt = _random_prompt(40, vocab, seed=41)

    def greedy(name: str) -> SamplingParams:
        return SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, lora_name=name)

    expected = _run(engine, {name: (prompt, greedy(name)) for name in ("tuned", "qv")})
    assert _run(bounded, {"tuned": (prompt, greedy("tuned"))}) == {"tuned": expected["tuned"]}
    assert bounded.loras.loaded == ["tuned"]
    assert _run(bounded, {"qv": (prompt, greedy("qv"))}) == {"qv": expected["qv"]}
    hits_before = bounded.block_manager.num_prefix_hit_tokens
    assert _run(bounded, {"tuned": (prompt, greedy("tuned"))}) == {"tuned": expected["tuned"]}  # read again
    assert bounded.loras.loaded == ["tuned"]
    assert bounded.block_manager.num_prefix_hit_tokens - hits_before == 32  # its blocks still cached
    both = {name: (prompt, greedy(name)) for name in ("qv", "tuned")}
    loaded_each_step: list[int] = []
    assert _run(bounded, both, lambda: loaded_each_step.append(len(bounded.loras.loaded))) == expected
    assert max(loaded_each_step) == 2  # both computing at once: neither let go
    with pytest.raises(ValueError, match="at least max_loras"):
        EngineConfig(model=str(tiny_model_dirs["llama-gqa-untied"]), max_loras=2, max_cpu_loras=1)


def test_baton_generate_takes_an_adapter(tiny_demo_model, tmp_path):
    import subprocess
    import sys

    from tests.services.service_process import REPO_ROOT

    merged = make_adapter(tmp_path / "adapter", _hf_model(tiny_demo_model), ALL_PROJECTIONS, 4, 8.0, False, seed=3)
    prompt = _random_prompt(9, merged.config.vocab_size, seed=9)
    done = subprocess.run([sys.executable, "-m", "cli", "generate", "--model", str(tiny_demo_model),
                           "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "6", "--ignore-eos",
                           "--lora", str(tmp_path / "adapter"), "--json"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=True)
    with torch.no_grad():
        ref = merged.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert json.loads(done.stdout)["token_ids"] == ref[0, len(prompt):].tolist()


assert transformers  # the module is skipped without it (tests/parity/conftest.py)


def test_a_model_split_across_ranks_serves_adapters_as_transformers_merges_them(served, tiny_model_dirs):
    """Split in two (each rank its share of each A or B: rows of q, k, v, gate and up's B, columns of o and
    down's A), an adapter computes as its merged model, beside the base model in one batch; one loaded at run
    time reaches every rank, and another loaded under its name after it is read again by each."""
    _, merged, root = served
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dirs["llama-gqa-untied"]), dtype="float32",
                                    num_kv_blocks=256, max_num_batched_tokens=64, tensor_parallel_size=2,
                                    lora_modules=(("tuned", str(root / "tuned")),)))
    vocab = engine.model_config.vocab_size
    for name in (None, "tuned"):
        prompt = _random_prompt(100, vocab, seed=5)  # chunked by the budget of 64
        with torch.no_grad():
            ref = merged[name](torch.tensor([prompt])).logits[0, -1]
        assert (_prefill_logits(engine, prompt, name) - ref).abs().max().item() < 1e-4, name
    prompt = _random_prompt(30, vocab, seed=6)

    def greedy(*names: str | None) -> dict[str, list[int]]:
        return _run(engine, {f"{name}-{i}": (prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                                   lora_name=name)) for i, name in enumerate(names)})

    def expected(model) -> list[int]:
        with torch.no_grad():
            return model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()

    assert greedy(None, "tuned") == {"None-0": expected(merged[None]), "tuned-1": expected(merged["tuned"])}
    engine.loras.add(engine.loras.read("x", root / "qv"))
    assert greedy("x") == {"x-0": expected(merged["qv"])}
    assert engine.loras.remove("x", engine.is_adapter_in_use)
    engine.loras.add(engine.loras.read("x", root / "tuned"))
    assert greedy("x") == {"x-0": expected(merged["tuned"])}
    engine.close()
