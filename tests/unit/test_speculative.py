"""Speculative decoding with n-gram drafts (engine/speculative.py; a draft model's: test_draft_model.py):
the drafts proposed, and an engine that drafts makes exactly the tokens (and logprobs, and finish
reasons) of one that does not."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.speculative import SpeculativeConfig, ngram_drafts
from tests.cuda import ON_CUDA

NGRAM = SpeculativeConfig(num_speculative_tokens=4)


def test_drafts_follow_the_latest_earlier_occurrence_of_the_longest_suffix():
    assert ngram_drafts([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3, 1, 4) == [7, 8, 1]  # latest "1 2 3"
    assert ngram_drafts([5, 1, 2, 6, 2, 4, 4, 1, 2], 2, 1, 4) == [6, 2]  # "1 2" beats the later "2"
    assert ngram_drafts([5, 1, 2, 6, 2, 4, 4, 1, 2], 2, 3, 4) == []  # nothing as long as 3
    assert ngram_drafts([1, 2, 3, 1, 2], 5, 1, 4) == [3, 1, 2]  # only what there is
    assert ngram_drafts([4, 4, 4, 4], 2, 1, 2) == [4]  # the suffix itself is no earlier occurrence
    assert ngram_drafts([1, 2, 3], 4, 1, 4) == [] and ngram_drafts([7], 4, 1, 4) == []
    assert ngram_drafts([1, 2, 1, 2], 0, 1, 4) == []


def test_the_config_reads_vllms_keys_and_refuses_what_it_does_not_serve():
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3})
    assert config == SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_max=3, prompt_lookup_min=1)
    with pytest.raises(ValueError, match="'medusa' is not supported"):
        SpeculativeConfig.from_dict({"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="eagle drafts need the draft's directory as model"):
        SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 2})
    # vLLM's names, old and new; the target's own layer
    for mtp in ("mtp", "deepseek_mtp", "glm4_moe_mtp", "glm4_moe_lite_mtp", "qwen3_next_mtp", "qwen3_5_mtp"):
        assert SpeculativeConfig.from_dict({"method": mtp, "num_speculative_tokens": 1}) == \
            SpeculativeConfig(num_speculative_tokens=1, method="mtp")
    with pytest.raises(ValueError, match="ngram drafts take no model"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "model": "x"})
    with pytest.raises(ValueError, match="unknown keys \\['disable_by_batch_size'\\]"):
        SpeculativeConfig.from_dict({"model": "x", "num_speculative_tokens": 2, "disable_by_batch_size": 4})
    # vLLM's EAGLE examples give draft_tensor_parallel_size 1: the draft computes whole, as here
    assert SpeculativeConfig.from_dict({"method": "eagle3", "model": "x", "num_speculative_tokens": 2,
                                        "draft_tensor_parallel_size": 1}) == \
        SpeculativeConfig(num_speculative_tokens=2, method="eagle3", model="x")
    with pytest.raises(ValueError, match="draft_tensor_parallel_size must be 1"):
        SpeculativeConfig.from_dict({"method": "eagle3", "model": "x", "num_speculative_tokens": 2,
                                     "draft_tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
                                     "prompt_lookup_max": 2})


PROMPTS = [[5, 6, 7, 8] * 30, list(range(10, 60)), [9] * 5, [3, 4] * 40]
PARAMS = [
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.8, seed=3, top_p=0.9, top_k=50, repetition_penalty=1.2,
                   presence_penalty=0.3, logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=33, temperature=0.0, min_tokens=10, stop_token_ids=(939, 530), logprobs=0),
    SamplingParams(max_tokens=25, temperature=1.0, seed=11, frequency_penalty=0.5, ignore_eos=True),
]


def _outputs(model_dir, speculative, **engine_options):
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=engine_options.pop("num_kv_blocks", 128),
                                    speculative=speculative, **engine_options))
    finished = {out.request_id: (out.token_ids, out.finish_reason, [dict(lp) for lp in out.new_logprobs])
                for out in _stream(engine)}
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks
    return finished, engine.scheduler


def _stream(engine: LLMEngine):
    """Each request's outputs, joined: its tokens, finish reason and every logprob record."""
    for request_id, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(str(request_id), prompt, params)
    records: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            records.setdefault(out.request_id, []).extend(out.new_logprobs)
            if out.finished:
                out.new_logprobs = records.pop(out.request_id)
                yield out


