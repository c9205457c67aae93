"""An engine reading a later checkpoint in place of the one it serves (SGLang's update_weights_from_disk):
it then computes as an engine started on that checkpoint does, its prefix cache forgotten; never while
a request holds pages, never from a model of another shape."""
from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.demo_model import make_demo_model
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.unit.test_engine import assert_pool_clean, run_all

PROMPT = [(13 * j) % 900 + 5 for j in range(40)]  # more than two blocks: its prefix is cached
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SHAPE = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=1024)


@pytest.fixture(scope="module")
def next_checkpoint(tmp_path_factory):
    """The test model's shape (tiny_demo_model's), other weights: a trainer's next checkpoint."""
    return make_demo_model(tmp_path_factory.mktemp("next") / "tiny", seed=2, **SHAPE)


def make_engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, max_num_batched_tokens=64))


def test_an_updated_engine_computes_as_one_started_on_the_checkpoint(tiny_demo_model, next_checkpoint):
    engine = make_engine(tiny_demo_model)
    before = run_all(engine, {"a": (PROMPT, GREEDY)})["a"]
    expected = run_all(make_engine(next_checkpoint), {"b": (PROMPT, GREEDY)})["b"]
    assert before.token_ids != expected.token_ids  # the checkpoints differ where the test looks
    assert engine.update_weights(next_checkpoint) >= len(PROMPT) // 16  # the prompt's blocks, forgotten
    after = run_all(engine, {"c": (PROMPT, GREEDY)})["c"]
    assert after.token_ids == expected.token_ids and after.num_cached_tokens == 0  # nothing read from the old KV
    assert engine.update_weights(tiny_demo_model) is not None  # and back
    assert run_all(engine, {"d": (PROMPT, GREEDY)})["d"].token_ids == before.token_ids
    assert_pool_clean(engine)


def test_an_update_waits_for_no_page_held_and_refuses_another_shape(tiny_demo_model, next_checkpoint, tmp_path):
    engine = make_engine(tiny_demo_model)
    engine.add_request("running", PROMPT, GREEDY)
    engine.step()
    assert engine.update_weights(next_checkpoint) is None  # a request holds pages: nothing changed
    while engine.has_unfinished_requests():
        engine.step()
    assert run_all(engine, {"again": (PROMPT, GREEDY)})["again"].token_ids == \
        run_all(make_engine(tiny_demo_model), {"fresh": (PROMPT, GREEDY)})["fresh"].token_ids
    wider = make_demo_model(tmp_path / "wider", seed=2, **{**SHAPE, "hidden_size": 128})
    with pytest.raises(ValueError, match="is not the served model's shape: its hidden_size"):
        engine.update_weights(wider)
    with pytest.raises(ValueError, match="config.json"):
        engine.update_weights(tmp_path)
    assert_pool_clean(engine)


def test_a_checkpoint_failing_part_way_leaves_the_one_served_before(tiny_demo_model, next_checkpoint, tmp_path):
    """Its first shard read, its second holding a tensor of another shape: the update fails and the
    engine computes as before, not with some of each checkpoint's weights."""
    engine = make_engine(tiny_demo_model)
    before = run_all(engine, {"a": (PROMPT, GREEDY)})["a"]
    tensors = load_file(next_checkpoint / "model.safetensors")
    order = engine.runner.model.checkpoint_names()  # as they are read: the first shard's first
    first, second = order[:len(order) // 2], [n for n in tensors if n not in order[:len(order) // 2]]
    broken = second[-1]
    for path in next_checkpoint.glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    save_file({n: tensors[n] for n in first}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({**{n: tensors[n] for n in second}, broken: tensors[broken].flatten()[1:].contiguous()},
              tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        **dict.fromkeys(first, "model-00001-of-00002.safetensors"),
        **dict.fromkeys(second, "model-00002-of-00002.safetensors")}}))
    with pytest.raises(ValueError, match=rf"tensor '{broken}' has shape"):
        engine.update_weights(tmp_path)
    assert engine.weights_dir == str(tiny_demo_model)
    assert run_all(engine, {"b": (PROMPT, GREEDY)})["b"].token_ids == before.token_ids
    assert_pool_clean(engine)
