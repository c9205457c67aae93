"""Speculative decoding with a draft model (engine/draft_model.py): an engine whose drafts come from a
small model makes exactly the tokens, logprobs and finish reasons of one that decodes plainly, takes
the drafts the target agrees with, and frees the draft's pages as it frees its own."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.demo_model import make_demo_model
from engine.draft_model import DraftSequence
from engine.kv_pool import kv_block_bytes, num_blocks_for_budget
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.speculative import SpeculativeConfig
from tests.cuda import ON_CUDA
from tests.draft_models import first_layers_copy
from tests.unit.test_speculative import PARAMS, PROMPTS, assert_same_outputs


@pytest.fixture(scope="module")
def first_layer_draft(tiny_demo_model, tmp_path_factory):
    return first_layers_copy(tiny_demo_model, tmp_path_factory.mktemp("draft") / "first-layer", 1)


def _draft_config(model_dir, num_speculative_tokens: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict({"model": str(model_dir), "num_speculative_tokens": num_speculative_tokens})


def _run(model_dir, speculative, prompts=PROMPTS, params=PARAMS, **engine_options):
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=engine_options.pop("num_kv_blocks", 128),
                                    speculative=speculative, **engine_options))
    for request_id, (prompt, sampling) in enumerate(zip(prompts, params)):
        engine.add_request(str(request_id), prompt, sampling)
    records: dict[str, list] = {}
    finished, num_steps = {}, 0
    while engine.has_unfinished_requests():
        num_steps += 1
        for out in engine.step():
            records.setdefault(out.request_id, []).extend(dict(lp) for lp in out.new_logprobs)
            if out.finished:
                finished[out.request_id] = (out.token_ids, out.finish_reason, records.pop(out.request_id))
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks
    drafter = engine.scheduler.drafter
    if drafter is not None and hasattr(drafter, "num_free_blocks"):
        assert drafter.num_free_blocks == drafter.num_blocks  # every draft page back
    return finished, engine.scheduler, num_steps


@pytest.mark.parametrize("engine_options", [pytest.param({}, id="roomy"),
                                            pytest.param({"max_num_batched_tokens": 16}, id="tight-budget"),
                                            pytest.param({"num_kv_blocks": 20}, id="preempting"), ON_CUDA])
def test_a_draft_model_changes_how_many_tokens_a_step_makes_never_which(tiny_demo_model, first_layer_draft,
                                                                         engine_options):
    plain, _, _ = _run(tiny_demo_model, None, **dict(engine_options))
    drafted, scheduler, _ = _run(tiny_demo_model, _draft_config(first_layer_draft), **dict(engine_options))
    assert_same_outputs(drafted, plain)
    assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens  # a cut model is right only at times
    assert scheduler.num_preemptions > 0 or "num_kv_blocks" not in engine_options


def test_the_target_as_its_own_draft_has_its_greedy_drafts_taken(tiny_demo_model):
    prompts = [[11 + i, 200 + 3 * i, 7] for i in range(3)] + [list(range(100, 400))]  # the last drafts past a page
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * len(prompts)
    plain, _, plain_steps = _run(tiny_demo_model, None, prompts, params)
    drafted, scheduler, drafted_steps = _run(tiny_demo_model, _draft_config(tiny_demo_model, 4), prompts, params)
    assert {r: tokens for r, (tokens, _, _) in drafted.items()} == {r: tokens for r, (tokens, _, _) in plain.items()}
    # The draft computes as the target does but for chunked against one-row sums: all but a near tie agree.
    assert scheduler.num_accepted_tokens >= 0.95 * scheduler.num_draft_tokens > 0
    assert drafted_steps <= plain_steps / 3  # a first step, then up to five tokens a step


def test_an_aborted_request_gives_its_draft_pages_back(tiny_demo_model, first_layer_draft):
    engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=64,
                                    speculative=_draft_config(first_layer_draft)))
    drafter = engine.scheduler.drafter
    engine.add_request("a", list(range(30, 90)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert drafter.num_free_blocks < drafter.num_blocks
    engine.abort("a")
    engine.abort("b")
    engine.step()
    assert drafter.num_free_blocks == drafter.num_blocks
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


def test_a_draft_model_the_target_cannot_verify_is_refused(tiny_demo_model, tmp_path):
    larger = make_demo_model(tmp_path / "larger-vocab", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             vocab_size=2048, seed=3)
    with pytest.raises(ValueError, match="vocabulary \\(2048 tokens\\) is larger than the target's \\(1024\\)"):
        LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=16, speculative=_draft_config(larger)))
    with pytest.raises(ValueError, match="config.json: not found"):
        LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=16,
                               speculative=_draft_config(tmp_path / "missing")))
    with pytest.raises(ValueError, match="needs num_speculative_tokens"):
        SpeculativeConfig.from_dict({"model": str(larger)})
    with pytest.raises(ValueError, match="n-gram keys; a draft model takes none"):
        SpeculativeConfig.from_dict({"model": str(larger), "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match="need the draft's directory as model"):
        SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 2})


def test_a_draft_sequence_keeps_the_kv_of_the_drafts_its_owner_took():
    owner = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=8), 16)
    draft = DraftSequence(owner)
    draft.follow([1, 2, 3])
    assert (draft.num_computed_tokens, draft.token_ids) == (0, [1, 2, 3])
    draft.token_ids += [7, 8]  # its drafts 7, 8 (and a third, 9, whose KV it never computed)
    draft.num_computed_tokens = 5
    draft.follow([1, 2, 3, 7, 8, 9, 4])  # all three taken, and the step's own token
    assert (draft.num_computed_tokens, draft.token_ids) == (5, [1, 2, 3, 7, 8, 9, 4])
    draft.num_computed_tokens = 7
    draft.follow([1, 2, 3, 7, 8, 9, 4, 6])  # none of the drafts after 4 (none made): only 6 is new
    assert draft.num_computed_tokens == 7
    draft.token_ids += [5]
    draft.num_computed_tokens = 9
    draft.follow([1, 2, 3, 7, 8, 9, 4, 6])  # not scheduled since: its last token is computed again
    assert (draft.num_computed_tokens, draft.token_ids) == (7, [1, 2, 3, 7, 8, 9, 4, 6])


def test_a_memory_sized_pool_leaves_room_for_the_draft_models_pages(tiny_demo_model, first_layer_draft):
    engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), kv_memory_fraction=0.001,
                                    speculative=_draft_config(first_layer_draft)))
    drafter = engine.scheduler.drafter
    assert drafter.num_blocks == engine.num_kv_blocks and drafter.block_size == engine.config.block_size
    alone = num_blocks_for_budget(engine.model_config, 16, torch.float32, "cpu", 0.001)
    both = kv_block_bytes(engine.model_config, 16, torch.float32) + drafter.kv_block_bytes(16)
    # (free memory is read twice: a few blocks either way)
    assert engine.num_kv_blocks == pytest.approx(alone * kv_block_bytes(engine.model_config, 16, torch.float32) / both,
                                                 rel=0.05)
