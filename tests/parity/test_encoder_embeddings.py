"""BERT-family encoders (BertModel, XLMRobertaModel) as embedding models: each prompt's pooled last
hidden states ([CLS], mean or last, as its sentence-transformers Pooling module says; [CLS]
without one) equal to transformers' on the same weights, alone and batched, whole however the
step's budget falls, never from a prefix cache."""
from __future__ import annotations

import json

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config_loader import ModelConfigError, load_model_config
from engine.sampling_params import SamplingParams
from tests.encoder_models import make_encoder, transformers_embedding

pytest.importorskip("transformers")

PROMPTS = [[2, 5, 9, 17, 3], [2, *[(7 * k) % 60 + 5 for k in range(100)], 3], [2, 3], [9]]
EMBED = SamplingParams(max_tokens=1, embed=True)


def embeddings(engine: LLMEngine, prompts: list[list[int]]) -> list[torch.Tensor]:
    finished = {o.request_id: o for o in engine.generate(prompts, EMBED) if o.finished}
    return [torch.tensor(finished[r].embedding) for r in sorted(finished, key=lambda r: int(r.removeprefix("gen-")))]


@pytest.mark.parametrize(("architecture", "pooling"), [("BertModel", "mean"), ("BertModel", "cls"),
                                                       ("XLMRobertaModel", "mean"), ("BertModel", "last")])
def test_encoder_embeddings_equal_transformers(tmp_path, architecture, pooling):
    model_dir = make_encoder(tmp_path / "encoder", architecture, pooling)
    assert load_model_config(model_dir).pooling == pooling
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64))
    expected = [transformers_embedding(model_dir, p, pooling) for p in PROMPTS]
    for made in (embeddings(engine, PROMPTS), embeddings(engine, PROMPTS)):  # the second: nothing cached
        for got, want in zip(made, expected):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert engine.block_manager.num_free_blocks == 64


def test_without_a_pooling_module_the_cls_token_is_the_embedding(tmp_path):
    model_dir = make_encoder(tmp_path / "encoder", pooling=None)
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64))
    [got] = embeddings(engine, PROMPTS[:1])
    torch.testing.assert_close(got, transformers_embedding(model_dir, PROMPTS[0], "cls"), atol=1e-4, rtol=1e-4)


def test_a_prompt_waits_for_a_step_that_takes_it_whole(tmp_path):
    """Two 60-token prompts and a budget of 100 tokens a step: the second is computed in the next step,
    whole, not its first 40 tokens now."""
    model_dir = make_encoder(tmp_path / "encoder")
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, max_num_batched_tokens=100))
    prompts = [[2, *range(5, 63), 3], [2, *range(10, 68), 3]]
    for got, prompt in zip(embeddings(engine, prompts), prompts):
        torch.testing.assert_close(got, transformers_embedding(model_dir, prompt, "mean"), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="computed whole"):
        engine.add_request("long", [2, *[k % 60 + 5 for k in range(105)], 3], EMBED)


def test_generation_on_an_encoder_runs_without_failing(tmp_path):
    """What a worker's warm-up asks of it: prompts in chunks, decode steps (the text means nothing)."""
    model_dir = make_encoder(tmp_path / "encoder")
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, max_num_batched_tokens=32))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outputs = [o for o in engine.generate([[2, *range(5, 60)], [9]], params) if o.finished]
    assert [len(o.token_ids) for o in outputs] == [4, 4]
    assert engine.block_manager.num_free_blocks == 64


def test_an_unsupported_pooling_is_a_clear_error(tmp_path):
    model_dir = make_encoder(tmp_path / "encoder")
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ModelConfigError, match="pooling_mode_max_tokens is not supported"):
        load_model_config(model_dir)


PAIRS = [("the quick brown fox", "a lazy dog sat on the mat"), ("red sky", "blue sea and green moon")]


@pytest.mark.parametrize(("architecture", "num_labels"), [("BertForSequenceClassification", 3),
                                                          ("XLMRobertaForSequenceClassification", 1)])
