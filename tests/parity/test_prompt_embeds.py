"""Prompts given as embeddings (vLLM's prompt embeds) against transformers' `inputs_embeds` on the same
weights: logits and greedy tokens, chunked, batched beside token prompts, and after a preemption."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.block_hash import embeddings_digest
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.prompt_embeds import WithheldEmbeddings
from engine.sampling_params import SamplingParams
from tests.parity.conftest import decoded_from_handed_over_pages, greedy_outputs, transformers

# Granite scales given embeddings as its own (embedding_multiplier); Gemma 2 and 3 scale inside
# their embedding module, so given ones are not, and so does Gemma 4 (the 31B's kind: no per-layer embeddings);
# DeepSeek-V3's attention is MLA.
ARCHITECTURES = ["llama-gqa-untied", "granite", "gemma2", "gemma3", "deepseek-v3", "gemma4-k-eq-v"]
PROMPT_ROWS = 45
MAX_NEW_TOKENS = 12


def _hf(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def _embeddings(hf, seed: int, n: int = PROMPT_ROWS) -> torch.Tensor:
    """Token embeddings moved off every token's (no placeholder id or real prompt gives them)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, hf.config.vocab_size, (n,), generator=g)
    with torch.no_grad():
        rows = hf.get_input_embeddings()(ids)
    return rows + 0.3 * rows.std() * torch.randn(rows.shape, generator=g)


def _hf_greedy(hf, embeds: torch.Tensor) -> list[int]:
    """Greedy tokens after `embeds`, one forward pass per token over the whole sequence."""
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_NEW_TOKENS):
            made = hf.get_input_embeddings()(torch.tensor(tokens, dtype=torch.int64))
            logits = hf(inputs_embeds=torch.cat([embeds, made]).unsqueeze(0)).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens


def _engine(model_dir, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"model": str(model_dir), "dtype": "float32", "num_kv_blocks": 64,
                                     "max_num_batched_tokens": 512, **options}))


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], torch.Tensor | None]]) -> dict[str, list[int]]:
    return greedy_outputs(engine, {request_id: (prompt, {"prompt_embeds": embeds})
                                   for request_id, (prompt, embeds) in requests.items()}, MAX_NEW_TOKENS)


