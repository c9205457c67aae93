"""`EngineStepper`: the engine thread's side of an EngineLoop (engine_loop.py says why one thread owns
the engine). It holds what the two sides share (the command queue, the requests' output queues, the
paused flag, the failure) and runs the loop the thread lives in: it runs the commands queued for it
between steps, steps the engine while it has work, and hands each step's outputs to their requests'
queues. A failed step fails every output queue and every queued call, and ends the loop."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from engine.kv_event_log import with_lora_ids
from engine.llm_engine import LLMEngine
from engine.outputs import ComputedPages, RequestOutput
from services.common.engine_errors import EngineDeadError
from services.common.request_outputs import IntoQueue, hand_over

log = logging.getLogger("baton.engine_loop")
STOP = object()


class EngineStepper:
    """What the engine thread runs (`_run`), and the state it shares with the asyncio side."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # request id -> (its consumer's loop, its output queue); touched only by the engine thread
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._is_threaded = threading.Event()
        self.failure: BaseException | None = None  # what ended the loop, once a step failed
        self._is_paused = False  # set only by the engine thread
        # Given the prefix cache's changes after each step or command that made any; set (on the
        # engine thread) by EngineLoop.publish_kv_events.
        self._kv_event_sink: Callable[[list], None] | None = None

    def _run(self) -> None:
        # torch fixes a thread's count on its first use of it (the count built with, or the last
        # one set anywhere): fixed now, before `start` may set the other threads' to one.
        torch.get_num_threads()
        self._is_threaded.set()
        commands = self._commands
        while True:
            # Idle: block for work. Busy: take whatever arrived and go on stepping. While it runs, only
            # this thread takes commands, so one seen waiting is there to take: no queue.Empty raised
            # and caught between a request's arrival and its first step.
            is_busy = self._has_work()
            command = None if is_busy and commands.empty() else commands.get()
            while command is not None:
                if command is STOP:
                    return
                self._execute(*command)
                self._hand_kv_events()
                command = None if commands.empty() else commands.get()
            if self._is_paused:
                self._deliver(self.engine.finished_outside_step())
            elif self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()
                except Exception as e:  # the engine's state is unknown now: end every stream and call, then die loudly
                    self.failure = e
                    for loop, outputs_queue in self._streams.values():
                        loop.call_soon_threadsafe(outputs_queue.put_nowait, e)
                    self._streams.clear()
                    self._fail_queued()
                    raise
                self._deliver(outputs)
                self._hand_kv_events()

    def _hand_kv_events(self) -> None:
        if self._kv_event_sink is not None:
            events = self.engine.block_manager.take_kv_events()
            if events:
                self._kv_event_sink(with_lora_ids(events, self.engine.loras.id_of))

    def _has_work(self) -> bool:
        if self._is_paused:
            return self.engine.has_finished_outside_step()
        return self.engine.has_unfinished_requests()

    def _fail_queued(self) -> None:
        """Fail every call still queued with EngineDeadError (from either thread: each takes its own)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is not STOP and command[1] is not None and command[1].set_running_or_notify_cancel():
                command[1].set_exception(self._dead())

    def _dead(self) -> EngineDeadError:
        return EngineDeadError(f"the engine failed: {self.failure!r}")

    def _execute(self, fn: Callable[[LLMEngine], Any], future: concurrent.futures.Future | IntoQueue | None) -> None:
        if future is not None and not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(self.engine)
        except BaseException as e:
            if future is None:
                log.exception("engine command failed")
            else:
                future.set_exception(e)
            return
        if future is not None:
            future.set_result(result)

    def _deliver(self, outputs: list[RequestOutput | ComputedPages]) -> None:
        for out in outputs:
            stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is None:
                continue
            hand_over(*stream, out)
