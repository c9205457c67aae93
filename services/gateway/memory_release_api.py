"""SGLang's `POST /release_memory_occupation` and `POST /resume_memory_occupation`, and vLLM's
`POST /sleep`, `POST /wake_up` and `GET /is_sleeping`: an RL loop colocating its trainer with the
mesh gives the trainer the mesh's memory between rollouts.

Every prefill and decode worker gives back the memory named (`tags`, SGLang's: `weights`,
`kv_cache`; none: both) and takes it back on resume: its KV pool's pages (its prefix cache forgotten)
and its weights' (read again from the checkpoint it serves, or a weight update read while asleep;
engine/memory_release.py). vLLM's level 1 releases the KV cache alone (it keeps the weights in host
memory, where a CPU worker's already are), level 2 both; `wake_up` takes `tags` as SGLang's resume does.

Only an idle mesh releases memory: while requests are in flight it is refused (409), nothing released
(end them first: `/pause_generation` in abort mode, or wait). From the release until everything is
back, requests that arrive wait at the gateway, as in a pause. A worker that refuses (requests of
another gateway in it: 409) or fails (503) is named, and the others take back what they gave. A worker
that joins meanwhile (a replica added or restarted) gives back the same before it is routed to.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from protos import scheduler_pb2, scheduler_pb2_grpc
from services.common.converters import MEMORY_KINDS
from services.gateway.errors import APIError
from services.gateway.generation_pause import on_each_scheduler
from services.gateway.http_body import optional_body
from services.gateway.pipeline import RequestPipeline
from services.gateway.workers import Worker, WorkerPool, serving_workers

MEMORY_TIMEOUT_S = 120.0  # resuming weights reads the checkpoint again
KIND_IDS = {name: kind for kind, name in MEMORY_KINDS.items()}
VLLM_LEVELS = {1: ("kv_cache",), 2: ("weights", "kv_cache")}
Tag = Literal["weights", "kv_cache"]


class MemoryTags(BaseModel):
    """SGLang's ReleaseMemoryOccupationReqInput and ResumeMemoryOccupationReqInput."""

    model_config = ConfigDict(extra="forbid")

    tags: list[Tag] | None = None  # None or empty: every kind


class MeshMemory:
    """What of the workers' memory is given back now, and the gateway's requests held meanwhile."""

    def __init__(self, pipeline: RequestPipeline, pools: Sequence[WorkerPool]) -> None:
        self.pipeline = pipeline
        self.pools = pools
        self.released: set[str] = set()
        self._lock = asyncio.Lock()  # a worker joining mid-release learns what the others gave back
        for pool in pools:
            pool.before_serving(self._release_joining)

    @property
    def is_sleeping(self) -> bool:
        return bool(self.released)

    async def release(self, kinds: Iterable[str]) -> int:
        """Every worker gives `kinds` back; the bytes, summed. APIError 409 while requests are in flight."""
        kinds = _kinds(kinds)
        async with self._lock:
            return await self._release(kinds)

    async def _release(self, kinds: set[str]) -> int:
        self.pipeline.pause.hold()  # first: a request not yet counted now waits
        try:
            if self.pipeline.num_requests:
                raise APIError(409, f"{self.pipeline.num_requests} requests in flight: memory is released only "
                               "by an idle mesh (end them with /pause_generation in abort mode, or wait)",
                               code="conflict")
            request = _memory_request(kinds)
            workers = serving_workers(self.pools)
            try:
                answers = await on_each_scheduler(workers, lambda stub: stub.ReleaseMemory(
                    request, timeout=MEMORY_TIMEOUT_S))
            except APIError:  # a worker refused (another gateway's requests on it) or failed: none stays released
                undo = _memory_request(kinds - self.released)
                if undo.kinds:
                    await on_each_scheduler(workers, lambda stub: stub.ResumeMemory(undo, timeout=MEMORY_TIMEOUT_S))
                raise
        except BaseException:
            self.pipeline.pause.let_go()
            raise
        if self.released:
            self.pipeline.pause.let_go()  # held once for as long as anything is released
        self.released |= kinds
        return sum(answer.bytes_released for answer in answers)

    async def resume(self, kinds: Iterable[str]) -> None:
        """Every worker takes `kinds` back; once nothing is released, held requests go on."""
        kinds = _kinds(kinds)
        request = _memory_request(kinds)
        async with self._lock:
            await on_each_scheduler(serving_workers(self.pools), lambda stub: stub.ResumeMemory(
                request, timeout=MEMORY_TIMEOUT_S))
            if self.released and not self.released - kinds:
                self.pipeline.pause.let_go()
            self.released -= kinds

    async def _release_joining(self, worker: Worker) -> None:
        async with self._lock:
            if self.released:
                await scheduler_pb2_grpc.SchedulerStub(worker.channel).ReleaseMemory(
                    _memory_request(self.released), timeout=MEMORY_TIMEOUT_S)


def _kinds(tags: Iterable[str] | None) -> set[str]:
    return set(tags or ()) or set(KIND_IDS)


def _memory_request(kinds: Iterable[str]) -> scheduler_pb2.MemoryRequest:
    return scheduler_pb2.MemoryRequest(kinds=[KIND_IDS[k] for k in kinds])


def add_memory_release_routes(app: FastAPI, memory: MeshMemory) -> None:
    async def release_memory_occupation(request: Request) -> JSONResponse:
        body = await optional_body(request, MemoryTags)
        released = await memory.release(body.tags)
        return JSONResponse({"success": True, "message": f"{released} bytes released"})

    async def resume_memory_occupation(request: Request) -> JSONResponse:
        body = await optional_body(request, MemoryTags)
        await memory.resume(body.tags)
        return JSONResponse({"success": True, "message": "memory resumed"})

    app.add_route("/release_memory_occupation", release_memory_occupation, methods=["POST"])
    app.add_route("/resume_memory_occupation", resume_memory_occupation, methods=["POST"])

    @app.post("/sleep")
    async def sleep(level: int = Query(1, ge=1, le=2)) -> JSONResponse:
        await memory.release(VLLM_LEVELS[level])
        return JSONResponse({})

    @app.post("/wake_up")
    async def wake_up(tags: list[Tag] | None = Query(None)) -> JSONResponse:
        await memory.resume(tags)
        return JSONResponse({})

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": memory.is_sleeping})
