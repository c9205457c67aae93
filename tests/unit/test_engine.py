"""The engine end to end in-process: batching, preemption, abort, stop conditions."""
from __future__ import annotations

import time

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def make_engine(model_dir, **overrides) -> LLMEngine:
    cfg = dict(model=str(model_dir), num_kv_blocks=256, max_num_batched_tokens=256)
    return LLMEngine(EngineConfig(**{**cfg, **overrides}))


def prompts(n: int, length: int = 30) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 1000 + 3 for j in range(length + 3 * i)] for i in range(n)]


def run_all(engine: LLMEngine, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, object]:
    for rid, (p, sp) in reqs.items():
        engine.add_request(rid, p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def assert_pool_clean(engine: LLMEngine) -> None:
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


def test_preemption_by_recompute_gives_the_same_tokens(tiny_demo_model):
    reqs = {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts(8))}
    roomy = make_engine(tiny_demo_model)
    expected = {k: v.token_ids for k, v in run_all(roomy, reqs).items()}
    # 8 requests of ~70 tokens need ~40 blocks at once; 14 forces preemption.
    tight = make_engine(tiny_demo_model, num_kv_blocks=14, max_num_batched_tokens=64)
    got = {k: v.token_ids for k, v in run_all(tight, reqs).items()}
    assert tight.scheduler.num_preemptions > 0
    assert got == expected
    assert_pool_clean(tight)


def test_request_joining_mid_run_matches_running_alone(tiny_demo_model):
    p0, p1 = prompts(2)
    alone = make_engine(tiny_demo_model)
    expected = run_all(alone, {"late": (p1, GREEDY)})["late"].token_ids
    engine = make_engine(tiny_demo_model)
    engine.add_request("early", p0, GREEDY)
    for _ in range(5):
        engine.step()
    engine.add_request("late", p1, GREEDY)
    batch_sizes, done = [], {}
    while engine.has_unfinished_requests():
        batch_sizes.append(len(engine.scheduler.running))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert max(batch_sizes) == 2, "the late request never ran beside the early one"
    assert done["late"].token_ids == expected
    assert_pool_clean(engine)


def test_abort_while_waiting_prefilling_and_decoding(tiny_demo_model):
    engine = make_engine(tiny_demo_model, max_num_batched_tokens=16, max_num_seqs=2)
    long_prompt = prompts(1, length=60)[0]
    engine.add_request("decoding", prompts(1)[0][:5], GREEDY)
    engine.add_request("prefilling", long_prompt, GREEDY)
    engine.add_request("waiting", long_prompt, GREEDY)
    engine.step()
    engine.step()
    running = {s.request_id: s for s in engine.scheduler.running}
    assert running["decoding"].num_output_tokens >= 1
    assert 0 < running["prefilling"].num_computed_tokens < len(long_prompt)
    assert engine.scheduler.waiting[0].request_id == "waiting"
    for rid in ("waiting", "prefilling", "decoding"):
        engine.abort(rid)
    outs = engine.step()
    assert {o.request_id: o.finish_reason for o in outs} == {
        "waiting": "abort", "prefilling": "abort", "decoding": "abort",
    }
    assert not engine.has_unfinished_requests()
    assert_pool_clean(engine)
    engine.abort("no-such-request")  # unknown ids are ignored


def test_stop_token_ids_and_max_tokens(tiny_demo_model):
    engine = make_engine(tiny_demo_model)
    p = prompts(1)[0]
    free_run = run_all(engine, {"a": (p, GREEDY)})["a"].token_ids
    stop_at = free_run[5]
    first = free_run.index(stop_at)
    stopped = run_all(engine, {"b": (p, SamplingParams(max_tokens=40, temperature=0, stop_token_ids=(stop_at,)))})["b"]
    assert stopped.token_ids == free_run[: first + 1]
    assert stopped.finish_reason == "stop"
    short = run_all(engine, {"c": (p, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))})["c"]
    assert short.token_ids == free_run[:3] and short.finish_reason == "length"
    assert_pool_clean(engine)


