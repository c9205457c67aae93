"""SGLang's `POST /update_weights_from_disk` and `GET /get_weight_version`: every prefill and decode
worker reads a trainer's next checkpoint of the served model in place of the one it serves, as RL
loops whose rollouts run on SGLang update it between rounds.

No request may be computed with two checkpoints (its prompt's KV by the old weights on a prefill
worker, its tokens by the new on a decode worker), so the gateway pauses: requests that arrive wait,
the running ones finish (with `abort_all_requests`, they end where they are, with finish_reason
"abort", running_requests.py), every worker updates, and the waiting requests go on with the new
weights. Each worker forgets its prefix cache, KV of the old weights (a prefill worker's kvstore node
its host tier too). A worker that still holds pages (a request from another gateway) is asked again
until `drain_timeout` runs out. A worker that joins later (a replica added, or one restarted, which
reads its --model) reads the last checkpoint before the gateway routes to it
(WorkerPool.before_serving), as lora_updates.py gives it the adapters loaded at run time. While
generation is paused on the workers (generation_pause.py) nothing is waited for: paused in place, the
running requests hold KV of the old weights and the update is refused; retracted, they hold none and
are recomputed with the new weights once generation continues.

The answer is SGLang's (`success`, `message`, `num_paused_requests`), and a refusal carries OpenAI's
error object beside it. Workers that updated before another refused stay updated: the message names
each. Only this gateway pauses: in front of one mesh with others, hold their traffic yourself.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from protos import weights_pb2, weights_pb2_grpc
from services.gateway.errors import APIError
from services.gateway.generation_pause import GenerationPause
from services.gateway.http_body import parsed_body
from services.gateway.pipeline import RequestPipeline
from services.gateway.workers import Worker, WorkerPool, serving_workers

UPDATE_TIMEOUT_S = 600.0  # one worker reading a checkpoint
IDLE_POLL_S = 0.01
RETRY_BUSY_S = 0.05
DEFAULT_WEIGHT_VERSION = "default"  # SGLang's, before any update names one


class UpdateWeightsRequest(BaseModel):
    """SGLang's UpdateWeightFromDiskReqInput (the fields served here), and Baton's `drain_timeout`."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(min_length=1)
    load_format: str | None = None  # SGLang's; only the checkpoint's own (safetensors) is read
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True  # the KV of the old weights is always forgotten: false is refused
    # Baton's: how long the running requests may take to finish before the update is given up.
    drain_timeout: float = Field(default=300.0, gt=0)

    def check(self) -> None:
        if self.load_format not in (None, "auto", "safetensors"):
            raise APIError(400, f"load_format {self.load_format!r} is not supported: the checkpoint is read as "
                                "safetensors", param="load_format")
        if not self.flush_cache:
            raise APIError(400, "flush_cache must be true: cached KV of the old weights would be read as the new's",
                           param="flush_cache")


class UpdateWeightVersionRequest(BaseModel):
    """SGLang's UpdateWeightVersionReqInput."""

    model_config = ConfigDict(extra="forbid")

    new_version: str = Field(min_length=1)
    abort_all_requests: bool = False


