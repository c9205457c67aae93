"""Prefill in one engine, decode in another from a copy of the pages: the same tokens as one engine."""
from __future__ import annotations

import pytest

from engine.admission import NoRoomYet
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

PARAMS = {
    "greedy": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
    "penalties": SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3,
                                frequency_penalty=0.5, ignore_eos=True),
    # Half the vocabulary would stop it, not before 7 tokens are out: the decode engine counts the first one.
    "min_tokens": SamplingParams(max_tokens=24, temperature=0.0, min_tokens=7, stop_token_ids=tuple(range(4, 1024, 2)),
                                 ignore_eos=True),
}


def make_engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=128, max_num_batched_tokens=64))


def finish(engine: LLMEngine) -> dict:
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    return outs


def assert_clean(engine: LLMEngine) -> None:
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


def test_a_request_id_whose_pages_are_held_for_their_handoff_is_in_use(tiny_demo_model):
    """A prefilled request holds its pages until they are handed on: its id is refused to a new request
    meanwhile (a client reusing its x-request-id), not admitted to fail the engine's step (the worker then
    stopped, and `baton up` with it)."""
    prefill = make_engine(tiny_demo_model)
    prompt = [(17 * j) % 900 + 5 for j in range(40)]
    prefill.add_request("r", prompt, PARAMS["greedy"], prefill_only=True)
    assert finish(prefill)["r"].finish_reason == "prefilled"
    assert prefill.has_request("r")
    with pytest.raises(ValueError, match="already in use"):
        prefill.add_request("r", prompt, PARAMS["greedy"], prefill_only=True)
    assert prefill.release("r") and not prefill.has_request("r")
    prefill.add_request("r", prompt, PARAMS["greedy"], prefill_only=True)
    assert finish(prefill)["r"].finish_reason == "prefilled"
    assert prefill.release("r")
    assert_clean(prefill)


@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_handoff_gives_the_colocated_tokens(tiny_demo_model, kind):
    params = PARAMS[kind]
    prompt = [(17 * j) % 900 + 5 for j in range(70)]
    colocated = make_engine(tiny_demo_model)
    colocated.add_request("r", prompt, params)
    expected = finish(colocated)["r"].token_ids

    prefill, decode = make_engine(tiny_demo_model), make_engine(tiny_demo_model)
    prefill.add_request("r", prompt, params, prefill_only=True)
    first = finish(prefill)["r"]
    assert first.finish_reason == "prefilled" and len(first.token_ids) == 1
    src = prefill.held_block_ids("r")
    assert first.held_block_ids == src  # handed out with the output too
    dst = decode.reserve("r", len(prompt))
    assert len(dst) == len(src) == 5  # 70 tokens in blocks of 16
    decode.runner.kv_pool.tensor[:, :, :, dst] = prefill.runner.kv_pool.tensor[:, :, :, src]
    assert prefill.release("r")
    assert_clean(prefill)

    decode.add_prefilled_request("r", prompt, first.token_ids[0], params)
    out = finish(decode)["r"]
    assert out.token_ids == expected
    if params.min_tokens:  # none of the stop ids before it, then one ended it
        stops = set(params.stop_token_ids)
        assert len(out.token_ids) > params.min_tokens and out.token_ids[-1] in stops
        assert not set(out.token_ids[:-1]) & stops
    assert_clean(decode)


MOVED_PARAMS = {
    **PARAMS,
    # A sampled guided text: its guide and its draws both go on past the output it came with.
    "guided": SamplingParams(max_tokens=24, temperature=0.8, seed=5, guided_regex=r"[a-z ]{30}", logprobs=1),
}


@pytest.mark.parametrize("kind", sorted(MOVED_PARAMS))
def test_a_request_moved_with_its_output_goes_on_as_if_it_had_not_moved(tiny_demo_model, kind):
    """Its output so far given to another engine, prefilled there after the prompt (as a request whose
    decode worker went away is): the rest is what one engine makes, its penalties, min_tokens, guide
    and seeded draws counting the output it came with. Computed there alone, or prefilled there and
    decoded in a third engine."""
    params = MOVED_PARAMS[kind]
    prompt = [(17 * j) % 900 + 5 for j in range(70)]
    colocated = make_engine(tiny_demo_model)
    colocated.add_request("r", prompt, params)
    expected = finish(colocated)["r"].token_ids
    so_far = expected[:5]

    alone = make_engine(tiny_demo_model)
    alone.add_request("r~1", prompt, params, output_token_ids=so_far)
    outs = []
    while alone.has_unfinished_requests():
        outs += alone.step()
    assert [t for out in outs for t in out.new_token_ids] == expected[5:]  # only what it made is new
    assert outs[-1].token_ids == expected and outs[-1].prompt_token_ids == prompt
    if params.logprobs is not None:
        assert all(len(lp) >= 1 for out in outs for lp in out.new_logprobs)
    assert_clean(alone)

    prefill, decode = make_engine(tiny_demo_model), make_engine(tiny_demo_model)
    prefill.add_request("r~1", prompt, params, prefill_only=True, output_token_ids=so_far)
    first = finish(prefill)["r~1"]
    assert first.finish_reason == "prefilled" and first.token_ids == expected[:6]
    dst = decode.reserve("r~1", len(prompt) + len(so_far))
    decode.runner.kv_pool.tensor[:, :, :, dst] = prefill.runner.kv_pool.tensor[:, :, :, prefill.held_block_ids("r~1")]
    prefill.release("r~1")
    decode.add_prefilled_request("r~1", prompt, first.token_ids[-1], params, output_token_ids=so_far)
    assert finish(decode)["r~1"].token_ids == expected
    assert_clean(decode)