def test_min_tokens_holds_stop_token_ids_off_until_that_many_tokens_are_out(tiny_demo_model):
    engine = make_engine(tiny_demo_model)
    p = prompts(1)[0]
    stop_at = run_all(engine, {"a": (p, GREEDY)})["a"].token_ids[0]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=(stop_at,))
    assert run_all(engine, {"b": (p, params)})["b"].token_ids == [stop_at]
    # Every other id stops it too: none of them in the first 5 tokens, then the first one ends it.
    stops = {stop_at, *range(4, 1024, 2)}
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, min_tokens=5, stop_token_ids=tuple(stops))
    held = run_all(engine, {"c": (p, params)})["c"].token_ids
    assert len(held) > 5 and held[-1] in stops and not set(held[:-1]) & stops
    assert_pool_clean(engine)


def test_eos_stops_unless_ignored(tiny_demo_model):
    engine = make_engine(tiny_demo_model)
    p = prompts(1)[0]
    free_run = run_all(engine, {"a": (p, GREEDY)})["a"].token_ids
    engine.scheduler.eos_token_ids = frozenset({free_run[2]})
    out = run_all(engine, {"b": (p, SamplingParams(max_tokens=40, temperature=0))})["b"]
    assert out.token_ids == free_run[: free_run.index(free_run[2]) + 1] and out.finish_reason == "stop"
    out = run_all(engine, {"c": (p, GREEDY)})["c"]
    assert out.token_ids == free_run


def test_context_limit_ends_with_length(tiny_demo_model):
    engine = make_engine(tiny_demo_model, max_model_len=40)
    out = run_all(engine, {"a": (prompts(1)[0], GREEDY)})["a"]
    assert len(out.prompt_token_ids) + len(out.token_ids) == 40
    assert out.finish_reason == "length"


def test_seeded_sampling_is_independent_of_the_batch(tiny_demo_model):
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    p = prompts(3)
    alone = run_all(make_engine(tiny_demo_model), {"s": (p[0], seeded)})["s"].token_ids
    crowd = run_all(
        make_engine(tiny_demo_model),
        {
            "x": (p[1], SamplingParams(max_tokens=25, temperature=0.7, ignore_eos=True)),
            "s": (p[0], seeded),
            "y": (p[2], SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)),
        },
    )
    assert crowd["s"].token_ids == alone
    other_seed = run_all(make_engine(tiny_demo_model), {"s": (p[0], SamplingParams(**{**seeded.__dict__, "seed": 99}))})
    assert other_seed["s"].token_ids != alone


def test_logprobs_are_returned_per_token(tiny_demo_model):
    engine = make_engine(tiny_demo_model)
    outs = list(engine.generate([prompts(1)[0]], SamplingParams(max_tokens=5, temperature=0, logprobs=3)))
    logprobs = [lp for out in outs for lp in out.new_logprobs]
    assert len(logprobs) == 5
    for token, lp in zip(outs[-1].token_ids, logprobs):
        assert token in lp and len(lp) >= 3
        assert max(lp.values()) == lp[token]  # greedy picks the most likely token
        assert all(v <= 0 for v in lp.values())


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], GREEDY, "at least one token"),
        ([5, 10**6], GREEDY, "outside the vocabulary"),
        ([5] * 3000, GREEDY, "does not fit the context"),
        ([5] * 10, SamplingParams(max_tokens=2000), "more than the pool"),
        ([5] * 10, SamplingParams(stop_token_ids=(3, 1024)), "stop_token_ids: token id 1024 is outside"),
        ([5] * 10, SamplingParams(allowed_token_ids=(3, 1024)), "allowed_token_ids: token id 1024 is outside"),
    ],
)
def test_requests_that_cannot_be_served_are_refused(tiny_demo_model, prompt, params, message):
    engine = make_engine(tiny_demo_model, num_kv_blocks=64)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished_requests()