@pytest.mark.parametrize("engine_options", [pytest.param({}, id="roomy"),
                                            pytest.param({"max_num_batched_tokens": 16}, id="tight-budget"),
                                            pytest.param({"num_kv_blocks": 20}, id="preempting"), ON_CUDA])
def test_drafting_changes_how_many_tokens_a_step_makes_never_which(tiny_demo_model, engine_options):
    plain, _ = _outputs(tiny_demo_model, None, **dict(engine_options))
    drafted, scheduler = _outputs(tiny_demo_model, NGRAM, **dict(engine_options))
    assert_same_outputs(drafted, plain)
    assert scheduler.num_draft_tokens > 0 and scheduler.num_accepted_tokens > 0
    assert scheduler.num_accepted_tokens <= scheduler.num_draft_tokens
    # A step's k-th draft is taken only after the k-1 before it: no position more often than the one before.
    per_position = scheduler.num_accepted_tokens_per_position
    assert sum(per_position) == scheduler.num_accepted_tokens and per_position == sorted(per_position, reverse=True)
    assert per_position[0] <= scheduler.num_drafts <= scheduler.num_draft_tokens
    assert scheduler.num_preemptions > 0 or "num_kv_blocks" not in engine_options


@pytest.mark.parametrize("engine_options", [{}, {"num_kv_blocks": 20}], ids=["roomy", "preempting"])
def test_each_request_keeps_its_own_drafts_and_they_add_up_to_the_engines(tiny_demo_model, engine_options):
    engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), speculative=NGRAM,
                                    per_request_spec_decode_metrics="detailed",
                                    num_kv_blocks=engine_options.get("num_kv_blocks", 128)))
    stats = [out.spec_decode for out in _stream(engine)]
    assert len(stats) == len(PROMPTS) and all(s is not None and s.num_spec_tokens == 4 for s in stats)
    steps = [step for s in stats for step in s.per_step]
    scheduler = engine.scheduler
    assert len(steps) == scheduler.num_drafts
    assert sum(drafted for drafted, _ in steps) == scheduler.num_draft_tokens
    assert sum(accepted for _, accepted in steps) == scheduler.num_accepted_tokens > 0
    for s in stats:  # the rows count the steps the per-step list holds, each by its draft length
        assert all(len(row) == k + 1 for k, row in s.rows.items())
        assert {k: sum(row) for k, row in s.rows.items()} == \
            {k: sum(1 for drafted, _ in s.per_step if drafted == k) for k in s.rows}
        assert sum(j * n for row in s.rows.values() for j, n in enumerate(row)) == sum(a for _, a in s.per_step)


def test_a_requests_drafts_are_kept_per_step_only_when_asked(tiny_demo_model):
    # A pool sized for the prompts: the default, carved from a share of free memory, takes seconds to zero here.
    summary = LLMEngine(EngineConfig(model=str(tiny_demo_model), speculative=NGRAM, num_kv_blocks=128,
                                     per_request_spec_decode_metrics="summary"))
    assert all(out.spec_decode.per_step is None for out in _stream(summary))
    plain = LLMEngine(EngineConfig(model=str(tiny_demo_model), speculative=NGRAM, num_kv_blocks=128))
    assert all(out.spec_decode is None for out in _stream(plain))  # kept only when asked for


def assert_same_outputs(drafted: dict, plain: dict) -> None:
    """The same tokens and finish reasons by request id, and logprobs within a chunk's rounding."""
    assert {r: (tokens, reason) for r, (tokens, reason, _) in drafted.items()} == \
        {r: (tokens, reason) for r, (tokens, reason, _) in plain.items()}
    for request_id, (_, _, records) in plain.items():  # a drafted position's logits come from a chunk: ~1e-6 off
        for made, expected in zip(drafted[request_id][2], records, strict=True):
            assert made.keys() == expected.keys()
            assert all(abs(made[t] - expected[t]) < 1e-4 for t in made)


@pytest.mark.parametrize("guide", [dict(guided_regex="(ab|cd)+x"), dict(guided_grammar='root ::= ("ab" | "cd")+ "x"')])
def test_guided_output_is_the_same_with_drafts(tiny_demo_model, guide):
    params = SamplingParams(max_tokens=30, temperature=0.0, **guide)
    outputs = []
    for speculative in (None, NGRAM):
        engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=64, speculative=speculative))
        [done] = [out for out in engine.generate([[7, 8, 9] * 10], params) if out.finished]
        outputs.append((done.token_ids, done.finish_reason))
    assert outputs[0] == outputs[1]