def test_output_a_moved_request_cannot_have_is_refused(tiny_demo_model):
    engine = make_engine(tiny_demo_model)
    prompt = [5, 6, 7]
    with pytest.raises(ValueError, match="output token id 5000 is outside the vocabulary"):
        engine.add_request("r", prompt, PARAMS["greedy"], output_token_ids=[5, 5000])
    with pytest.raises(ValueError, match="max_tokens 24 leaves none to make"):
        engine.add_request("r", prompt, PARAMS["greedy"], output_token_ids=[5] * 24)
    digits = SamplingParams(max_tokens=8, guided_regex="[0-9]+")
    with pytest.raises(ValueError, match="output token ids do not follow guided_regex"):
        engine.add_request("r", prompt, digits, output_token_ids=[engine.tokenizer.token_to_id("x")])
    assert not engine.has_unfinished_requests()
    assert_clean(engine)


def test_decode_emits_a_logprob_for_every_token_after_the_first(tiny_demo_model):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    prompt = [(13 * j) % 900 + 5 for j in range(20)]
    expected = _colocated_logprobs(tiny_demo_model, prompt, params)
    assert len(expected) == 6

    prefill, decode = make_engine(tiny_demo_model), make_engine(tiny_demo_model)
    prefill.add_request("r", prompt, params, prefill_only=True)
    first = finish(prefill)["r"]
    dst = decode.reserve("r", len(prompt))
    decode.runner.kv_pool.tensor[:, :, :, dst] = prefill.runner.kv_pool.tensor[:, :, :, prefill.held_block_ids("r")]
    prefill.release("r")
    decode.add_prefilled_request("r", prompt, first.token_ids[0], params)
    emitted = []
    while decode.has_unfinished_requests():
        for out in decode.step():
            assert len(out.new_logprobs) == len(out.new_token_ids)
            emitted += out.new_logprobs
    assert len(emitted) == 5
    for got, want in zip(emitted, expected[1:]):
        assert got.keys() == want.keys()
        assert all(abs(got[k] - want[k]) < 1e-4 for k in got)


def _colocated_logprobs(model_dir, prompt, params):
    engine = make_engine(model_dir)
    engine.add_request("r", prompt, params)
    logprobs = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            logprobs += out.new_logprobs
    return logprobs


def test_prefill_only_request_that_ends_at_its_first_token_keeps_no_pages(tiny_demo_model):
    engine = make_engine(tiny_demo_model)
    engine.add_request("one", [5, 6, 7], SamplingParams(max_tokens=1, temperature=0), prefill_only=True)
    assert finish(engine)["one"].finish_reason == "length"
    assert not engine.release("one")
    assert_clean(engine)


def test_reservations_are_released_and_refused_cleanly(tiny_demo_model):
    engine = make_engine(tiny_demo_model)
    blocks = engine.reserve("a", 40)
    assert len(blocks) == 3 and engine.block_manager.num_free_blocks == 125
    engine.block_manager.check_integrity()
    with pytest.raises(ValueError, match="already holds blocks"):
        engine.reserve("a", 10)
    with pytest.raises(NoRoomYet, match="no room for 126 KV blocks now"):  # 125 free: once more are, it fits
        engine.reserve("huge", 126 * 16)
    small = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=64, max_num_batched_tokens=64))
    with pytest.raises(RuntimeError, match="in a pool of 64") as never:  # within the context, past the pool
        small.reserve("huger", 65 * 16)
    assert not isinstance(never.value, NoRoomYet)
    with pytest.raises(ValueError, match="no reservation"):
        engine.add_prefilled_request("never-reserved", [5, 6], 7, PARAMS["greedy"])
    assert engine.release_reservation("a") and not engine.release_reservation("a")
    assert_clean(engine)


