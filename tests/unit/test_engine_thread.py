"""A worker's engine thread is its process's only OpenMP team: its prefills are not slowed by
OpenMP threads that sleep between a forward pass's parallel regions.

GNU OpenMP keeps a team for every thread that has run a parallel op; once the teams' threads
outnumber the cores, idle team threads stop spinning and sleep at once, and each region starts
with a wake-up (services/common/engine_loop.py). Each case runs in a fresh process: OpenMP's
state is the process's."""
from __future__ import annotations

import asyncio
import json
import logging
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from services.common.engine_errors import EngineDeadError
from services.common.engine_loop import EngineLoop
from services.common.request_outputs import RequestRefusedError, finished

REPO_ROOT = Path(__file__).resolve().parents[2]

# The engine is built on its thread and stepped there, as the services do; then another thread
# copies a large tensor, as a prefill worker's KV writer does. Voluntary context switches
# of the process, per 512-token prefill, and each thread's torch thread count.
PREFILL_SWITCHES = """
import json, random, resource, sys, asyncio
import torch
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from services.common.engine_loop import EngineLoop
from services.common.engine_thread import EngineThread

async def main():
    thread = EngineThread()
    loop = asyncio.get_running_loop()
    engine = await loop.run_in_executor(thread, lambda: LLMEngine(EngineConfig(model=sys.argv[1], num_kv_blocks=64)))
    engine_loop = EngineLoop(engine, thread)
    engine_loop.start(sole_parallel_thread=sys.argv[2] == "sole")
    # On the default executor, whose threads live on, as the KV writer's copies run.
    await loop.run_in_executor(None, lambda: torch.empty(4096, 4096).copy_(torch.ones(4096, 4096)))
    counts = {"engine": await engine_loop.call(lambda _: torch.get_num_threads()), "main": torch.get_num_threads()}
    rng = random.Random(0)
    switches = []
    for i in range(10):
        prompt = [rng.randrange(4, engine.model_config.vocab_size) for _ in range(512)]
        await asyncio.sleep(0.05)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
        outputs = engine_loop.add_request(f"r{i}", prompt, SamplingParams(max_tokens=1, temperature=0))
        await outputs.get()
        switches.append(resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before)
    engine_loop.stop()
    print(json.dumps({"switches": switches[2:], "threads": counts}))

asyncio.run(main())
"""


def prefill_switches(model_dir: Path, sole: bool) -> dict:
    done = subprocess.run([sys.executable, "-c", PREFILL_SWITCHES, str(model_dir), "sole" if sole else "shared"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=180, check=True)
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Wide enough that a prefill's ops run as parallel regions."""
    from engine.demo_model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("engine-thread") / "model", hidden_size=256, num_layers=4,
                           vocab_size=1024, seed=1)


def test_the_engine_thread_keeps_its_cores_and_is_the_only_openmp_team(model_dir):
    sole, shared = prefill_switches(model_dir, sole=True), prefill_switches(model_dir, sole=False)
    if shared["threads"]["engine"] < 2:
        pytest.skip("one core: torch runs no parallel regions here")
    assert sole["threads"] == {"engine": shared["threads"]["engine"], "main": 1}
    # Measured here: 2-3 against about 200 with a second team.
    assert statistics.median(sole["switches"]) * 4 < statistics.median(shared["switches"]), (sole, shared)


def test_a_failed_step_ends_every_stream_and_call_and_is_logged_once(tiny_demo_model, caplog):
    """The engine's state is unknown after a step raised: the request waiting on it gets the error,
    so does any later call (at once, not never), the worker hears of it (`on_failure`), and the
    failure is one log record with its traceback."""
    engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=32))

    def failing_step():
        raise RuntimeError("the device fell off the bus")
    engine.step = failing_step  # a fault injected: nothing makes a real engine fail on demand

    async def main():
        engine_loop = EngineLoop(engine)
        engine_loop.start()
        heard = asyncio.get_running_loop().create_future()
        engine_loop.on_failure(heard.set_result)
        stream = engine_loop.add_request("r0", [5, 6, 7], SamplingParams(max_tokens=2))
        end = await asyncio.wait_for(stream.get(), 10)
        with pytest.raises(EngineDeadError, match="fell off"):
            engine_loop.add_request("r1", [5, 6, 7], SamplingParams(max_tokens=2))
        engine_loop.stop()
        return end, await asyncio.wait_for(heard, 10)

    with caplog.at_level(logging.ERROR, logger="baton.engine_loop"):
        end, heard = asyncio.run(main())
    assert isinstance(end, RuntimeError) and "fell off" in str(end)
    assert heard is end
    failures = [r for r in caplog.records if r.exc_info]
    assert len(failures) == 1 and failures[0].exc_info[1] is end


def test_a_request_is_started_without_a_wait_and_a_refused_one_hears_it_on_its_queue(tiny_demo_model):
    """`add_request` returns at once; a request the engine refuses gets a RequestRefusedError as its
    queue's one item, and a duplicate id leaves the request already holding it running."""
    engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=32))
    vocab = engine.model_config.vocab_size

    async def main():
        engine_loop = EngineLoop(engine)
        engine_loop.start()
        try:
            running = engine_loop.add_request("r0", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
            duplicate = engine_loop.add_request("r0", [5, 6, 7], SamplingParams(max_tokens=3))
            outside = engine_loop.add_request("r1", [5, vocab], SamplingParams(max_tokens=3))
            refusals = [await asyncio.wait_for(q.get(), 10) for q in (duplicate, outside)]
            last = await asyncio.wait_for(finished(running), 10)
            return refusals, last, duplicate.empty() and outside.empty()
        finally:
            engine_loop.stop()

    (duplicate, outside), last, nothing_more = asyncio.run(main())
    assert isinstance(duplicate, RequestRefusedError) and "already in use" in str(duplicate)
    assert isinstance(outside, RequestRefusedError) and "outside the vocabulary" in str(outside)
    assert nothing_more and len(last.token_ids) == 3 and last.finish_reason == "length"


def test_a_request_queued_behind_a_failing_step_hears_the_engine_died(tiny_demo_model):
    """A start still queued when a step fails is not lost: its queue gets the EngineDeadError."""
    engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=32))
    stepping, go_on = threading.Event(), threading.Event()

    def failing_step():
        stepping.set()
        go_on.wait(10)
        raise RuntimeError("the device fell off the bus")
    engine.step = failing_step

    async def main():
        engine_loop = EngineLoop(engine)
        engine_loop.start()
        first = engine_loop.add_request("r0", [5, 6, 7], SamplingParams(max_tokens=2))
        await asyncio.get_running_loop().run_in_executor(None, stepping.wait, 10)
        queued = engine_loop.add_request("r1", [5, 6, 7], SamplingParams(max_tokens=2))  # behind the failing step
        go_on.set()
        got = [await asyncio.wait_for(q.get(), 10) for q in (first, queued)]
        engine_loop.stop()
        return got

    first, queued = asyncio.run(main())
    assert isinstance(first, RuntimeError) and "fell off" in str(first)
    assert isinstance(queued, EngineDeadError) and "fell off" in str(queued)