def test_a_prefill_only_request_needs_room_in_the_pool_for_its_prompt_not_its_max_tokens(tiny_demo_model):
    """A prefill worker computes the prompt and samples one token: a pool under the context (64 pages of
    16 here) takes a request whose decode worker's pool holds all it may generate."""
    engine = make_engine(tiny_demo_model, num_kv_blocks=64)
    engine.add_request("prefill", [5] * 1000, SamplingParams(max_tokens=1000, temperature=0), prefill_only=True)
    finished = []
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
    assert [(out.finish_reason, len(out.token_ids)) for out in finished] == [("prefilled", 1)]
    assert engine.release("prefill")
    assert_pool_clean(engine)
    with pytest.raises(ValueError, match="request needs up to 1025 tokens of KV, more than the pool's 1024"):
        engine.add_request("too-long", [5] * 1024, GREEDY, prefill_only=True)
    with pytest.raises(ValueError, match="request needs up to 2000 tokens of KV, more than the pool's 1024"):
        engine.add_request("whole", [5] * 1000, SamplingParams(max_tokens=1000, temperature=0))


def test_duplicate_request_id_is_refused(tiny_demo_model):
    engine = make_engine(tiny_demo_model)
    engine.add_request("same", [5, 6, 7], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("same", [5, 6, 7], GREEDY)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5),
    ("temperature", float("nan")), ("temperature", float("inf")), ("repetition_penalty", float("nan")),
    ("repetition_penalty", float("inf")), ("min_p", float("nan")), ("presence_penalty", float("-inf"))])
def test_sampling_params_validation(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_compute_tracks_float32(tiny_demo_model, dtype):
    from engine.batch import ScheduledBatch
    from engine.sequence import Sequence

    def last_logits(engine):
        seq = Sequence("x", prompts(1)[0], GREEDY, engine.config.block_size)
        engine.block_manager.allocate(seq)
        batch = ScheduledBatch()
        batch.add(seq, seq.num_tokens)
        _, logits = engine.runner.forward(batch)
        return logits[0]

    ref = last_logits(make_engine(tiny_demo_model))
    half = make_engine(tiny_demo_model, dtype=dtype)
    got = last_logits(half)
    assert got.dtype == ref.dtype == torch.float32
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    out = run_all(half, {"a": (prompts(1)[0], GREEDY)})["a"]
    assert len(out.token_ids) == GREEDY.max_tokens


def test_step_times_hold_add_request_and_the_whole_step_from_scheduling_to_the_outputs(tiny_demo_model,
                                                                                         monkeypatch):
    """A caller waiting on `step` for its first token waits for scheduling and bookkeeping too:
    a service subtracts these times as the engine's own, so none of it may fall outside them."""
    engine = make_engine(tiny_demo_model)
    pause_s = 0.05

    def slowed(fn):
        def run(*args, **kwargs):
            time.sleep(pause_s)
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(engine.scheduler, "schedule", slowed(engine.scheduler.schedule))
    monkeypatch.setattr(engine.scheduler, "postprocess", slowed(engine.scheduler.postprocess))
    monkeypatch.setattr(engine.scheduler, "add", slowed(engine.scheduler.add))
    added_ns = time.time_ns()
    engine.add_request("timed", prompts(1)[0], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    before_ns = time.time_ns()
    (out,) = engine.step()
    after_ns = time.time_ns()
    times = out.step_times
    # add_request too: what an in-process caller's time to first token holds besides the steps.
    admit_start_ns, admit_end_ns = times.admit_ns
    assert added_ns <= admit_start_ns and admit_end_ns <= before_ns
    assert (admit_end_ns - admit_start_ns) / 1e9 >= pause_s
    assert before_ns <= times.first_step_start_ns and times.first_step_end_ns <= after_ns
    assert times.prefill_seconds >= 2 * pause_s
    assert (after_ns - before_ns) / 1e9 - times.prefill_seconds < pause_s / 2


def finish_order(engine: LLMEngine, reqs: dict[str, tuple[list[int], SamplingParams]]) -> list[str]:
    for rid, (p, sp) in reqs.items():
        engine.add_request(rid, p, sp)
    order = []
    while engine.has_unfinished_requests():
        order += [out.request_id for out in engine.step() if out.finished]
    return order


def test_the_priority_policy_serves_lower_priority_values_first(tiny_demo_model):
    """One at a time (max_num_seqs 1): by priority, then as they came; fcfs as they came, and it
    refuses a priority it would not honour."""
    params = {"late-batch": 5, "first-batch": 5, "interactive": -1, "normal": 0}
    reqs = {rid: (p, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, priority=priority))
            for (rid, priority), p in zip(params.items(), prompts(4))}
    by_priority = make_engine(tiny_demo_model, max_num_seqs=1, scheduling_policy="priority")
    assert finish_order(by_priority, reqs) == ["interactive", "normal", "late-batch", "first-batch"]
    assert_pool_clean(by_priority)

    fcfs = make_engine(tiny_demo_model, max_num_seqs=1)
    with pytest.raises(ValueError, match="priority 5 asks for priority scheduling"):
        fcfs.add_request("x", prompts(1)[0], reqs["late-batch"][1])
    plain = {rid: (p, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)) for rid, (p, _) in reqs.items()}
    assert finish_order(fcfs, plain) == list(params)
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        make_engine(tiny_demo_model, scheduling_policy="lifo")