@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.parametrize("budget", [512, 16])
def test_greedy_tokens_from_given_embeddings_match_transformers_inputs_embeds(tiny_model_dirs, name, budget):
    model_dir = tiny_model_dirs[name]
    hf = _hf(model_dir)
    embeds = [_embeddings(hf, seed) for seed in (1, 2)]
    token_prompt = torch.randint(3, hf.config.vocab_size, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = _engine(model_dir, max_num_batched_tokens=budget)
    results = _run(engine, {  # placeholders of the same ids: only the embeddings tell them apart
        "a": ([0] * PROMPT_ROWS, embeds[0]), "b": ([0] * PROMPT_ROWS, embeds[1]), "ids": (token_prompt, None)})
    assert results["a"] == _hf_greedy(hf, embeds[0])
    assert results["b"] == _hf_greedy(hf, embeds[1])
    with torch.no_grad():
        out = hf.generate(torch.tensor([token_prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert results["ids"] == out[0, len(token_prompt):].tolist()


@pytest.mark.parametrize("name", ["llama-gqa-untied", "granite"])
def test_first_token_logits_match_transformers(tiny_model_dirs, name):
    model_dir = tiny_model_dirs[name]
    hf = _hf(model_dir)
    embeds = _embeddings(hf, seed=4)
    engine = _engine(model_dir)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    engine.add_request("r", [0] * PROMPT_ROWS, params, prompt_embeds=embeds)
    outputs = [out for _ in range(4) for out in engine.step()]
    ours = outputs[-1].new_logprobs[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(inputs_embeds=embeds.unsqueeze(0)).logits[0, -1], dim=-1)
    for token_id, logprob in ours.items():
        assert abs(logprob - float(ref[token_id])) < 1e-4


def test_a_preempted_request_computes_its_given_embeddings_again(tiny_model_dirs):
    """Pages too few for both: one is preempted and recomputed from its embeddings, same tokens."""
    model_dir = tiny_model_dirs["llama-gqa-untied"]
    hf = _hf(model_dir)
    embeds = [_embeddings(hf, seed, n=60) for seed in (5, 6)]
    requests = {f"r{i}": ([0] * 60, e) for i, e in enumerate(embeds)}
    engine = _engine(model_dir, num_kv_blocks=8, max_num_batched_tokens=128)  # 128 tokens: not both at 72
    results = _run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    assert results == {f"r{i}": _hf_greedy(hf, e) for i, e in enumerate(embeds)}


def _decoded_with_rows_withheld(model_dir, embeds: list[torch.Tensor], max_tokens: list[int]) -> dict:
    """Each prompt prefilled by one engine and decoded by another from a copy of its pages, which has its
    embeddings' shape and digest but not their rows (a decode worker's, as the gateway sends them); the
    decoding one has 9 pages, so the second request is preempted at its first step."""
    decode = _engine(model_dir, num_kv_blocks=9, max_num_batched_tokens=128)
    outputs = decoded_from_handed_over_pages(_engine(model_dir), decode, {
        f"r{i}": ([0] * len(e), n, {"prompt_embeds": e},
                  {"prompt_embeds": WithheldEmbeddings(tuple(e.shape), _digest_of_rows(e))})
        for i, (e, n) in enumerate(zip(embeds, max_tokens, strict=True))})
    assert decode.scheduler.num_preemptions == 1
    return outputs


def _digest_of_rows(embeds: torch.Tensor) -> str:
    return embeddings_digest("float32", tuple(embeds.shape), embeds.contiguous().view(torch.uint8).numpy().tobytes())


def test_a_request_decoded_without_its_rows_goes_on_from_its_cached_pages_after_a_preemption(tiny_model_dirs):
    """Preempted, its pages kept by the prefix cache while the other request ends: readmitted from them, it
    makes transformers' tokens (64 rows: 4 whole pages)."""
    model_dir = tiny_model_dirs["llama-gqa-untied"]
    hf = _hf(model_dir)
    embeds = [_embeddings(hf, seed, n=64) for seed in (7, 8)]
    outputs = _decoded_with_rows_withheld(model_dir, embeds, [MAX_NEW_TOKENS, MAX_NEW_TOKENS])
    for i, e in enumerate(embeds):
        assert outputs[f"r{i}"].finish_reason == "length"
        assert outputs[f"r{i}"].token_ids == _hf_greedy(hf, e)


def test_a_request_decoded_without_its_rows_ends_withheld_where_its_cache_lost_them(tiny_model_dirs):
    """The other request's 40 tokens take two of its cached pages: its prompt cannot be computed again
    without its rows, so it ends "withheld" (its caller resumes it with them), its pages freed."""
    model_dir = tiny_model_dirs["llama-gqa-untied"]
    hf = _hf(model_dir)
    embeds = [_embeddings(hf, seed, n=64) for seed in (7, 8)]
    outputs = _decoded_with_rows_withheld(model_dir, embeds, [40, MAX_NEW_TOKENS])
    assert outputs["r0"].finish_reason == "length" and len(outputs["r0"].token_ids) == 40
    assert outputs["r1"].finish_reason == "withheld"
    assert outputs["r1"].token_ids == _hf_greedy(hf, embeds[1])[:1]


def test_withheld_rows_are_refused_where_the_prompt_is_computed(tiny_model_dirs):
    engine = _engine(tiny_model_dirs["llama-gqa-untied"])
    with pytest.raises(ValueError, match="needed to prefill it"):
        engine.add_request("r", [0] * 8, SamplingParams(max_tokens=2), prompt_embeds=WithheldEmbeddings((8, 64), "d"))


def test_given_embeddings_are_checked(tiny_model_dirs):
    engine = _engine(tiny_model_dirs["llama-gqa-untied"])
    hidden = engine.model_config.hidden_size
    params = SamplingParams(max_tokens=4)
    refusals = {
        "the model's hidden size": ([0] * 3, torch.zeros(3, hidden + 1)),
        "rows for a prompt of 4 tokens": ([0] * 4, torch.zeros(3, hidden)),
        "not finite": ([0] * 2, torch.tensor([[float("nan")] * hidden, [0.0] * hidden])),
    }
    for message, (prompt, embeds) in refusals.items():
        with pytest.raises(ValueError, match=message):
            engine.add_request("r", prompt, params, prompt_embeds=embeds)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.add_request("r", [0] * 3, dataclasses.replace(params, prompt_logprobs=1),
                           prompt_embeds=torch.zeros(3, hidden))
    assert not engine.has_unfinished_requests()


def test_cached_blocks_are_shared_only_by_the_same_embeddings(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama-gqa-untied"]
    hf = _hf(model_dir)
    first, second = _embeddings(hf, seed=7, n=48), _embeddings(hf, seed=8, n=48)
    engine = _engine(model_dir)
    _run(engine, {"a": ([0] * 48, first)})
    _run(engine, {"b": ([0] * 48, second)})
    assert engine.block_manager.num_prefix_hit_tokens == 0
    _run(engine, {"c": ([0] * 48, first.clone())})
    assert engine.block_manager.num_prefix_hit_tokens == 32  # the last block's last token is computed again
