"""One thread owns the engine: it runs every engine call and every `step()`.

The engine is not thread-safe, so asyncio code never touches it directly: it
submits a command (a function of the engine) that the thread runs between steps,
and reads a request's outputs from an asyncio.Queue the thread fills through
`loop.call_soon_threadsafe`. With nothing running, the thread blocks on the
command queue (no busy loop). A request is started without waiting for the engine to
take it: its outputs say that, and a refusal comes the same way (`RequestRefusedError`).
Waiting would wake the caller's thread once more, from the engine thread as it begins the
request's first step: 20 us more before that step (the wake-up's write), and a thread
competing for the cores while it computes.

A worker process gives the engine its cores as well (`start(sole_parallel_thread=True)`):
its engine is built on the thread that then steps it, and every other thread runs torch
ops on one core. torch's CPU ops run on GNU OpenMP, which keeps a team of threads for
every thread that has run a parallel op, and once those outnumber the cores its idle
team threads stop spinning between parallel regions and sleep at once: each of the
hundreds of regions in a forward pass then starts with a wake-up. A 512-token prefill of
the demo model took about 220 context switches instead of 2, and 2-5 ms more of 30, as
soon as any second thread still alive (the one that built the engine, or one copying KV
pages) had run a parallel op; tests/unit/test_engine_thread.py counts the switches.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from engine import memory_release
from engine.kv_event_log import KVEvent, with_lora_ids
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from services.common.engine_stepper import STOP, EngineStepper
from services.common.engine_thread import EngineThread
from services.common.prompt_embeds import NO_INPUTS, GivenInputs
from services.common.request_outputs import IntoQueue

log = logging.getLogger("baton.engine_loop")
T = TypeVar("T")


class EngineLoop(EngineStepper):
    """`thread`: the one the engine was built on; by default a new one."""

    def __init__(self, engine: LLMEngine, thread: EngineThread | None = None) -> None:
        super().__init__(engine)
        self._thread = thread or EngineThread()
        self._running: concurrent.futures.Future | None = None

    def start(self, sole_parallel_thread: bool = False) -> None:
        """Start stepping. With `sole_parallel_thread` (a worker process, whose engine was built on
        `thread`), the calling thread and every thread that first uses torch after it run torch
        ops on one core, so the engine thread's OpenMP team is the process's only one (see above)."""
        self._running = self._thread.submit(self._run)
        self._running.add_done_callback(_log_failure)
        self._is_threaded.wait()
        if sole_parallel_thread:
            # torch sets a thread's count when it first uses it, from the last count set anywhere:
            # the engine thread's is settled by now, the other threads take this one.
            torch.set_num_threads(1)

    def on_failure(self, fn: Callable[[BaseException], None]) -> None:
        """Call `fn(error)` on the calling thread's event loop if the engine loop ends on a failed
        step (a worker then stops: its engine's state is unknown)."""
        loop = asyncio.get_running_loop()

        def ended(running: concurrent.futures.Future) -> None:
            if not running.cancelled() and running.exception() is not None:
                try:
                    loop.call_soon_threadsafe(fn, running.exception())
                except RuntimeError:  # the loop is closed: the process is stopping anyway
                    pass

        self._running.add_done_callback(ended)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish the command in hand, then end the thread. Outputs still pending are dropped."""
        if self._running is not None and not self._running.done():
            self._commands.put(STOP)
            concurrent.futures.wait([self._running], timeout_s)
        self._thread.shutdown(wait=False)

    # --- called from asyncio -------------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps; its result or exception comes back.
        Raises EngineDeadError, at once, once a step has failed."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue(fn, future)
        return await asyncio.wrap_future(future)

    def submit(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Fire and forget (from any thread): for cleanup that must happen even if no one awaits it."""
        self._commands.put((fn, None))

    async def publish_kv_events(self, sink: Callable[[list[KVEvent]], None]) -> None:
        """From now on hand `sink`, on the engine thread, the prefix cache's changes after every step
        and command that made any (engine/kv_event_log.py); first, what is cached now."""
        def enable(engine: LLMEngine) -> None:
            self._kv_event_sink = sink
            sink(with_lora_ids(engine.block_manager.enable_kv_events(), engine.loras.id_of))
        await self.call(enable)

    async def compile_guide(self, params: SamplingParams) -> None:
        """Compile a guided request's regex index or grammar, unless it is cached, on a worker thread:
        up to seconds for a large vocabulary, which neither the engine's thread nor the event loop may
        wait out (outlines-core and llguidance let go of the GIL meanwhile). ValueError if it does not
        compile; nothing for a request that is not guided."""
        if params.is_guided:
            await asyncio.to_thread(self.engine.guides.compile, params)

    async def prepare_guides(self) -> None:
        """Read the vocabulary for guided decoding (outlines-core's and llguidance's tables of it: seconds
        for a large one) on a worker thread, at warm-up rather than in a first guided request's time;
        nothing for an encoder or a model without a tokenizer.json."""
        if self.engine.tokenizer is None or self.engine.is_encoder:
            return
        try:
            await asyncio.to_thread(self.engine.guides.compile, SamplingParams(guided_grammar='start: "warm"'))
        except ValueError as e:  # a vocabulary llguidance cannot read: guided requests are refused, the rest served
            log.warning("guided decoding is unavailable: %s", e)

    async def pause(self, retract: bool) -> int:
        """Stop stepping after the step in hand (SGLang's pause_generation in place): requests stay
        where they are, new ones queue, commands and aborts still run. With `retract`, the running
        requests also give up their pages, to be recomputed once resumed. How many were running."""
        def pause(engine: LLMEngine) -> int:
            self._is_paused = True
            return engine.scheduler.retract_running() if retract else len(engine.scheduler.running)
        return await self.call(pause)

    @property
    def is_paused(self) -> bool:
        return self._is_paused

    async def resume(self) -> None:
        def resume(engine: LLMEngine) -> None:
            self._is_paused = False
        await self.call(resume)

    async def release_memory(self, kinds: Iterable[str]) -> int:
        """Give `kinds` of the idle engine's memory back to the host (engine/memory_release.py); the bytes."""
        kinds = tuple(kinds)
        return await self.call(lambda engine: memory_release.release(engine, kinds))

    async def resume_memory(self, kinds: Iterable[str]) -> None:
        kinds = tuple(kinds)
        await self.call(lambda engine: memory_release.resume(engine, kinds))

    async def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        return await self.call(lambda engine: engine.reserve(request_id, num_tokens))

    async def release_reservation(self, request_id: str) -> bool:
        return await self.call(lambda engine: engine.release_reservation(request_id))

    def start_prefilled(self, request_id: str, prompt_token_ids: list[int], first_token_id: int,
                        params: SamplingParams, output_token_ids: list[int] | tuple[int, ...] = (),
                        given: GivenInputs = NO_INPUTS, draft_token_ids: list[int] | tuple[int, ...] = ()
                        ) -> asyncio.Queue:
        """Adopt the reserved pages and join the running batch, the prefill worker's `draft_token_ids` its first
        step's drafts; returns the queue of RequestOutputs (see `add_request`). A refused request has its
        reservation released: the claim consumed it."""
        stream = (asyncio.get_running_loop(), asyncio.Queue())

        def add(engine: LLMEngine) -> None:
            try:
                engine.add_prefilled_request(request_id, prompt_token_ids, first_token_id, params, output_token_ids,
                                             draft_token_ids=draft_token_ids, **given.as_kwargs())
            except BaseException:
                engine.release_reservation(request_id)
                raise
            self._streams[request_id] = stream

        self._queue(add, IntoQueue(*stream))
        return stream[1]

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prefill_only: bool = False, output_token_ids: list[int] | tuple[int, ...] = (),
                    reports_pages: bool = False, given: GivenInputs = NO_INPUTS) -> asyncio.Queue:
        """Queue a new request in the engine; returns the queue of its RequestOutputs at once.

        Their first item is a `RequestRefusedError` for a request the engine refuses (the
        ValueError of `LLMEngine.add_request`), and then the only one; an `EngineDeadError`
        for one queued as the engine died (raised at once once it is dead). A `prefill_only`
        request that finishes "prefilled" holds its pages until `release` (or `cancel_soon`). A
        moved request comes with its `output_token_ids` so far; one that `reports_pages` gets its
        `ComputedPages` too, before its first token; a prompt given as embeddings, or with images,
        comes with them (`given`)."""
        stream = (asyncio.get_running_loop(), asyncio.Queue())

        def add(engine: LLMEngine) -> None:
            engine.add_request(request_id, prompt_token_ids, params, prefill_only=prefill_only,
                               output_token_ids=output_token_ids, reports_pages=reports_pages,
                               **given.as_kwargs())
            self._streams[request_id] = stream

        self._queue(add, IntoQueue(*stream))
        return stream[1]

    def _queue(self, fn: Callable[[LLMEngine], Any], future: concurrent.futures.Future | IntoQueue) -> None:
        """Queue `fn` for the engine thread, which tells `future` how it went; raises EngineDeadError
        at once once a step has failed."""
        if self.failure is not None:
            raise self._dead()
        self._commands.put((fn, future))
        if self.failure is not None:  # it failed as this was queued: no one is left to run it
            self._fail_queued()

    async def release(self, request_id: str) -> bool:
        """Free a "prefilled" request's held pages. False if nothing was held."""
        return await self.call(lambda engine: engine.release(request_id))

    def cancel_soon(self, request_id: str) -> None:
        """Without waiting, end a request added with `add_request` wherever it is: queued or
        running (aborted), finished "prefilled" (its held pages released), or already
        gone (nothing happens). Runs after every command submitted before it."""
        self.submit(lambda engine: engine.abort(request_id))

    async def abort(self, request_id: str) -> bool:
        """Stop `request_id` wherever it is and free its pages. False if nothing was held."""
        return await self.call(lambda engine: self._abort(engine, request_id))

    def abort_soon(self, request_id: str) -> None:
        """Abort without waiting: from a cancelled stream, which cannot await any more."""
        self.submit(lambda engine: self._abort(engine, request_id))

    # --- the engine thread -----------------------------------------------------------

    def _abort(self, engine: LLMEngine, request_id: str) -> bool:
        if engine.release_reservation(request_id):
            return True
        if request_id not in self._streams:
            return False
        engine.abort(request_id)  # its last output (finish_reason "abort") comes from the next step
        return True


def _log_failure(running: concurrent.futures.Future) -> None:
    """The one log line (with its traceback) of a failed step, or of any other failure that ends the loop."""
    if not running.cancelled() and running.exception() is not None:
        log.error("the engine loop ended", exc_info=running.exception())
