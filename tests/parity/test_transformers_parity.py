"""Baton's forward against `transformers` on the same weights: logits and greedy tokens."""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.batch import ScheduledBatch
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config_loader import ModelConfigError, load_model_config
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from tests.cuda import DEVICES
from tests.parity.conftest import (
    COMMON,
    ENGINE_OPTIONS,
    LONGROPE_ORIGINAL_CONTEXT,
    TINY_MODELS,
    copied_with_config,
    shared_model_dirs,
    transformers,
)

pytestmark = pytest.mark.usefixtures("forked_ranks")  # (tests/parity/conftest.py)

PROMPT_LENGTHS = (1, 17, 300)
# Every mixed prompt's decode crosses a page boundary within this many tokens, and the 17- and 45-token prompts'
# a 48-token sliding window.
GREEDY_NEW_TOKENS = 32
SHARED = shared_model_dirs()


def _hf_model(model_dir: Path):
    # float32 compute whatever the stored dtype, as the engine below is configured.
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # The engine runs with ignore_eos; HF's min_new_tokens would instead forbid EOS.
    model.generation_config.eos_token_id = None
    return model.eval()


def _random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _engine(model_dir: Path, **overrides) -> LLMEngine:
    cfg = dict(model=str(model_dir), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=512,
               **ENGINE_OPTIONS.get(model_dir.name, {}))
    return LLMEngine(EngineConfig(**{**cfg, **overrides}))


def _prefill_logits(engine: LLMEngine, prompt: list[int], lora_name: str | None = None) -> torch.Tensor:
    """Last-position logits of one prompt (under LoRA adapter `lora_name`), through the paged path (chunked by the
    budget)."""
    seq = Sequence("logits", prompt, SamplingParams(max_tokens=1, lora_name=lora_name), engine.config.block_size)
    engine.block_manager.allocate(seq)
    budget = engine.config.max_num_batched_tokens
    logits = None
    while seq.num_computed_tokens < seq.num_tokens:
        batch = ScheduledBatch()
        batch.add(seq, min(budget, seq.num_uncomputed_tokens))
        _, logits = engine.runner.forward(batch)
        seq.num_computed_tokens += batch.num_new_tokens[0]
    engine.block_manager.free(seq)
    return logits[0].cpu()


def _check_last_logits(engine: LLMEngine, model) -> None:
    """The engine's last-position logits of prompts of 17 and 300 tokens against transformers model `model`'s."""
    for n in (17, 300):
        prompt = _random_prompt(n, engine.model_config.vocab_size, seed=n)
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([prompt])).logits[0, -1]
        ours = _prefill_logits(engine, prompt)
        assert torch.isneginf(ours[ref.shape[0]:]).all()  # a pruned LM head's tokens (Apertus 1.5's): never drawn
        assert (ours[:ref.shape[0]] - ref).abs().max().item() < 1e-4, n


def _check_logits(model_dir: Path, max_num_batched_tokens: int = 512, prompt_lengths=PROMPT_LENGTHS,
                  reference_dir: Path | None = None, **options) -> None:
    """`reference_dir`: the checkpoint transformers reads, when it is not `model_dir` itself."""
    engine = _engine(model_dir, max_num_batched_tokens=max_num_batched_tokens, **options)
    _engine_logits_match(engine, reference_dir or model_dir, prompt_lengths)
    engine.close()


def _engine_logits_match(engine: LLMEngine, reference_dir: Path, prompt_lengths=PROMPT_LENGTHS) -> None:
    hf = _hf_model(reference_dir)
    vocab = engine.model_config.vocab_size
    for n in prompt_lengths:
        prompt = _random_prompt(n, vocab, seed=n)
        ours = _prefill_logits(engine, prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1].float()
        assert torch.isneginf(ours[ref.shape[0]:]).all()  # a pruned LM head's tokens (Apertus 1.5's): never drawn
        diff = (ours[:ref.shape[0]] - ref).abs().max().item()
        assert diff < 1e-4, f"{reference_dir.name}: prompt of {n} tokens, max |logit diff| {diff}"
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


def _mixed_prompts(vocab: int) -> list[list[int]]:
    lengths = (1, 17, 300, 45, 3, 77, 130, 60)
    prompts = [_random_prompt(n, vocab, seed=100 + i) for i, n in enumerate(lengths)]
    # Requests 3 and 7 share a 40-token prefix with request 2.
    prompts[3] = prompts[2][:40] + prompts[3][40:]
    prompts[7] = prompts[2][:40] + prompts[7][40:]
    return prompts


def _transformers_choices(model, prompt: list[int], continuation: list[int]) -> list[int]:
    """transformers' greedy choice after the prompt and after each longer prefix of `continuation`: equal to it
    exactly where `generate` would make it greedily, a token at a time. One forward over the whole sequence finds them
    at a tenth of the time (these references were most of the greedy tests' time). Where a model computes a decoded
    token unlike a prompt's (a Mamba-2 mixer's time_step_limit clamps a prompt's steps alone), `generate`'s tokens."""
    with torch.no_grad():
        if any((getattr(module, "time_step_limit", None) or (0.0,))[0] > 0 for module in model.modules()):
            made = model.generate(torch.tensor([prompt]), max_new_tokens=len(continuation), do_sample=False,
                                  pad_token_id=0)
            return made[0, len(prompt):].tolist()
        logits = model(torch.tensor([prompt + continuation[:-1]])).logits[0, len(prompt) - 1:]
    return logits.argmax(-1).tolist()


def _check_greedy(model_dir: Path, max_num_batched_tokens: int, max_new_tokens: int = GREEDY_NEW_TOKENS,
                  reference_dir: Path | None = None, **options) -> None:
    engine = _engine(model_dir, max_num_batched_tokens=max_num_batched_tokens, **options)
    _engine_greedy_matches(engine, reference_dir or model_dir, max_new_tokens)
    engine.close()


def _engine_greedy_matches(engine: LLMEngine, reference_dir: Path, max_new_tokens: int = GREEDY_NEW_TOKENS) -> None:
    results = _mixed_greedy(engine, max_new_tokens)
    hf = _hf_model(reference_dir)
    for i, (prompt, result) in enumerate(zip(_mixed_prompts(engine.model_config.vocab_size), results, strict=True)):
        assert len(result) == max_new_tokens
        choices = _transformers_choices(hf, prompt, result)
        diverged = next((j for j, (ours, ref) in enumerate(zip(result, choices)) if ours != ref), None)
        assert diverged is None, f"{reference_dir.name}: request {i} diverges from transformers at token {diverged}"