def test_a_cross_encoders_logits_equal_transformers(tmp_path, architecture, num_labels):
    """A pair as the tokenizer's pair template joins it: BERT tells the texts apart by token types
    (after the first [SEP]), as the tokenizer types them; the head on the [CLS] state."""
    transformers = pytest.importorskip("transformers")
    model_dir = make_encoder(tmp_path / "reranker", architecture, num_labels=num_labels)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    reference = getattr(transformers, architecture).from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64))
    assert engine.model_config.labels == tuple(f"LABEL_{i}" for i in range(num_labels))
    is_bert = architecture.startswith("Bert")
    # RoBERTa's have one token type (what this test tokenizer types the second text is BERT's way).
    encoded = [{k: v for k, v in tokenizer(first, second).items() if k != "token_type_ids" or is_bert}
               for first, second in PAIRS]
    assert not is_bert or all(1 in e["token_type_ids"] for e in encoded)
    for pair, state in zip(encoded, embeddings(engine, [e["input_ids"] for e in encoded])):
        with torch.no_grad():
            want = reference(**{k: torch.tensor([v]) for k, v in pair.items()}).logits[0]
        torch.testing.assert_close(engine.runner.model.classify(state), want, atol=1e-4, rtol=1e-4)


def test_an_input_may_fill_the_whole_context(tmp_path):
    """An embedding's one token is never computed: the input may have as many tokens as positions."""
    model_dir = make_encoder(tmp_path / "encoder")
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=160, max_num_batched_tokens=4096))
    prompt = [2, *[(5 * k) % 90 + 5 for k in range(engine.max_model_len - 2)], 3]
    [got] = embeddings(engine, [prompt])
    torch.testing.assert_close(got, transformers_embedding(model_dir, prompt, "mean"), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="does not fit"):
        engine.add_request("longer", [*prompt, 5], EMBED)


MODERN_PROMPTS = [[2, *[(7 * k) % 60 + 5 for k in range(40)], 3], [2, 5, 9, 3], [9]]


@pytest.mark.parametrize("biases", [False, True], ids=["no-biases", "biases"])
def test_modernbert_embeddings_equal_transformers(tmp_path, biases):
    """RoPE with a theta for the global layers and one for the sliding ones, the sliding layers' window
    (a 42-token prompt against 4 tokens either side), the gated feed-forward, with and without biases."""
    options = dict(norm_bias=biases, attention_bias=biases, mlp_bias=biases)
    model_dir = make_encoder(tmp_path / "modernbert", "ModernBertModel", "mean", **options)
    config = load_model_config(model_dir)
    assert config.sliding_layers == {1, 2} and config.sliding_window == 4 and config.pooling == "mean"
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64))
    for got, prompt in zip(embeddings(engine, MODERN_PROMPTS), MODERN_PROMPTS):
        torch.testing.assert_close(got, transformers_embedding(model_dir, prompt, "mean"), atol=1e-4, rtol=1e-4)
    assert engine.block_manager.num_free_blocks == 64


def test_a_modernbert_config_of_released_checkpoints_reads_the_same(tmp_path):
    """Released ModernBERT checkpoints (ModernBERT-base, modernbert-embed, gte-modernbert) name their
    layout by global_attn_every_n_layers, global_rope_theta and local_rope_theta."""
    model_dir = make_encoder(tmp_path / "modernbert", "ModernBertModel", "cls", global_rope_theta=500.0,
                             local_rope_theta=50.0)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == 500.0
    expected = [transformers_embedding(model_dir, p, "cls") for p in MODERN_PROMPTS]
    for key in ("layer_types", "rope_parameters"):
        del config[key]
    config_path.write_text(json.dumps({**config, "global_attn_every_n_layers": 3, "global_rope_theta": 500.0,
                                       "local_rope_theta": 50.0}))
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64))
    assert (engine.model_config.rope_theta, engine.model_config.local_rope_theta) == (500.0, 50.0)
    for got, want in zip(embeddings(engine, MODERN_PROMPTS), expected):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("pooling", "num_labels"), [("cls", 1), ("mean", 3)])
def test_a_modernbert_cross_encoders_logits_equal_transformers(tmp_path, pooling, num_labels):
    """gte-reranker-modernbert's kind: classifier_pooling, then the head (dense, GELU, norm) and the classifier."""
    transformers = pytest.importorskip("transformers")
    model_dir = make_encoder(tmp_path / "reranker", "ModernBertForSequenceClassification", pooling,
                             num_labels=num_labels, classifier_bias=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    reference = transformers.ModernBertForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64))
    assert engine.model_config.pooling == pooling
    encoded = [tokenizer(first, second)["input_ids"] for first, second in PAIRS]
    for ids, state in zip(encoded, embeddings(engine, encoded)):
        with torch.no_grad():
            want = reference.eval()(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(engine.runner.model.classify(state), want, atol=1e-4, rtol=1e-4)