def test_abort_frees_held_pages(tiny_demo_model):
    engine = make_engine(tiny_demo_model)
    engine.add_request("r", list(range(5, 45)), PARAMS["greedy"], prefill_only=True)
    finish(engine)
    assert engine.block_manager.num_free_blocks < engine.num_kv_blocks
    engine.abort("r")
    assert_clean(engine)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(max_tokens=1, temperature=0), SamplingParams(max_tokens=9, temperature=0, stop_token_ids=(42,))],
)
def test_first_token_that_ends_the_request_finishes_without_a_step(tiny_demo_model, params):
    engine = make_engine(tiny_demo_model)
    engine.reserve("r", 20)
    engine.add_prefilled_request("r", list(range(5, 25)), 42, params)
    outs = engine.step()
    assert [(o.request_id, o.finished, o.new_token_ids) for o in outs] == [("r", True, [])]
    assert outs[0].token_ids == [42] and outs[0].finish_reason in ("length", "stop")
    assert not engine.has_unfinished_requests()
    assert_clean(engine)


def test_handed_over_requests_past_max_num_seqs_wait_holding_their_pages(tiny_demo_model):
    """vLLM's and SGLang's decode: a prompt handed over runs only while fewer than max_num_seqs do;
    the rest wait with their pages, in the policy's order (here priority: lower first), and each gives
    the colocated tokens. One aborted while it waits frees its pages."""
    prompts = {f"r{i}": [(13 * j + 7 * i) % 900 + 5 for j in range(40)] for i in range(5)}
    priorities = {"r0": 5, "r1": 5, "r2": 9, "r3": 1, "r4": 9}  # r0, r1 run first; then r3 before r2

    def params(rid: str | None = None) -> SamplingParams:  # a priority for the decode engine only
        return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, priority=priorities.get(rid, 0))

    colocated = make_engine(tiny_demo_model)
    for rid, prompt in prompts.items():
        colocated.add_request(rid, prompt, params())
    expected = {rid: out.token_ids for rid, out in finish(colocated).items()}

    prefill = make_engine(tiny_demo_model)
    decode = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=128, max_num_seqs=2,
                                    scheduling_policy="priority"))
    for rid, prompt in prompts.items():
        prefill.add_request(rid, prompt, params(), prefill_only=True)
        first = finish(prefill)[rid]
        dst = decode.reserve(rid, len(prompt))
        decode.runner.kv_pool.tensor[:, :, :, dst] = prefill.runner.kv_pool.tensor[:, :, :, prefill.held_block_ids(rid)]
        prefill.release(rid)
        decode.add_prefilled_request(rid, prompt, first.token_ids[0], params(rid))
    assert [s.request_id for s in decode.scheduler.running] == ["r0", "r1"]
    assert sorted(s.request_id for s in decode.scheduler.waiting) == ["r2", "r3", "r4"]
    assert all(s.block_table for s in decode.scheduler.waiting)  # their pages held meanwhile
    decode.abort("r4")
    started, outs = [], {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
        started += [s.request_id for s in decode.scheduler.running if s.request_id not in started]
        assert len(decode.scheduler.running) <= 2
    assert started == ["r0", "r1", "r3", "r2"]
    ran = ("r0", "r1", "r2", "r3")
    assert {rid: outs[rid] for rid in ran} == {rid: expected[rid] for rid in ran}
    assert_clean(decode)


def test_a_long_prompts_computed_pages_are_reported_chunk_by_chunk_and_copy_as_the_handoff_would(tiny_demo_model):
    """`reports_pages`: after each chunk of a prefill-only prompt but its last, the pages whose KV is
    computed, each whole; copied out as they come, and the rest after the first token, they give the
    decode engine the colocated tokens."""
    params = PARAMS["greedy"]
    prompt = [(29 * j) % 900 + 5 for j in range(200)]  # 13 pages, computed 64 tokens a step
    colocated = make_engine(tiny_demo_model)
    colocated.add_request("r", prompt, params)
    expected = finish(colocated)["r"].token_ids

    prefill, decode = make_engine(tiny_demo_model), make_engine(tiny_demo_model)
    prefill.add_request("r", prompt, params, prefill_only=True, reports_pages=True)
    prefill.add_request("quiet", prompt[:100], params, prefill_only=True)  # reports none
    dst = decode.reserve("r", len(prompt))
    reports, first, copied = [], None, 0
    while first is None:
        for out in prefill.step():
            assert out.request_id == "r" or out.finished
            if out.finished:
                first = out if out.request_id == "r" else first
                continue
            reports.append(out.block_ids)
            decode.runner.kv_pool.tensor[:, :, :, dst[copied:len(out.block_ids)]] = \
                prefill.runner.kv_pool.tensor[:, :, :, out.block_ids[copied:]]
            copied = len(out.block_ids)
    assert [len(r) for r in reports] == [4, 8, 12]  # after 64, 128 and 192 tokens; 200 with the first token
    assert all(r == first.held_block_ids[:len(r)] for r in reports) and first.num_preemptions == 0
    decode.runner.kv_pool.tensor[:, :, :, dst[copied:]] = prefill.runner.kv_pool.tensor[:, :, :,
                                                                                        first.held_block_ids[copied:]]
    decode.add_prefilled_request("r", prompt, first.token_ids[0], params)
    assert finish(decode)["r"].token_ids == expected
    finish(prefill)
    assert prefill.release("r") and prefill.release("quiet")
    assert_clean(prefill)