def _mixed_greedy(engine: LLMEngine, max_new_tokens: int = GREEDY_NEW_TOKENS) -> list[list[int]]:
    """The engine's greedy continuation of each mixed prompt, batched, request 2's prefix served from the cache to
    3 and 7; every page free after."""
    prompts = _mixed_prompts(engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    # Request 2 goes first so that its prefix blocks are cached when 3 and 7 arrive.
    engine.add_request("r2", prompts[2], params)
    first = engine.scheduler.waiting[0]
    while first.num_computed_tokens < 48:
        engine.step()
    for i, p in enumerate(prompts):
        if i != 2:
            engine.add_request(f"r{i}", p, params)
    results: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.token_ids
    # A hybrid model continues only from prefixes whose recurrent states were kept (test_hybrid_models.py).
    if not engine.block_manager.num_state_blocks:
        assert engine.block_manager.num_prefix_hit_tokens >= 2 * 32, "the shared prefix was not served from the cache"
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks
    return [results[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_logits_match_transformers(tiny_model_dirs, name):
    _check_logits(tiny_model_dirs[name])


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_logits_match_transformers_chunked(tiny_model_dirs, name):
    _check_logits(tiny_model_dirs[name], max_num_batched_tokens=32)


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
@pytest.mark.parametrize("budget", [512, 32])
def test_greedy_batch_matches_transformers(tiny_model_dirs, name, budget):
    _check_greedy(tiny_model_dirs[name], max_num_batched_tokens=budget)


# What tensor parallelism splits: GQA, tied and scaled RoPE, every bias (o's and down's added once after the
# ranks' sum), per-head q/k norms, sliding windows, q scaled by position, NoPE layers; experts (top-k of a
# router every rank runs alike, with shared experts, gated or not, and dense layers among them); Gemma's
# norms and soft caps, Granite's multipliers, Phi-3's fused q/k/v and gate/up, GLM's half-turned heads, gpt-oss's
# sinks and fused experts with biases, Llama 4's chunked attention and experts weighing their inputs, OLMo 2's
# and 3's norms over whole q and k projections (their squares summed across the ranks), DeepSeek's multi-head
# latent attention (heads split, the latent whole: q through a latent or one projection, interleaved RoPE),
# MiniMax-M2's experts by sigmoid score beside whole-projection q/k norms, Seed-OSS's and Ernie 4.5's biases (Ernie's
# RoPE pairs side by side, reordered within each rank's heads), Command R+'s per-head q/k layer norms split by heads,
# OLMo's q, k and v clipped a rank's share at a time, Hy4's gated heads and sinks (its hyper-connections whole), Beam's
# gates' biases a head, Gemma 4's layers of two head shapes in whole pages (two sliding layers' heads in one pool layer,
# a rank's share of each layer's where that layer's lie), KV-sharing layers, per-layer embeddings whole, experts [E,
# out, in] beside the MLP, MiniMax-M3's block-sparse attention (a rank's share of the indexer's heads, its key whole),
# Gemma 3n's AltUp streams whole and its sparse gates' mean and deviation over the whole width (summed across ranks).
SPLIT_MODELS = ("llama-gqa-untied", "llama3-rope-tied", "llama-biases", "qwen2-bias", "qwen3-qk-norm",
                "mistral-window", "ministral3", "smollm3", "mixtral", "qwen2-moe", "qwen3-moe", "glm4-moe",
                "gemma2", "gemma3", "granite", "phi3", "phi4-mini-longrope", "gpt-oss", "llama4", "olmo2", "olmo3",
                "deepseek-v3", "deepseek-v3-q-proj", "deepseek-v3.2", "glm5", "deepseek-v2", "deepseek-v2-lite",
                "minimax-m2", "glm4-moe-lite",
                "seed-oss", "ernie4.5", "ernie4.5-moe", "hunyuan", "glm", "glm4", "exaone4", "olmoe", "cohere",
                "cohere2", "granite-moe-shared", "granite4", "dots1", "hunyuan-moe", "exaone-moe", "granite-swa",
                "granite-moe-swa", "arcee", "flex-olmo", "afmoe", "gemma", "vaultgemma",
                "starcoder2", "jais2", "cwm", "apertus", "helium", "ministral", "olmo",
                "nemotron", "solar-open", "hy-v3", "youtu", "mellum", "laguna",
                "laguna-element-gates", "gpt-neox", "gpt-neox-sequential", "bloom", "mpt", "opt",
                "gpt-neo", "phi", "gptj", "phimoe", "dbrx", "falcon", "gpt2", "gpt-bigcode-mha", "stablelm",
                "minicpm3", "nanochat", "cohere2-moe", "cohere2-moe-sigmoid",
                "persimmon", "hyperclovax", "kolibri1", "flint", "axk1", "mimo-v2-flash", "sarvam-moe", "sarvam-mla",
                "apertus1p5", "axk2", "axk2-grouped", "cohere-compass", "longcat-flash", "hy-v4", "beam", "gemma4-e",
                "gemma4-moe", "gemma4-unified", "minimax-m3", "gemma3n")


@pytest.mark.parametrize("name", SPLIT_MODELS)
def test_a_model_split_across_two_ranks_matches_transformers(tiny_model_dirs, name):
    """Each rank computes its heads and MLP width in its own process, rank 0 samples: the logits and the
    greedy tokens (chunked, batched, a shared prefix served from the cache) are transformers'."""
    # One engine for both: starting its rank's process is most of the test's time.
    engine = _engine(tiny_model_dirs[name], max_num_batched_tokens=32, tensor_parallel_size=2)
    _engine_logits_match(engine, tiny_model_dirs[name])
    _engine_greedy_matches(engine, tiny_model_dirs[name])
    engine.close()


def test_a_pythia_checkpoint_as_released_reads_its_older_config_names_and_leaves_its_buffers(tiny_model_dirs, tmp_path):
    """Pythia's config.json names RoPE's part of a head and its base `rotary_pct` and `rotary_emb_base`, and its
    checkpoints hold the attention masks and RoPE frequencies as buffers beside the weights: the logits are still
    transformers' (which reads the same config as the newer one it writes)."""
    model_dir = shutil.copytree(tiny_model_dirs["gpt-neox"], tmp_path / "pythia")
    config = json.loads((model_dir / "config.json").read_text())
    del config["rope_parameters"]
    config.update(rotary_pct=0.5, rotary_emb_base=500.0)  # (not transformers' defaults, 0.25 and 10000)
    (model_dir / "config.json").write_text(json.dumps(config))
    tensors = load_file(model_dir / "model.safetensors")
    for layer in range(config["num_hidden_layers"]):
        p = f"gpt_neox.layers.{layer}.attention."
        tensors |= {p + "bias": torch.ones(1, 1, 8, 8, dtype=torch.bool), p + "masked_bias": torch.tensor(-1e9),
                    p + "rotary_emb.inv_freq": torch.ones(2)}
    save_file(tensors, model_dir / "model.safetensors")
    assert (load_model_config(model_dir).rotary_dim, load_model_config(model_dir).rope_theta) == (8, 500.0)
    _check_logits(model_dir)


@pytest.mark.parametrize("given, cap", [({}, 15.0), ({"final_logit_softcapping": None}, None)])
def test_nanochats_logits_are_capped_at_15_unless_its_config_says(tiny_model_dirs, tmp_path, given, cap):
    model_dir = shutil.copytree(tiny_model_dirs["nanochat"], tmp_path / "nanochat")
    config = json.loads((model_dir / "config.json").read_text())
    del config["final_logit_softcapping"]
    (model_dir / "config.json").write_text(json.dumps({**config, **given}))
    assert load_model_config(model_dir).final_logit_softcapping == cap


@pytest.mark.parametrize("given, removed, multipliers", [
    ({}, ("scale_emb", "scale_depth", "dim_model_base"), (12.0, 1.4 / 2 ** 0.5, 64 / 256)),  # (MiniCPM3-4B's)
    ({"scale_emb": 3, "scale_depth": None, "dim_model_base": None}, (), (3.0, 1.0, 1.0)),
])
def test_minicpm3s_scalings_read_as_transformers_reads_them(tiny_model_dirs, tmp_path, given, removed, multipliers):
    model_dir = copied_with_config(tiny_model_dirs["minicpm3"], tmp_path, given, removed)
    config = load_model_config(model_dir)
    assert (config.embedding_multiplier, config.residual_multiplier, config.logits_scaling) == pytest.approx(
        multipliers)


@pytest.mark.parametrize("changes, refused", [({"alibi": True}, "ALiBi"),
                                             ({"parallel_attn": False}, "without parallel_attn")])
def test_falcons_layouts_it_does_not_serve_are_refused_by_name(tiny_model_dirs, tmp_path, changes, refused):
    with pytest.raises(ModelConfigError, match=refused):
        load_model_config(copied_with_config(tiny_model_dirs["falcon"], tmp_path, changes))


@pytest.mark.parametrize("name, changes, refused", [
    ("mpt", {"attn_config": {"alibi_bias_max": 16}}, "alibi_bias_max=16"),
    ("mpt", {"attn_config": {"qk_ln": True}}, "qk_ln=True"),
    ("mpt", {"attn_config": {"attn_type": "multiquery_attention"}}, "attn_type='multiquery_attention'"),
    ("mpt", {"logit_scale": 0.5}, "logit_scale"),
    ("bloom", {"apply_residual_connection_post_layernorm": True}, "apply_residual_connection_post_layernorm"),
])
def test_alibi_models_layouts_transformers_computes_otherwise_are_refused_by_name(tiny_model_dirs, tmp_path, name,
                                                                                  changes, refused):
    with pytest.raises(ModelConfigError, match=re.escape(refused)):
        load_model_config(copied_with_config(tiny_model_dirs[name], tmp_path, changes))


def test_dbrxs_released_config_turns_by_its_attn_configs_theta_and_other_norms_of_its_experts_are_refused(
        tiny_model_dirs, tmp_path):
    """As released, RoPE's theta lies in attn_config alone (DBRX's 500000); transformers 5 saves it at the top level."""
    released = copied_with_config(tiny_model_dirs["dbrx"], tmp_path / "released", {"attn_config": {
        "kv_n_heads": 2, "clip_qkv": 8, "rope_theta": 500000}}, removed=("rope_parameters",))
    config = load_model_config(released)
    assert (config.rope_theta, config.clip_qkv, config.num_kv_heads) == (500000.0, 8.0, 2)
    assert load_model_config(tiny_model_dirs["dbrx"]).rope_theta == 10000.0
    with pytest.raises(ModelConfigError, match="moe_normalize_expert_weights 2"):
        load_model_config(copied_with_config(tiny_model_dirs["dbrx"], tmp_path / "p2", {"ffn_config": {
            "ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2, "moe_normalize_expert_weights": 2}}))


def test_clip_qkv_is_read_for_olmo_and_refused_where_transformers_would_clip_otherwise(tiny_model_dirs, tmp_path):
    assert load_model_config(copied_with_config(tiny_model_dirs["olmo"], tmp_path, {"clip_qkv": 8.0})).clip_qkv == 8.0
    with pytest.raises(ModelConfigError, match="clip_qkv is not supported for OlmoeForCausalLM"):
        load_model_config(copied_with_config(tiny_model_dirs["olmoe"], tmp_path, {"clip_qkv": 8.0}))


def test_falcons_older_config_names_read_as_its_own(tiny_model_dirs, tmp_path):
    """RefinedWeb's releases name its heads n_head and n_head_kv, its layers n_layer; ffn_hidden_size left out is 4
    times the hidden size."""
    saved = load_model_config(tiny_model_dirs["falcon"])
    older = copied_with_config(tiny_model_dirs["falcon"], tmp_path, {"n_head": 4, "n_head_kv": 2, "n_layer": 2},
                               ("num_attention_heads", "num_kv_heads", "num_hidden_layers", "ffn_hidden_size"))
    config = load_model_config(older)
    assert (config.num_heads, config.num_kv_heads, config.num_layers) == (saved.num_heads, 2, saved.num_layers)
    assert config.intermediate_size == 4 * config.hidden_size


def test_a_gpt2_checkpoint_as_released_holds_its_bare_model_and_its_masks(tiny_model_dirs, tmp_path):
    """GPT-2's releases hold the bare model's tensors (`wte`, `h.0.attn.c_attn`, ...) and each layer's attention mask
    buffers beside them: read under the causal LM's names, the masks left, the logits are transformers'."""
    model_dir = shutil.copytree(tiny_model_dirs["gpt2"], tmp_path / "gpt2")
    tensors = {name.removeprefix("transformer."): tensor
               for name, tensor in load_file(model_dir / "model.safetensors").items() if name != "lm_head.weight"}
    for layer in range(2):
        tensors |= {f"h.{layer}.attn.bias": torch.ones(1, 1, 8, 8), f"h.{layer}.attn.masked_bias": torch.tensor(-1e4)}
    save_file(tensors, model_dir / "model.safetensors")
    _check_logits(model_dir)


@pytest.mark.skipif(not SHARED, reason="../shared/models is not present")
@pytest.mark.parametrize("model_dir", SHARED, ids=lambda p: p.name)
def test_shared_models_logits(model_dir):
    _check_logits(model_dir)


@pytest.mark.skipif(not SHARED, reason="../shared/models is not present")
@pytest.mark.parametrize("model_dir", SHARED, ids=lambda p: p.name)
def test_shared_models_greedy_chunked(model_dir):
    _check_greedy(model_dir, max_num_batched_tokens=32)


@pytest.mark.parametrize("budget", [512, 32])
def test_longrope_long_context_matches_transformers(tiny_model_dirs, budget):
    """Served with its whole context, a LongRoPE model turns keys by the long factors, as transformers
    does for a sequence past the pretraining context: prompts longer than that give its logits and
    greedy tokens. (Shorter ones transformers would turn by the short factors, then switch mid-sequence.)"""
    model_dir = tiny_model_dirs["phi4-mini-longrope"]
    lengths = (LONGROPE_ORIGINAL_CONTEXT + 1, LONGROPE_ORIGINAL_CONTEXT + 150)
    _check_logits(model_dir, budget, prompt_lengths=lengths, max_model_len=None)
    engine = _engine(model_dir, max_num_batched_tokens=budget, max_model_len=None)
    hf = _hf_model(model_dir)
    prompts = [_random_prompt(n, engine.model_config.vocab_size, seed=300 + n) for n in lengths]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"long{i}", prompt, params)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.token_ids
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert results[f"long{i}"] == ref[0, len(prompt):].tolist(), f"request {i} diverges from transformers"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen2-bias"])
@pytest.mark.parametrize("budget", [512, 33])
def test_prompt_logprobs_match_transformers(tiny_model_dirs, name, budget, device):
    """Each prompt token's logprob and the top 3 there, as `transformers`' log-softmaxed logits give
    them; chunked (a budget of 33 leaves one-token chunks between longer ones), batched with other
    requests, and whole again for a prompt whose blocks the prefix cache holds."""
    model_dir = tiny_model_dirs[name]
    engine = _engine(model_dir, max_num_batched_tokens=budget, device=device)
    hf = _hf_model(model_dir)
    vocab = engine.model_config.vocab_size
    prompts = [_random_prompt(n, vocab, seed=200 + n) for n in (1, 40, 130)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for round_ in range(2):  # the second finds every prompt's blocks cached, and must not read them
        for i, prompt in enumerate(prompts):
            engine.add_request(f"p{round_}-{i}", prompt, params)
            engine.add_request(f"other{round_}-{i}", prompt[::-1], plain)
        firsts = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id.startswith("p") and out.prompt_logprobs is not None:
                    firsts[out.request_id] = out.prompt_logprobs
        for i, prompt in enumerate(prompts):
            records = firsts[f"p{round_}-{i}"]
            assert len(records) == len(prompt) and records[0] is None
            with torch.no_grad():
                ref = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)  # row p predicts token p + 1
            for position in range(1, len(prompt)):
                record, row = records[position], ref[position - 1]
                target = prompt[position]
                assert record[target] == pytest.approx(row[target].item(), abs=1e-4)
                top = row.topk(3)
                assert set(top.indices.tolist()) <= set(record) <= {*top.indices.tolist(), target}
                for token_id, value in zip(top.indices.tolist(), top.values.tolist()):
                    assert record[token_id] == pytest.approx(value, abs=1e-4)
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


def test_minimax_m2s_released_config_turns_its_rotary_dim(tiny_model_dirs, tmp_path):
    """MiniMax-M2's config as released: RoPE's part of a head as `rotary_dim` (transformers reads it as
    partial_rotary_factor), theta at the top level, and its settings transformers takes as fixed."""
    import shutil

    source = tiny_model_dirs["minimax-m2"]
    released = shutil.copytree(source, tmp_path / "minimax-m2")
    config = json.loads((released / "config.json").read_text())
    theta = config.pop("rope_parameters")["rope_theta"]
    (released / "config.json").write_text(json.dumps({
        **config, "rope_theta": theta, "rotary_dim": 8, "use_qk_norm": True, "qk_norm_type": "per_layer",
        "scoring_func": "sigmoid", "use_routing_bias": True}))
    engine = _engine(released)
    assert engine.model_config.rotary_dim == 8
    engine.close()
    _check_logits(released, reference_dir=source)


def test_ernie_moes_multi_token_prediction_block_is_left_unread(tiny_model_dirs, tmp_path):
    """Ernie 4.5's MoE checkpoints carry an MTP block (`model.mtp_*`), which transformers leaves unread too."""
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir = shutil.copytree(tiny_model_dirs["ernie4.5-moe"], tmp_path / "ernie")
    tensors = load_file(model_dir / "model.safetensors")
    save_file({**tensors, "model.mtp_block.0.input_layernorm.weight": torch.ones(64),
               "model.mtp_linear_proj.0.weight": torch.zeros(64, 128)}, model_dir / "model.safetensors")
    _check_logits(model_dir, prompt_lengths=(17,))


def test_exaone4s_window_pattern_as_a_string_names_its_sliding_layers(tiny_model_dirs, tmp_path):
    """EXAONE 4's released configs give `sliding_window_pattern` as "LLLG" (L a sliding-window layer, G a full one)
    beside their layer_types; without layer_types, the string says. Without a window, every layer turns by RoPE."""
    import shutil

    from engine.model_config_loader import load_model_config

    model_dir = shutil.copytree(tiny_model_dirs["exaone4"], tmp_path / "exaone4")
    config = json.loads((model_dir / "config.json").read_text())
    del config["layer_types"]
    for pattern, sliding in (("LLLG", {0, 1, 2}), ("LG", {0, 2}), (4, {0, 1, 2})):
        (model_dir / "config.json").write_text(json.dumps({**config, "sliding_window_pattern": pattern}))
        loaded = load_model_config(model_dir)
        assert (loaded.sliding_layers, loaded.rope_layers) == (sliding, sliding), pattern
    (model_dir / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    assert load_model_config(model_dir).rope_layers == frozenset(range(4))


def test_mimos_checkpoint_serves_qwen2s_model_leaving_its_mtp_layers_unread(tiny_model_dirs, tmp_path):
    """Xiaomi MiMo (MiMoForCausalLM, remote code): Qwen2's model, its MTP layers under `model.mtp_layers.` beside it,
    which vLLM's MiMo leaves unread as the model computes."""
    import shutil

    from safetensors.torch import load_file, save_file

    source = tiny_model_dirs["qwen2-bias"]
    model_dir = shutil.copytree(source, tmp_path / "mimo")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "architectures": ["MiMoForCausalLM"],
                                                       "model_type": "mimo", "num_nextn_predict_layers": 1}))
    tensors = load_file(model_dir / "model.safetensors")
    save_file({**tensors, "model.mtp_layers.0.input_layernorm.weight": torch.ones(64),
               "model.mtp_layers.0.input_proj.weight": torch.zeros(64, 128)}, model_dir / "model.safetensors")
    _check_logits(model_dir, reference_dir=source)


@pytest.mark.parametrize("name", ["sarvam-moe", "sarvam-mla"])
def test_sarvams_released_configs_read_as_transformers_reads_them(tiny_model_dirs, tmp_path, name):
    """Sarvam-30B's and Sarvam-105B's configs as released (for their remote code): their own architectures, the
    experts' counts and q/k/v biases by their names, RoPE's theta at the top level (Sarvam-30B's over whole heads
    where nothing says, unlike GLM-4.5's), Sarvam-105B's head_dim of vLLM's MLA and its YaRN named deepseek_yarn."""
    model_dir = shutil.copytree(tiny_model_dirs[name], tmp_path / name)
    config = json.loads((model_dir / "config.json").read_text())
    names = {"n_routed_experts": "num_experts", "n_shared_experts": "num_shared_experts"}
    released = {names.get(key, key): value for key, value in config.items() if key != "rope_parameters"}
    rope = config["rope_parameters"]
    released["rope_theta"] = rope["rope_theta"]
    if name == "sarvam-moe":
        released = {**{k: v for k, v in released.items() if k != "attention_bias"}, "use_qkv_bias": False,
                    "architectures": ["SarvamMoEForCausalLM"]}
    else:
        yarn = {key: value for key, value in rope.items() if key not in ("rope_theta", "rope_type")}
        released |= {"architectures": ["SarvamMLAForCausalLM"], "rope_scaling": {**yarn, "type": "deepseek_yarn"},
                     "head_dim": config["kv_lora_rank"] + config["qk_rope_head_dim"]}
    (model_dir / "config.json").write_text(json.dumps(released))
    loaded, saved = load_model_config(model_dir), load_model_config(tiny_model_dirs[name])
    assert dataclasses.replace(loaded, rope_scaling=None) == dataclasses.replace(saved, rope_scaling=None)
    assert {k: v for k, v in (loaded.rope_scaling or {}).items() if k != "rope_theta"} == \
        {k: v for k, v in (saved.rope_scaling or {}).items() if k != "rope_theta"}  # (the theta given apart)
    _check_logits(model_dir, reference_dir=tiny_model_dirs[name], prompt_lengths=(300,))


def test_apertus_1_5s_release_serves_its_text_model_leaving_its_tokenizers_unread(tmp_path):
    """Apertus1p5ForConditionalGeneration as transformers saves it: its text model under `model.language_model.`, its
    LM head pruned to the text's rows, its image and audio tokenizers (codes of its vocabulary) left unread; a text
    prompt's logits are transformers', the pruned rows' -inf."""
    text = {**COMMON, "head_dim": 16, "output_vocab_size": 400, "pad_token_id": 0}
    vision = dict(codebook_size=32, embed_dim=32, latent_channels=32, base_channels=32, channel_multiplier=[1, 1],
                  num_res_blocks=1, attn_resolutions=[], resolution=32, spatial_scale_factor=2)
    audio = dict(model_type="wavtokenizer_encoder", num_filters=4, upsampling_ratios=[2, 2], hidden_size=32,
                 codebook_size=32, codebook_dim=32, decoder_hidden_size=32, decoder_intermediate_size=32,
                 decoder_num_layers=1, decoder_attention_num_groups=4, num_lstm_layers=1)
    config = transformers.Apertus1p5Config(text_config=text, vision_config=vision, audio_config=audio,
                                           image_token_id=300, audio_token_id=301, image_token_offset=400,
                                           audio_token_offset=432)
    torch.manual_seed(15)
    model = transformers.Apertus1p5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("language_model" in name or name.startswith("lm_head")) and p.dim() > 1:
                p.normal_(0.0, 0.2)
            elif "language_model" in name:  # its norms
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(tmp_path / "apertus1p5")
    engine = _engine(tmp_path / "apertus1p5")
    assert (engine.model_config.architecture, engine.model_config.output_vocab_size) == ("Apertus1p5TextForCausalLM",
                                                                                        400)
    _check_last_logits(engine, model)
    engine.close()


def test_axk2s_released_config_reads_as_transformers_reads_it(tiny_model_dirs, tmp_path):
    """A.X K2's released configs give its dense layers by first_k_dense_replace and moe_layer_freq (transformers writes
    mlp_layer_types) and A.X K2 Light's leave the routing groups out (one group); half a grouping is refused."""
    released = copied_with_config(tiny_model_dirs["axk2"], tmp_path, {"first_k_dense_replace": 1, "moe_layer_freq": 1},
                                  removed=("mlp_layer_types", "n_group", "topk_group"))
    assert load_model_config(released) == load_model_config(tiny_model_dirs["axk2"])
    halved = copied_with_config(tiny_model_dirs["axk2"], tmp_path / "halved", {"n_group": 4, "topk_group": None})
    with pytest.raises(ModelConfigError, match="n_group and topk_group must be given together"):
        load_model_config(halved)


def test_axk1s_release_without_a_router_bias_routes_as_transformers_does(tiny_model_dirs, tmp_path):
    """A.X K1's releases hold no router correction bias (transformers routes with zeros) and hold the experts' output
    norm in the dense layers too, which compute without it; older configs give first_k_dense_replace."""
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir = shutil.copytree(tiny_model_dirs["axk1"], tmp_path / "axk1")
    tensors = load_file(model_dir / "model.safetensors")
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].any()
    kept = {name: t for name, t in tensors.items() if not name.endswith("e_score_correction_bias")}
    save_file({**kept, "model.layers.0.post_mlp_layernorm.weight": torch.ones(64)}, model_dir / "model.safetensors")
    config = json.loads((model_dir / "config.json").read_text())
    del config["mlp_layer_types"]
    (model_dir / "config.json").write_text(json.dumps({**config, "first_k_dense_replace": 1}))
    _check_logits(model_dir)


def test_hyperclovaxs_attention_multiplier_null_scales_by_head_dim(tiny_model_dirs, tmp_path):
    """HyperCLOVA X's attention_multiplier null (or absent) is head_dim ** -0.5 there, where Granite's absent is 1."""
    from engine.model_config_loader import load_model_config

    model_dir = copied_with_config(tiny_model_dirs["hyperclovax"], tmp_path, {"attention_multiplier": None})
    assert load_model_config(model_dir).attention_scale == pytest.approx(16 ** -0.5)
    _check_logits(model_dir, prompt_lengths=(17,))


def test_command_a_moes_config_without_layer_lists_reads_as_transformers_reads_it(tiny_model_dirs, tmp_path):
    """Without layer_types and mlp_layer_types, `first_k_dense_replace` dense layers (windowed by their own pattern)
    then the sliding_window_pattern's; a scoring transformers does not compute is refused by name."""
    from engine.model_config_loader import ModelConfigError, load_model_config

    model_dir = copied_with_config(tiny_model_dirs["cohere2-moe"], tmp_path, {"first_k_dense_replace": 1,
                                                                             "prefix_dense_sliding_window_pattern": 2},
                                   removed=("layer_types", "mlp_layer_types"))
    loaded = load_model_config(model_dir)
    assert (loaded.sliding_layers, loaded.moe.dense_layers, loaded.rope_layers) == ({0, 1, 2, 3}, {0}, {0, 1, 2, 3})
    _check_logits(model_dir, prompt_lengths=(300,))
    copied = copied_with_config(model_dir, tmp_path / "relu", {"expert_selection_fn": "relu"})
    with pytest.raises(ModelConfigError, match="expert_selection_fn 'relu' is not one transformers computes"):
        load_model_config(copied)


def test_mimo_v2_flashs_release_reads_as_transformers_reads_it(tiny_model_dirs, tmp_path):
    """MiMo-V2-Flash's pages hold its sliding layers' KV heads (twice a full layer's), head_dim wide; its release's
    SGLang-style `sliding_window_size` (the window less the query) and MTP layers (`model.mtp.`, which transformers
    leaves unread too) read as transformers reads them; attention biases, which no release has, are refused."""
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.model_config_loader import ModelConfigError, load_model_config

    source = tiny_model_dirs["mimo-v2-flash"]
    loaded = load_model_config(source)
    assert (loaded.num_kv_heads, loaded.head_dim, loaded.mimo_v2_flash.full_kv_heads) == (4, 24, 2)
    assert (loaded.rotary_dim, loaded.local_rotary_dim, loaded.sliding_layers) == (8, 8, {1, 2})
    model_dir = shutil.copytree(source, tmp_path / "mimo-v2-flash")
    config = json.loads((model_dir / "config.json").read_text())
    del config["sliding_window"]
    (model_dir / "config.json").write_text(json.dumps({**config, "sliding_window_size": 47}))
    tensors = load_file(model_dir / "model.safetensors")
    save_file({**tensors, "model.mtp.layers.0.input_layernorm.weight": torch.ones(64),
               "model.mtp.layers.0.eh_proj.weight": torch.zeros(64, 128)}, model_dir / "model.safetensors")
    assert load_model_config(model_dir).sliding_window == 48
    _check_logits(model_dir, reference_dir=source, prompt_lengths=(300,))
    (model_dir / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    with pytest.raises(ModelConfigError, match="attention_bias is not supported for MiMo-V2-Flash"):
        load_model_config(model_dir)


def test_mellums_mtp_layer_is_left_unread_and_a_partial_rope_refused(tiny_model_dirs, tmp_path):
    """Mellum 2's checkpoints carry an MTP layer under `mtp.`, which transformers leaves unread too; a
    partial_rotary_factor is refused by name, since transformers' Mellum fails on it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.model_config_loader import ModelConfigError, load_model_config

    model_dir = shutil.copytree(tiny_model_dirs["mellum"], tmp_path / "mellum")
    tensors = load_file(model_dir / "model.safetensors")
    save_file({**tensors, "mtp.layers.0.input_layernorm.weight": torch.ones(64),
               "mtp.eh_proj.weight": torch.zeros(64, 128)}, model_dir / "model.safetensors")
    _check_logits(model_dir, reference_dir=tiny_model_dirs["mellum"], prompt_lengths=(17,))
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_parameters"]["full_attention"]["partial_rotary_factor"] = 0.5
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match="partial_rotary_factor in Mellum's rope_parameters is not supported"):
        load_model_config(model_dir)


@pytest.mark.parametrize("layer_types, refused", [
    (["mamba", "mamba"], "Mamba-2 layers alone is not supported"),
    (["mamba", "shortconv"], r"must name Mamba or attention layers, one a layer of 2, got \['shortconv'\]"),
])
def test_granite4s_layers_of_other_kinds_are_refused_by_name(tiny_model_dirs, tmp_path, layer_types, refused):
    import shutil

    from engine.model_config_loader import ModelConfigError, load_model_config

    model_dir = shutil.copytree(tiny_model_dirs["granite4"], tmp_path / "granite4-h")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "layer_types": layer_types}))
    with pytest.raises(ModelConfigError, match=refused):
        load_model_config(model_dir)


def test_glm_multi_token_prediction_layers_are_left_unread(tiny_model_dirs, tmp_path):
    """GLM-4.5 checkpoints carry layers past the model's (multi-token prediction, for speculative
    decoding): left unread, as transformers leaves them; an unknown tensor within the model's
    layers is still refused."""
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.checkpoint import WeightsError

    model_dir = shutil.copytree(tiny_model_dirs["glm4-moe"], tmp_path / "glm")
    config = json.loads((model_dir / "config.json").read_text())
    assert "partial_rotary_factor" not in config or config["partial_rotary_factor"] == 0.5
    tensors = load_file(model_dir / "model.safetensors")
    beyond = config["num_hidden_layers"]
    save_file({**tensors, f"model.layers.{beyond}.eh_proj.weight": torch.zeros(4, 4),
               f"model.layers.{beyond}.mlp.gate.weight": torch.zeros(8, 64)}, model_dir / "model.safetensors")
    _check_logits(model_dir)
    save_file({**tensors, "model.layers.1.eh_proj.weight": torch.zeros(4, 4)}, model_dir / "model.safetensors")
    with pytest.raises(WeightsError, match="model.layers.1.eh_proj.weight"):
        _engine(model_dir)


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v3-q-proj"])
def test_mla_pages_hold_the_latent_not_each_heads_keys_and_values(tiny_model_dirs, name):
    """A DeepSeek model's KV takes MLA's room: per token and layer, the RoPE part of k and the latent
    (the row's second half padded when its width is odd), whatever its number of heads."""
    from engine.kv_pool import kv_block_bytes

    config = json.loads((tiny_model_dirs[name] / "config.json").read_text())
    engine = _engine(tiny_model_dirs[name])
    row = config["qk_rope_head_dim"] + config["kv_lora_rank"]
    per_token_layer = row + row % 2
    block_size = engine.config.block_size
    assert kv_block_bytes(engine.model_config, block_size, torch.float32) == \
        config["num_hidden_layers"] * block_size * per_token_layer * 4
    assert engine.runner.kv_pool.tensor.shape[2] == 1  # one row every head reads


def test_sparse_mla_pages_hold_the_indexers_key_beside_the_latent(tiny_model_dirs):
    from engine.kv_pool import kv_block_bytes

    engine = _engine(tiny_model_dirs["deepseek-v3.2"])
    block_size = engine.config.block_size
    assert kv_block_bytes(engine.model_config, block_size, torch.float32) == 3 * block_size * (8 + 24 + 16) * 4
    engine.close()


@pytest.mark.parametrize("given", [{}, {"index_topk_freq": 3, "index_skip_topk_offset": 3},
                                   {"index_topk_pattern": "FFSFSS"}, {"indexer_types": ["full", "shared"] * 3}])
def test_glm5s_layers_sharing_an_indexers_choice_are_transformers(given):
    """Which of GLM-5's layers reuse the last full layer's choice: `indexer_types`, else `index_topk_pattern`, else
    every `index_topk_freq`-th layer from an offset, as transformers' config reads them."""
    from engine.mla_config import GLM_MOE_DSA, read_mla_config

    cfg = {"num_hidden_layers": 6, "q_lora_rank": 32, "kv_lora_rank": 24, "qk_nope_head_dim": 16,
           "qk_rope_head_dim": 8, "v_head_dim": 20, "index_head_dim": 16, **given}
    expected = transformers.GlmMoeDsaConfig(**cfg).indexer_types
    assert read_mla_config(cfg, GLM_MOE_DSA).shared_index_layers == \
        {i for i, kind in enumerate(expected) if kind == "shared"}


@pytest.mark.parametrize("name, architecture, model_type, text_architecture, encoders", [
    ("gemma3n", "Gemma3nForConditionalGeneration", "gemma3n", "Gemma3nForCausalLM",
     ("model.vision_tower.timm_model.conv_stem.weight", "model.embed_audio.embedding.weight")),
    ("gemma4-unified", "Gemma4UnifiedForConditionalGeneration", "gemma4_unified", "Gemma4UnifiedForCausalLM",
     ("model.embed_vision.patch_dense.weight", "model.embed_audio.embedding_projection.weight")),
])
def test_a_multimodal_release_serves_its_text_model_leaving_its_encoders_unread(tiny_model_dirs, tmp_path, name,
                                                                                architecture, model_type,
                                                                                text_architecture, encoders):
    """Gemma 3n and Gemma 4 unified as released (the text model's settings in text_config, its tensors under
    `model.language_model.`, image and audio encoders beside them): the text model's logits are its causal LM's on
    the same weights."""
    text_dir = tiny_model_dirs[name]
    model_dir = Path(shutil.copytree(text_dir, tmp_path / "released"))
    text_config = json.loads((text_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": [architecture], "model_type": model_type, "text_config": text_config,
        "vision_config": {}, "audio_config": {}}))
    tensors = {name.replace("model.", "model.language_model.", 1): t
               for name, t in load_file(text_dir / "model.safetensors").items()}
    tensors |= {encoder: torch.ones(4, 4) for encoder in encoders}
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    assert load_model_config(model_dir).architecture == text_architecture
    _check_logits(model_dir, prompt_lengths=(17,), reference_dir=text_dir)


@pytest.mark.parametrize("num_layers", [4, 11])
def test_hy4s_layers_and_settings_its_config_leaves_out_are_transformers_defaults(tiny_model_dirs, tmp_path,
                                                                                 num_layers):
    """Which of Hy4's layers share an indexer's choice and which MLPs are dense, its routing's scale, its clamp (0:
    none) and hyper-connections, where config.json leaves them out: as transformers' HYV4Config defaults them."""
    from engine.hy_v4_config import HyperConnections

    removed = ("indexer_types", "mlp_layer_types", "layer_types", "routed_scaling_factor", "hc_mult", "hc_eps",
               "hc_magnitude")
    model_dir = copied_with_config(tiny_model_dirs["hy-v4"], tmp_path, {"num_hidden_layers": num_layers,
                                                                        "swiglu_limit": 0.0}, removed)
    expected = transformers.HYV4Config(**json.loads((model_dir / "config.json").read_text()))
    config = load_model_config(model_dir)
    assert config.mla.shared_index_layers == {i for i, kind in enumerate(expected.indexer_types) if kind == "shared"}
    assert config.moe.dense_layers == {i for i, kind in enumerate(expected.mlp_layer_types) if kind == "dense"}
    assert config.moe.routed_scaling_factor == expected.routed_scaling_factor
    assert config.hyper_connections == HyperConnections(expected.hc_mult, expected.hc_magnitude, expected.hc_eps, None)


def test_a_hy4_checkpoint_by_transformers_module_names_is_read_alike(tiny_model_dirs, tmp_path):
    """transformers saves Hy4 by its releases' names (`hc_pre.hc_attn_layer.hc_fn`, `learnable_sink_param`,
    `linear_gate`); a checkpoint saved by transformers' modules' own (`attn_hc.fn`, `sinks`, `gate_proj`,
    `hc_head.hc_fn`) gives the same logits."""
    released = tiny_model_dirs["hy-v4"]
    model_dir = Path(shutil.copytree(released, tmp_path / "hy4"))
    save_file({name: t.contiguous() for name, t in _hf_model(released).state_dict().items()},
              model_dir / "model.safetensors", metadata={"format": "pt"})
    assert "model.hc_head.hc_fn" in load_file(model_dir / "model.safetensors")
    _check_logits(model_dir, prompt_lengths=(17,), reference_dir=released)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_kv_cache_takes_a_quarter_of_float32s_room_and_stays_near_transformers(tiny_model_dirs, kv_cache_dtype,
                                                                                   device):
    """--kv-cache-dtype fp8: pages of one byte a number, cast without scales. What that costs is
    precision: past the first chunk the logits stay near transformers' but no closer (within 2, a 2-
    or 3-bit mantissa's worth); the first chunk's are as exact as ever (it reads no page)."""
    from engine.kv_pool import kv_block_bytes

    model_dir = tiny_model_dirs["llama-gqa-untied"]
    exact = _engine(model_dir, device=device)
    engine = _engine(model_dir, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=32, device=device)
    assert engine.runner.kv_pool.tensor.element_size() == 1
    assert kv_block_bytes(engine.model_config, 16, engine.runner.kv_pool.tensor.dtype) * 4 == \
        kv_block_bytes(exact.model_config, 16, exact.runner.kv_pool.tensor.dtype)
    hf = _hf_model(model_dir)
    for n in (17, 100, 300):
        prompt = _random_prompt(n, engine.model_config.vocab_size, seed=n)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1]
        diff = (_prefill_logits(engine, prompt) - ref).abs().max().item()
        assert diff < 1e-4 if n <= 32 else 1e-3 < diff < 2.0, (n, diff)


def test_llama4s_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """Llama 4 as released (Llama4ForConditionalGeneration: the text model under `language_model.`,
    its settings in text_config, a vision model beside it): the text model is served, its image encoder
    loaded beside it (tests/parity/test_llama4_images.py), and its logits equal the checkpoint's language
    model's."""
    config_cls, extra, _ = TINY_MODELS["llama4"]
    text = getattr(transformers, config_cls)(**{**COMMON, **extra})
    vision = transformers.Llama4VisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=128, image_size=28, patch_size=14, vision_output_dim=32,
                                             projector_input_dim=32, projector_output_dim=32, pixel_shuffle_ratio=0.5)
    torch.manual_seed(4)
    model = transformers.Llama4ForConditionalGeneration(
        transformers.Llama4Config(text_config=text.to_dict(), vision_config=vision.to_dict())).eval()
    model.save_pretrained(tmp_path / "llama4")
    engine = _engine(tmp_path / "llama4", max_num_batched_tokens=32)
    assert engine.model_config.architecture == "Llama4ForCausalLM" and engine.model_config.multimodal is not None
    assert engine.runner.image_encoder is not None
    for n in (17, 100):
        prompt = _random_prompt(n, engine.model_config.vocab_size, seed=n)
        with torch.no_grad():
            ref = model.language_model(input_ids=torch.tensor([prompt])).logits[0, -1]
        assert (_prefill_logits(engine, prompt) - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("text_model", ["ministral3", "mistral"])
def test_mistral3s_multimodal_checkpoint_serves_its_text_model(tmp_path, text_model):
    """Mistral 3 as released (Mistral3ForConditionalGeneration: Mistral Small 3.1/3.2 with a Mistral text
    model, Ministral 3 with its own), the vision tower left unread, in either layout of names (llava's,
    as on the hub; transformers 5's, as it saves): logits equal the checkpoint's language model's."""
    from safetensors.torch import load_file, save_file

    config_cls, extra, _ = TINY_MODELS["ministral3" if text_model == "ministral3" else "mistral-window"]
    text = getattr(transformers, config_cls)(**{**COMMON, **extra})
    vision = transformers.PixtralVisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                              intermediate_size=64, image_size=28, patch_size=14, head_dim=16)
    torch.manual_seed(5)
    model = transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), spatial_merge_size=1)).eval()
    model.save_pretrained(tmp_path / "hub")
    tensors = load_file(tmp_path / "hub" / "model.safetensors")
    assert any(name.startswith("vision_tower.") for name in tensors)  # its LM head is its embedding: not saved
    # The names transformers 5 computes with (and some tools save): the language model under model.
    internal = shutil.copytree(tmp_path / "hub", tmp_path / "internal")
    save_file({name.removeprefix("language_model.") if name == "language_model.lm_head.weight" else
               "model." + name.removeprefix("language_model.model.").removeprefix("model.")
               if name.startswith("language_model.model.") else "model." + name: t
               for name, t in tensors.items()}, internal / "model.safetensors")
    for model_dir in (tmp_path / "hub", internal):
        engine = _engine(model_dir, max_num_batched_tokens=32)
        assert engine.model_config.architecture == {"ministral3": "Ministral3ForCausalLM",
                                                    "mistral": "MistralForCausalLM"}[text_model]
        _check_last_logits(engine, model)


