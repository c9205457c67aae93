"""A worker's engine loop paused (SGLang's pause_generation in place, or retracting) and resumed:
nothing steps meanwhile, an abort still ends its request and frees its pages, and every request
then ends with the tokens it would have had unpaused; a decode worker's leases stop running out."""
from __future__ import annotations

import asyncio

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from services.common.engine_loop import EngineLoop
from services.common.request_outputs import finished
from services.decode.leases import LeaseTable

GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
PROMPTS = {f"r{i}": [(11 * i + 7 * j) % 900 + 5 for j in range(20 + 5 * i)] for i in range(3)}


def unpaused_tokens(model_dir) -> dict[str, list[int]]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64))
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update((out.request_id, list(out.token_ids)) for out in engine.step() if out.finished)
    assert all(len(tokens) == GREEDY.max_tokens for tokens in done.values())
    return done


def paused_and_resumed(model_dir, retract: bool) -> tuple[dict, dict]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64))

    async def main():
        engine_loop = EngineLoop(engine)
        engine_loop.start()
        try:
            queues = {rid: engine_loop.add_request(rid, prompt, GREEDY) for rid, prompt in PROMPTS.items()}
            while all(q.empty() for q in queues.values()):  # every request has started
                await asyncio.sleep(0.001)
            num_running = await engine_loop.pause(retract=retract)
            free_when_paused = await engine_loop.call(lambda e: e.block_manager.num_free_blocks)
            late = engine_loop.add_request("late", PROMPTS["r0"], GREEDY)  # queues, does not run
            doomed = engine_loop.add_request("doomed", PROMPTS["r1"], GREEDY)
            await asyncio.sleep(0.05)
            progress = {rid: q.qsize() for rid, q in queues.items()}
            await asyncio.sleep(0.3)
            assert {rid: q.qsize() for rid, q in queues.items()} == progress, "a paused engine stepped"
            assert late.empty()
            assert await engine_loop.abort("doomed")
            aborted = await asyncio.wait_for(finished(doomed), 5)  # while paused
            await engine_loop.resume()
            ends = {rid: await asyncio.wait_for(finished(q), 30) for rid, q in [*queues.items(), ("late", late)]}
            seen = {"num_running": num_running, "free_when_paused": free_when_paused,
                    "aborted": aborted.finish_reason,
                    "free_at_end": await engine_loop.call(lambda e: e.block_manager.num_free_blocks),
                    "preemptions": await engine_loop.call(lambda e: e.scheduler.num_preemptions)}
            return {rid: list(out.token_ids) for rid, out in ends.items()}, seen
        finally:
            engine_loop.stop()

    return asyncio.run(main())


def test_a_request_paused_in_place_ends_as_it_would_have_unpaused(tiny_demo_model):
    expected = unpaused_tokens(tiny_demo_model)
    tokens, seen = paused_and_resumed(tiny_demo_model, retract=False)
    assert {rid: tokens[rid] for rid in PROMPTS} == expected
    assert tokens["late"] == expected["r0"]
    assert seen["num_running"] == len(PROMPTS) and seen["aborted"] == "abort"
    assert seen["free_when_paused"] < 64 and seen["preemptions"] == 0  # the paused kept their pages
    assert seen["free_at_end"] == 64


def test_retracted_requests_give_up_their_pages_and_are_recomputed_to_the_same_tokens(tiny_demo_model):
    expected = unpaused_tokens(tiny_demo_model)
    tokens, seen = paused_and_resumed(tiny_demo_model, retract=True)
    assert {rid: tokens[rid] for rid in PROMPTS} == expected
    assert seen["num_running"] == len(PROMPTS) and seen["free_when_paused"] == 64
    assert seen["preemptions"] == len(PROMPTS) and seen["free_at_end"] == 64


def test_held_leases_do_not_run_out_until_released_and_then_get_a_whole_lease():
    async def main():
        expired: list[str] = []
        leases = LeaseTable(0.1, lambda lease: expired.append(lease.request_id))
        leases.grant("before", [1])
        leases.hold()
        held = leases.grant("during", [2])
        await asyncio.sleep(0.25)
        assert expired == [] and leases.get(held) is not None
        leases.release()
        await asyncio.sleep(0.05)
        assert expired == []  # a whole lease from the release
        await asyncio.sleep(0.15)
        return sorted(expired), len(leases)

    assert asyncio.run(main()) == (["before", "during"], 0)
