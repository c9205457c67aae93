"""Embedding requests (SamplingParams.embed): the model's last hidden state at a prompt's last
token, equal to transformers' `AutoModel(...).last_hidden_state[:, -1]` (the final norm applied),
the pooling vLLM gives a decoder-only model; whether the prompt is computed whole, in chunks, or
read from the prefix cache but for its last token, and batched with generating requests; and from
a checkpoint saved as the bare model, as Qwen3-Embedding's are (no `model.` prefix, no lm_head)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.checkpoint import read_model_config
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config_loader import ModelConfigError
from engine.sampling_params import SamplingParams
from services.gateway.score_api import is_cross_encoder
from tests.parity.conftest import COMMON

transformers = pytest.importorskip("transformers")

NAMES = ["llama-gqa-untied", "qwen2-bias", "qwen3-qk-norm", "mistral-window"]
PROMPTS = [[1, 5, 9, 42], [1, *range(20, 320)]]  # one chunk; several of 64 tokens (past the window of 48 too)
EMBED = SamplingParams(max_tokens=1, embed=True)


def transformers_embeddings(model_dir, prompts: list[list[int]]) -> list[torch.Tensor]:
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts]


def embeddings(engine: LLMEngine, prompts: list[list[int]]) -> list[torch.Tensor]:
    finished = {o.request_id: o for o in engine.generate(prompts, EMBED) if o.finished}
    ordered = sorted(finished, key=lambda r: int(r.removeprefix("gen-")))
    assert all(finished[r].finish_reason in ("length", "stop") for r in ordered)
    return [torch.tensor(finished[r].embedding) for r in ordered]


@pytest.mark.parametrize("name", NAMES)
def test_embeddings_equal_transformers_last_hidden_state(tiny_model_dirs, name):
    model_dir = tiny_model_dirs[name]
    expected = transformers_embeddings(model_dir, PROMPTS)
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, max_num_batched_tokens=64))
    for made in (embeddings(engine, PROMPTS), embeddings(engine, PROMPTS)):  # the second: from the prefix cache
        for got, want in zip(made, expected):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert engine.block_manager.num_free_blocks == 64  # nothing held once they are done


def test_an_embedding_request_batched_with_generation_changes_neither(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama-gqa-untied"]
    [expected] = transformers_embeddings(model_dir, PROMPTS[1:])
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, max_num_batched_tokens=64))
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    [alone] = [o.token_ids for o in engine.generate([[1, 7, 8, 9]], greedy) if o.finished]
    outs = [o for o in engine.generate([[1, 7, 8, 9], PROMPTS[1]], [greedy, EMBED]) if o.finished]
    by_prompt = {len(o.prompt_token_ids): o for o in outs}
    assert by_prompt[4].token_ids == alone and by_prompt[4].embedding is None
    torch.testing.assert_close(torch.tensor(by_prompt[301].embedding), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama-gqa-untied", "mistral-window"])
def test_every_tokens_hidden_state_equals_transformers_in_chunks_and_after_the_prefix_is_cached(tiny_model_dirs,
                                                                                               name):
    """SamplingParams.embed_tokens (vLLM's token_embed): each prompt token's last hidden state, a
    prompt of several chunks written row by row, a one-token prompt too; a prefix computed before
    (the second round) is computed again, as a cached token's hidden state is not kept."""
    model_dir = tiny_model_dirs[name]
    prompts = [*PROMPTS, [7]]
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, max_num_batched_tokens=64))
    per_token = SamplingParams(max_tokens=1, embed=True, embed_tokens=True)
    for _ in range(2):
        finished = [o for o in engine.generate(prompts, per_token) if o.finished]
        by_prompt = {tuple(o.prompt_token_ids): o for o in finished}
        for prompt, want in zip(prompts, expected):
            out = by_prompt[tuple(prompt)]
            assert out.num_cached_tokens == 0
            torch.testing.assert_close(out.token_embeddings, want, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(torch.tensor(out.embedding), want[-1], atol=1e-4, rtol=1e-4)
    assert engine.block_manager.num_free_blocks == 64
    [plain] = [o for o in engine.generate(PROMPTS[1:], EMBED) if o.finished]
    assert plain.token_embeddings is None and plain.num_cached_tokens > 0  # its blocks were cached for others
    with pytest.raises(ValueError, match="embed_tokens is for an embedding request"):
        SamplingParams(max_tokens=1, embed_tokens=True)


def test_an_embedding_request_makes_one_token():
    with pytest.raises(ValueError, match="max_tokens must be 1"):
        SamplingParams(max_tokens=2, embed=True)


@pytest.mark.parametrize(("name", "architecture"), [
    ("qwen3-qk-norm", "Qwen3ForCausalLM"),  # tied embeddings, its causal LM's architecture: Qwen3-Embedding's
    ("mistral-sharded", "MistralModel"),  # untied and named as the bare model: e5-mistral's
])
def test_a_checkpoint_saved_as_the_bare_model_is_read(tiny_model_dirs, tmp_path, name, architecture):
    source = tiny_model_dirs[name]
    transformers.AutoModel.from_pretrained(source, dtype=torch.float32).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": [architecture]}))
    expected = transformers_embeddings(source, PROMPTS)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=64, max_num_batched_tokens=64))
    for got, want in zip(embeddings(engine, PROMPTS), expected):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("config_class", "labels"), [
    ("LlamaConfig", {0: "negative", 1: "neutral", 2: "positive"}),
    ("Qwen3Config", {0: "LABEL_0"}),  # one label: a score, as a reward model or a cross-encoder gives
])
def test_a_sequence_classifiers_head_reads_the_last_hidden_state_as_transformers_does(tmp_path, config_class, labels):
    config = getattr(transformers, config_class)(**COMMON, id2label=labels, label2id={v: k for k, v in labels.items()})
    torch.manual_seed(3)
    model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=64, max_num_batched_tokens=64))
    assert engine.model_config.labels == tuple(labels.values())
    with torch.no_grad():
        for prompt, hidden in zip(PROMPTS, embeddings(engine, PROMPTS)):
            want = model(torch.tensor([prompt])).logits[0]
            torch.testing.assert_close(engine.runner.model.classifier @ hidden, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("difference", [True, False])
def test_a_causal_lm_is_a_classifier_made_from_its_lm_heads_rows(tiny_demo_model, tmp_path, difference):
    """vLLM's way to serve Qwen3-Reranker as released: --hf-overrides naming a sequence classifier and
    `classifier_from_token` (here two tokens of the demo tokenizer): the head is the LM head's rows of
    those tokens, or with `is_original_qwen3_reranker` the second minus the first, one label whose
    sigmoid is the second token's probability against the first's."""
    demo = json.loads((tiny_demo_model / "config.json").read_text())
    config = transformers.Qwen3Config(**{**COMMON, "vocab_size": demo["vocab_size"], "tie_word_embeddings": False})
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path)
    shutil.copy(tiny_demo_model / "tokenizer.json", tmp_path / "tokenizer.json")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    no, yes = "a", "b"
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes],
                 "is_original_qwen3_reranker": difference}
    engine = LLMEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=64, max_num_batched_tokens=64,
                                    hf_overrides=overrides))
    assert engine.model_config.labels == (("LABEL_0",) if difference else (no, yes))
    # One label: /score and /rerank read pairs with it.
    assert is_cross_encoder(read_model_config(tmp_path, overrides)) == difference
    ids = [tokenizer.convert_tokens_to_ids(no), tokenizer.convert_tokens_to_ids(yes)]
    with torch.no_grad():
        for prompt, hidden in zip(PROMPTS, embeddings(engine, PROMPTS)):
            logits = model(torch.tensor([prompt])).logits[0, -1, ids]
            want = (logits[1] - logits[0]).unsqueeze(0) if difference else logits
            torch.testing.assert_close(engine.runner.model.classifier @ hidden, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ModelConfigError, match="is_original_qwen3_reranker needs classifier_from_token of two"):
        LLMEngine(EngineConfig(model=str(tmp_path), hf_overrides={**overrides, "classifier_from_token": [no],
                                                                   "is_original_qwen3_reranker": True}))


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_a_decoders_pooling_module_pools_every_token(tiny_model_dirs, tmp_path, pooling):
    """A decoder embedding model whose sentence-transformers Pooling module pools the mean (stella's) or
    the first token: every token's last hidden state counts, so the prompt is computed whole even past a
    chunk's budget would have split it, and never read from the prefix cache."""
    model_dir = shutil.copytree(tiny_model_dirs["qwen2-bias"], tmp_path / "pooled")
    (model_dir / "modules.json").write_text(json.dumps(
        [{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_cls_token": pooling == "cls"}))
    prompts = [*PROMPTS, [1, *range(30, 280)]]  # the third would start in the first step's last 15 tokens
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        states = [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]
    expected = [s.mean(dim=0) if pooling == "mean" else s[0] for s in states]
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, max_num_batched_tokens=320))
    assert engine.model_config.pooling == pooling
    for made in (embeddings(engine, prompts), embeddings(engine, prompts)):  # the second: nothing cached
        for got, want in zip(made, expected):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="computed whole"):
        LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, max_num_batched_tokens=64)).add_request(
            "long", PROMPTS[1], EMBED)