def test_gemma3s_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """Gemma 3 as released (Gemma3ForConditionalGeneration: the language model under `language_model.`, a
    SigLIP tower beside it, the LM head its embedding) and as transformers 5 saves it; and its config as
    the 4B's, whose text_config gives only sizes, window and RoPE scaling, the rest Gemma3TextConfig's
    defaults (8 heads of 256, 4 kv heads, theta 1e6 and 1e4, a window layer in every 6 but the last)."""
    from safetensors.torch import load_file, save_file

    text = transformers.Gemma3TextConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=7,
                                         sliding_window=16, rope_scaling={"rope_type": "linear", "factor": 8.0},
                                         initializer_range=0.2)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(6)
    model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)).eval()
    model.save_pretrained(tmp_path / "hub")
    tensors = load_file(tmp_path / "hub" / "model.safetensors")
    assert any(name.startswith("language_model.model.") for name in tensors)
    internal = shutil.copytree(tmp_path / "hub", tmp_path / "internal")
    save_file({("model.language_model." + name.removeprefix("language_model.model.")
                if name.startswith("language_model.model.") else "model." + name): t
               for name, t in tensors.items()}, internal / "model.safetensors")
    released = shutil.copytree(tmp_path / "hub", tmp_path / "released")
    config = json.loads((released / "config.json").read_text())
    config["text_config"] = {"hidden_size": 64, "intermediate_size": 160, "model_type": "gemma3_text",
                             "num_hidden_layers": 7, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                             "sliding_window": 16}
    (released / "config.json").write_text(json.dumps(config))
    for model_dir in (tmp_path / "hub", internal, released):
        engine = _engine(model_dir, max_num_batched_tokens=32, max_model_len=1024)
        assert engine.model_config.architecture == "Gemma3ForCausalLM"
        assert engine.model_config.sliding_layers == frozenset({0, 1, 2, 3, 4, 6})
        _check_last_logits(engine, model)