def test_the_priority_policy_preempts_the_least_urgent(tiny_demo_model):
    """Pages run short: the running request of the highest priority value gives its pages up,
    though it came first (fcfs would preempt the last to come), and gets the same tokens."""
    prompt = prompts(1, length=60)[0]
    urgent, relaxed = (SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, priority=p) for p in (0, 9))
    expected = run_all(make_engine(tiny_demo_model), {"relaxed": (prompt, GREEDY)})["relaxed"].token_ids
    engine = make_engine(tiny_demo_model, num_kv_blocks=10, scheduling_policy="priority")
    engine.add_request("relaxed", prompt, relaxed)
    engine.step()  # it runs first, alone
    engine.add_request("urgent", prompt, urgent)
    seqs = dict(engine._seqs)
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    assert seqs["relaxed"].num_preemptions > 0 and seqs["urgent"].num_preemptions == 0
    assert done["relaxed"].token_ids == done["urgent"].token_ids == expected
    assert_pool_clean(engine)


def test_a_seeded_engine_samples_unseeded_requests_alike_run_after_run(tiny_demo_model):
    """vLLM's --seed: the engine's random generator seeded at start; requests without a seed of their own
    then draw the same tokens from one start to the next (given the same requests in the same order)."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    def sampled(seed: int) -> list[int]:
        engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=16, seed=seed))
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True))
        tokens = []
        while engine.has_unfinished_requests():
            tokens += [t for out in engine.step() for t in out.new_token_ids]
        return tokens

    assert sampled(7) == sampled(7) != sampled(8)


@pytest.mark.parametrize("threshold", [0, 64])
def test_a_long_prefill_cap_leaves_room_in_each_step_for_short_prompts(tiny_demo_model, threshold):
    """vLLM's long_prefill_token_threshold: with it, a long prompt computes at most that many tokens a step,
    and a short prompt behind it gets its first token in the first step; without it, the long prompt takes
    the whole step's budget and the short one waits."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=64, max_num_batched_tokens=256,
                                    long_prefill_token_threshold=threshold))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request("long", [(7 * j) % 900 + 3 for j in range(600)], params)
    engine.add_request("short", [5, 6, 7, 8], params)
    first_token_step = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        first_token_step.update({out.request_id: step for out in engine.step() if out.new_token_ids})
    # 64 a step: the short prompt beside the long one's first 64, the long one in 10 steps. No cap: the
    # long one's 256, 256, then 88 with the short one.
    assert first_token_step == ({"short": 1, "long": 10} if threshold else {"short": 3, "long": 3})
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        EngineConfig(model=str(tiny_demo_model), long_prefill_token_threshold=-1)
