"""SGLang's `POST /pause_generation` and `POST /continue_generation`, which RL loops call around a
weight update so that the rollouts in flight are not computed half with one checkpoint and half with
the next, or so that they can be ended at once. SGLang's `mode`:

- `abort` (its default): every running SGLang `/generate` sample ends where it is, with `{"type":
  "abort"}` as its finish (as `/abort_request` with `abort_all`); the workers go on stepping, so the
  other requests finish.
- `in_place`: every prefill and decode worker stops stepping after the step in hand; the running
  requests keep their pages and go on where they were after `/continue_generation`.
- `retract`: as `in_place`, and the running requests give up their pages as well, to be recomputed
  from their tokens after `/continue_generation` (with the weights served then).

In every mode, a request that arrives meanwhile waits at the gateway until `/continue_generation`,
a worker that joins is paused before it is routed to, and a decode worker's reservations do not run
out. A weight update asked for while the workers are paused does not wait for the paused requests:
each worker updates at once, or refuses while requests hold its pages (weight_updates.py). Only this
gateway pauses: in front of one mesh with others, pause each of them.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Literal

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from protos import pause_pb2, pause_pb2_grpc
from services.gateway.errors import APIError
from services.gateway.http_body import parsed_body
from services.gateway.request_pause import RequestPause
from services.gateway.workers import Worker, WorkerPool

PAUSE_TIMEOUT_S = 30.0  # a worker finishes the step in hand first
WORKER_MODES = {"in_place": pause_pb2.PAUSE_MODE_IN_PLACE, "retract": pause_pb2.PAUSE_MODE_RETRACT}


class PauseGenerationRequest(BaseModel):
    """SGLang's PauseGenerationReqInput."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["abort", "in_place", "retract"] = "abort"


class GenerationPause:
    """Whether generation is paused, and how far: the gateway's requests held, and the workers' stepping."""

    def __init__(self, requests: RequestPause, pools: Sequence[WorkerPool]) -> None:
        self.requests = requests
        self.pools = pools
        self.is_paused = False
        self.workers_mode: str | None = None  # "in_place" or "retract" while the workers are paused
        self._lock = asyncio.Lock()
        for pool in pools:
            pool.before_serving(self._pause_joining)

    async def pause(self, mode: str, abort_all: Callable[[], int]) -> None:
        """Pause in `mode` (pausing again applies the new mode; `abort` leaves paused workers paused).
        APIError (503) naming each worker that could not be paused; the others stay paused."""
        async with self._lock:
            if not self.is_paused:
                self.requests.hold()
                self.is_paused = True
            if mode == "abort":
                abort_all()
                return
            self.workers_mode = mode
            await _on_each(self._serving(), lambda stub: stub.Pause(pause_pb2.PauseRequest(mode=WORKER_MODES[mode]),
                                                                     timeout=PAUSE_TIMEOUT_S))

    async def resume(self) -> None:
        """Every worker steps again and the held requests go on; APIError (503) naming each worker that
        could not be resumed (one gone for good is restarted unpaused)."""
        async with self._lock:
            if not self.is_paused:
                return
            try:
                if self.workers_mode is not None:
                    await _on_each(self._serving(), lambda stub: stub.Resume(pause_pb2.ResumeRequest(),
                                                                              timeout=PAUSE_TIMEOUT_S))
            finally:
                self.workers_mode = None
                self.is_paused = False
                self.requests.let_go()

    def _serving(self) -> list[tuple[str, Worker]]:
        return [(pool.kind, worker) for pool in self.pools for worker in pool.workers if worker.is_serving]

    async def _pause_joining(self, worker: Worker) -> None:
        async with self._lock:
            if self.workers_mode is not None:
                stub = pause_pb2_grpc.GenerationStub(worker.channel)
                await stub.Pause(pause_pb2.PauseRequest(mode=WORKER_MODES[self.workers_mode]), timeout=PAUSE_TIMEOUT_S)


async def _on_each(workers: Sequence[tuple[str, Worker]], call) -> None:
    results = await asyncio.gather(*(call(pause_pb2_grpc.GenerationStub(w.channel)) for _, w in workers),
                                   return_exceptions=True)
    failed = []
    for (kind, worker), result in zip(workers, results, strict=True):
        if isinstance(result, grpc.aio.AioRpcError):
            failed.append(f"{kind} worker {worker.address}: {result.details()}")
        elif isinstance(result, BaseException):
            raise result
    if failed:
        raise APIError(503, "; ".join(failed), code="unavailable")


def add_generation_pause_routes(app: FastAPI, generation: GenerationPause, abort_all: Callable[[], int]) -> None:
    """`abort_all`: ends every running SGLang `/generate` sample (sglang_api.py's)."""
    async def pause_generation(request: Request) -> JSONResponse:
        # SGLang's older clients post no body: the default mode.
        has_body = bool((await request.body()).strip())
        body = await parsed_body(request, PauseGenerationRequest) if has_body else PauseGenerationRequest()
        await generation.pause(body.mode, abort_all)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(request: Request) -> JSONResponse:
        await generation.resume()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    app.add_route("/pause_generation", pause_generation, methods=["POST"])
    app.add_route("/continue_generation", continue_generation, methods=["POST"])