def test_kimi_k25s_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """Kimi K2.5 as released (remote code's KimiK25ForConditionalGeneration, its text model `kimi_k2`, DeepSeek-V3's,
    under `language_model.`, each expert's projections of their own, a MoonViT tower and projector beside it)."""
    from safetensors.torch import save_file

    text = transformers.DeepseekV3Config(**{**COMMON, **TINY_MODELS["deepseek-v3"][1], "tie_word_embeddings": False})
    vision = transformers.Kimi_K25VisionConfig(num_attention_heads=2, num_hidden_layers=1, hidden_size=32,
                                               intermediate_size=64, pos_emb_height=8, pos_emb_width=8)
    torch.manual_seed(25)
    model = transformers.Kimi_K25ForConditionalGeneration(transformers.Kimi_K25Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), tie_word_embeddings=False)).eval()
    model.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    released = {}
    for name, t in model.state_dict().items():
        if name.startswith("model.language_model."):
            name = "language_model.model." + name.removeprefix("model.language_model.")
        else:
            name = "language_model.lm_head.weight" if name == "lm_head.weight" else name.removeprefix("model.")
        if name.endswith("experts.gate_up_proj"):  # [E, gate + up, in], as transformers holds them
            for e, (gate, up) in enumerate(zip(*t.chunk(2, dim=1))):
                released[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate.contiguous()
                released[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up.contiguous()
        elif name.endswith("experts.down_proj"):
            released |= {name.replace("down_proj", f"{e}.down_proj.weight"): d.contiguous() for e, d in enumerate(t)}
        else:
            released[name] = t.contiguous()
    model_dir = tmp_path / "released"
    model_dir.mkdir()
    save_file(released, model_dir / "model.safetensors")
    (model_dir / "config.json").write_text(json.dumps({
        **config, "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": {**config["text_config"], "model_type": "kimi_k2"}}))
    engine = _engine(model_dir, max_num_batched_tokens=32)
    assert engine.model_config.architecture == "DeepseekV3ForCausalLM"
    _check_last_logits(engine, model)
    engine.close()


def _mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [E, in, out] as MXFP4 blocks [E, out, in / 32, 16] and scales [E, out, in / 32], each group
    of 32 numbers to the nearest of the e2m1 values times its power of two."""
    from engine.mxfp4_weights import E2M1_VALUES

    lut = torch.tensor(E2M1_VALUES)
    groups = weight.transpose(1, 2).unflatten(-1, (-1, 32))  # [E, out, G, 32]
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-8) / 6.0))  # the group's largest fits in 6
    codes = ((groups / torch.exp2(exponent).unsqueeze(-1)).unsqueeze(-1) - lut).abs().argmin(-1)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent.int() + 127).to(torch.uint8)


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_gpt_oss_released_in_mxfp4_computes_as_its_dequantized_weights(tiny_model_dirs, tmp_path,
                                                                         tensor_parallel_size):
    """gpt-oss's experts as released: MXFP4 blocks and scales, dequantized as they load (as transformers'
    own dequantizer does), split across ranks after; the logits equal transformers' on the dequantized weights."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from engine.mxfp4_weights import dequantize_mxfp4

    model_dir = shutil.copytree(tiny_model_dirs["gpt-oss"], tmp_path / "mxfp4")
    tensors = load_file(model_dir / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _mxfp4(tensor.float())
            quantized |= {name + "_blocks": blocks, name + "_scales": scales}
            dequantized[name] = dequantize_mxfp4(blocks, scales)
            assert torch.equal(dequantized[name], convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            assert (dequantized[name] - tensor).abs().max() < tensor.abs().max() / 4  # near, not equal
        else:
            quantized[name] = tensor
    save_file(quantized, model_dir / "model.safetensors")
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn", "router"]}
    (model_dir / "config.json").write_text(json.dumps(config))
    reference = _hf_model(tiny_model_dirs["gpt-oss"])
    reference.load_state_dict({**reference.state_dict(), **dequantized})
    engine = _engine(model_dir, tensor_parallel_size=tensor_parallel_size)
    for n in (17, 100):
        prompt = _random_prompt(n, engine.model_config.vocab_size, seed=n)
        with torch.no_grad():
            ref = reference(torch.tensor([prompt])).logits[0, -1]
        assert (_prefill_logits(engine, prompt) - ref).abs().max().item() < 1e-4
    engine.close()
