"""SGLang's `POST /pause_generation` and `POST /continue_generation`, which RL loops call around a
weight update so that the rollouts in flight are not computed half with one checkpoint and half with
the next, or so that they can be ended at once. SGLang's `mode`:

- `abort` (its default): every running request ends where it is, with finish_reason "abort" (a
  `/generate` sample's `{"type": "abort"}`) and its text so far, whichever API asked for it
  (running_requests.py); the call returns once they have ended (or after `ABORT_DRAIN_S`).
- `in_place`: every prefill and decode worker stops stepping after the step in hand; the running
  requests keep their pages and go on where they were after `/continue_generation`.
- `retract`: as `in_place`, and the running requests give up their pages as well, to be recomputed
  from their tokens after `/continue_generation` (with the weights served then).

vLLM's `POST /pause` (`?mode=abort|wait|keep`, `clear_cache`), `POST /resume` and `GET /is_paused` are the
same pause: `keep` is `in_place`, and `wait` holds new requests while the running ones finish.

In every mode, a request that arrives meanwhile waits at the gateway until `/continue_generation`,
a worker that joins is paused before it is routed to, and a decode worker's reservations do not run
out. A weight update asked for while the workers are paused does not wait for the paused requests:
in place, it is refused (409); retracted, each worker updates at once, or refuses while requests still
hold its pages (weight_updates.py). Only this gateway pauses: in front of one mesh with others, pause
each of them.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Literal

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from protos import scheduler_pb2, scheduler_pb2_grpc
from services.gateway.errors import APIError
from services.gateway.http_body import optional_body
from services.gateway.pipeline import RequestPipeline
from services.gateway.prefix_cache_api import reset_prefix_caches
from services.gateway.workers import Worker, WorkerPool, serving_workers

PAUSE_TIMEOUT_S = 30.0  # a worker finishes the step in hand first
ABORT_DRAIN_S = 30.0  # how long the call waits for the aborted requests to end (a worker may not answer)
DRAIN_POLL_S = 0.01
VLLM_MODES = {"abort": "abort", "wait": "wait", "keep": "in_place"}
WORKER_MODES = {"in_place": scheduler_pb2.PAUSE_MODE_IN_PLACE, "retract": scheduler_pb2.PAUSE_MODE_RETRACT}


class PauseGenerationRequest(BaseModel):
    """SGLang's PauseGenerationReqInput."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["abort", "in_place", "retract"] = "abort"


class GenerationPause:
    """Whether generation is paused, and how far: the gateway's requests held, and the workers' stepping."""

    def __init__(self, pipeline: RequestPipeline, pools: Sequence[WorkerPool]) -> None:
        self.pipeline = pipeline
        self.requests = pipeline.pause
        self.pools = pools
        self.mode: str | None = None  # the last pause's mode while paused
        self.workers_mode: str | None = None  # "in_place" or "retract" while the workers are paused
        self._lock = asyncio.Lock()
        for pool in pools:
            pool.before_serving(self._pause_joining)
        metrics = pipeline.metrics
        paused = metrics.gauge("baton_gateway_generation_paused", "1 while generation is paused here "
                               "(/pause_generation, vLLM's /pause), under the pause's mode; 0 otherwise", ["mode"])
        for mode in ("abort", "in_place", "retract", "wait"):  # SGLang's, and vLLM's wait
            paused.labels(**metrics.labels, mode=mode).set_function(lambda mode=mode: float(self.mode == mode))

    @property
    def is_paused(self) -> bool:
        return self.mode is not None

    async def pause(self, mode: str) -> None:
        """Pause in `mode`: SGLang's, or `wait` (vLLM's: new requests wait, running ones finish, and the call
        returns once they have). Pausing again applies the new mode; `abort` and `wait` leave paused workers
        paused. APIError (503) naming each worker that could not be paused; the others stay paused."""
        async with self._lock:
            if not self.is_paused:
                self.requests.hold()
            self.mode = mode
            if mode in ("abort", "wait"):
                if mode == "abort":
                    self.pipeline.running.abort_all()
                deadline = time.monotonic() + ABORT_DRAIN_S if mode == "abort" else float("inf")
                while self.pipeline.num_requests and time.monotonic() < deadline and self.workers_mode is None:
                    await asyncio.sleep(DRAIN_POLL_S)
                return
            self.workers_mode = mode
            request = scheduler_pb2.PauseRequest(mode=WORKER_MODES[mode])
            await on_each_scheduler(serving_workers(self.pools),
                                    lambda stub: stub.Pause(request, timeout=PAUSE_TIMEOUT_S))

    async def resume(self) -> None:
        """Every worker steps again and the held requests go on; APIError (503) naming each worker that
        could not be resumed (one gone for good is restarted unpaused)."""
        async with self._lock:
            if not self.is_paused:
                return
            try:
                if self.workers_mode is not None:
                    await on_each_scheduler(serving_workers(self.pools), lambda stub: stub.Resume(
                        scheduler_pb2.ResumeRequest(), timeout=PAUSE_TIMEOUT_S))
            finally:
                self.workers_mode = self.mode = None
                self.requests.let_go()

    async def _pause_joining(self, worker: Worker) -> None:
        async with self._lock:
            if self.workers_mode is not None:
                mode = WORKER_MODES[self.workers_mode]
                await scheduler_pb2_grpc.SchedulerStub(worker.channel).Pause(scheduler_pb2.PauseRequest(mode=mode),
                                                                             timeout=PAUSE_TIMEOUT_S)


async def on_each_scheduler(workers: Sequence[tuple[str, Worker]], call) -> list:
    """`call(stub)` on each worker's Scheduler service at once: their answers. APIError naming each worker
    that failed: 409 when each refused in its state (FAILED_PRECONDITION), else 503."""
    results = await asyncio.gather(*(call(scheduler_pb2_grpc.SchedulerStub(w.channel)) for _, w in workers),
                                   return_exceptions=True)
    failed, codes = [], set()
    for (kind, worker), result in zip(workers, results, strict=True):
        if isinstance(result, grpc.aio.AioRpcError):
            failed.append(f"{kind} worker {worker.address}: {result.details()}")
            codes.add(result.code())
        elif isinstance(result, BaseException):
            raise result
    if codes == {grpc.StatusCode.FAILED_PRECONDITION}:
        raise APIError(409, "; ".join(failed), code="conflict")
    if failed:
        raise APIError(503, "; ".join(failed), code="unavailable")
    return results


def add_generation_pause_routes(app: FastAPI, generation: GenerationPause) -> None:
    async def pause_generation(request: Request) -> JSONResponse:
        body = await optional_body(request, PauseGenerationRequest)  # SGLang's older clients post none
        await generation.pause(body.mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(request: Request) -> JSONResponse:
        await generation.resume()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    app.add_route("/pause_generation", pause_generation, methods=["POST"])
    app.add_route("/continue_generation", continue_generation, methods=["POST"])

    @app.post("/pause")
    async def pause(mode: Literal["abort", "wait", "keep"] = "abort", wait_for_inflight_requests: bool = False,
                    clear_cache: bool = True) -> JSONResponse:
        """vLLM's: its modes in the query (`keep` is SGLang's `in_place`); `clear_cache`, after the running
        requests have ended, forgets every worker's prefix cache."""
        if wait_for_inflight_requests and mode == "abort":  # its older spelling of wait
            mode = "wait"
        await generation.pause(VLLM_MODES[mode])
        if clear_cache and mode != "keep":
            await reset_prefix_caches(generation.pools)  # a worker still holding pages keeps its cache
        return JSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume() -> JSONResponse:
        await generation.resume()
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": generation.is_paused})