class WeightUpdates:
    """The mesh's weight version, and the one update that may run at a time."""

    def __init__(self, pipeline: RequestPipeline, pools: Sequence[WorkerPool], generation: GenerationPause):
        self.pipeline = pipeline
        self.pools = pools
        self.generation = generation
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self.model_path: str | None = None  # the checkpoint every worker serves since the last update
        self._lock = asyncio.Lock()
        for pool in pools:
            pool.before_serving(self.bring_up_to_date)

    async def update(self, body: UpdateWeightsRequest) -> tuple[list[str], int]:
        """Pause, drain, update every serving worker: each worker's line for the answer, and the requests
        the pause held. APIError (409) when the running requests outlast `drain_timeout`, or a worker
        still holds pages then; (400) when one refuses the checkpoint."""
        async with self._lock, self.pipeline.pause.holding():
            if body.abort_all_requests:
                self.pipeline.running.abort_all()
            # Requests paused on the workers will not finish: in place, they hold KV of these weights
            # (SGLang refuses to flush it too); retracted, they hold none, and each worker is asked once.
            if self.generation.workers_mode == "in_place" and self.pipeline.num_requests:
                raise APIError(409, f"{self.pipeline.num_requests} request(s) are paused in place, their KV computed "
                                    "with the weights served; nothing updated (pause with mode retract or abort)",
                               code="workers_busy")
            is_paused = self.generation.workers_mode is not None
            deadline = time.monotonic() + (0.0 if is_paused else body.drain_timeout)
            while self.pipeline.num_requests and not is_paused:
                if time.monotonic() > deadline:
                    raise APIError(409, f"{self.pipeline.num_requests} request(s) still running after "
                                        f"{body.drain_timeout:g} s; nothing updated", code="workers_busy")
                await asyncio.sleep(IDLE_POLL_S)
            workers = serving_workers(self.pools)
            results = await asyncio.gather(*(_update(worker, body.model_path, deadline) for _, worker in workers),
                                           return_exceptions=True)
            failed = [result for result in results if isinstance(result, BaseException)]
            unexpected = next((e for e in failed if not isinstance(e, APIError)), None)
            if unexpected is not None:
                raise unexpected
            lines = [f"{kind} {worker.address}: " + (result.message if isinstance(result, APIError)
                                                     else f"updated in {result:.2f} s")
                     for (kind, worker), result in zip(workers, results, strict=True)]
            if failed:
                raise APIError(failed[0].status, "; ".join(lines), code=failed[0].code)
            self.model_path = body.model_path
            if body.weight_version is not None:
                self.weight_version = body.weight_version
            return lines, self.pipeline.pause.num_waiting

    async def bring_up_to_date(self, worker: Worker) -> None:
        """Have `worker`, which was away at the last update, read its checkpoint; raises where it cannot."""
        async with self._lock:
            if self.model_path is not None:
                await _update(worker, self.model_path, time.monotonic() + UPDATE_TIMEOUT_S)


async def _update(worker: Worker, model_path: str, deadline: float) -> float:
    """Seconds `worker` took to read the checkpoint, asking again while requests hold its pages."""
    stub = weights_pb2_grpc.WeightsStub(worker.channel)
    while True:
        try:
            reply = await stub.UpdateFromDisk(weights_pb2.UpdateWeightsRequest(model_path=model_path),
                                              timeout=UPDATE_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            status = 400 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 503
            raise APIError(status, f"not updated: {e.details()}",
                           code=None if status == 400 else "unavailable") from None
        if reply.updated:
            return reply.seconds
        if time.monotonic() > deadline:
            raise APIError(409, "not updated: requests still hold its pages", code="workers_busy")
        await asyncio.sleep(RETRY_BUSY_S)


def add_weight_update_routes(app: FastAPI, updates: WeightUpdates) -> None:
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await parsed_body(request, UpdateWeightsRequest)
        try:
            body.check()
            lines, num_paused = await updates.update(body)
        except APIError as e:
            return JSONResponse({"success": False, "message": e.message, **e.body()}, status_code=e.status)
        return JSONResponse({"success": True, "message": "Succeeded to update model weights. " + "; ".join(lines),
                             "num_paused_requests": num_paused})

    async def get_weight_version(request: Request) -> JSONResponse:
        return JSONResponse({"weight_version": updates.weight_version})

    async def update_weight_version(request: Request) -> JSONResponse:
        """SGLang's: names the weights served (a trainer that sent them another way), nothing reloaded."""
        body = await parsed_body(request, UpdateWeightVersionRequest)
        if body.abort_all_requests:
            updates.pipeline.running.abort_all()
        updates.weight_version = body.new_version
        return JSONResponse({"success": True, "message": f"Weight version updated to {body.new_version}",
                             "new_version": body.new_version})

    app.add_route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"])
    app.add_route("/get_weight_version", get_weight_version, methods=["GET"])
    app.add_route("/update_weight_version", update_weight_version, methods=["POST"])
