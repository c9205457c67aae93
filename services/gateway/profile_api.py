"""vLLM's and SGLang's `POST /start_profile` and `POST /stop_profile`: torch's profiler over every
prefill and decode worker's engine steps in between, each worker's trace written into its own
--profiler-dir (a worker started without one refuses, as vLLM's server without
VLLM_TORCH_PROFILER_DIR does). `/start_profile` takes SGLang's `record_shapes` and `with_stack`;
`/stop_profile` answers each worker's trace file, on that worker's host.

A worker that cannot start (profiling off there, or recording already) fails the call; the others
that started record on until `/stop_profile`."""
from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from protos import profile_pb2, profile_pb2_grpc
from services.gateway.errors import APIError
from services.gateway.http_body import optional_body
from services.gateway.workers import Worker, WorkerPool, serving_workers

PROFILE_TIMEOUT_S = 120.0  # a long recording's trace takes a while to write


class StartProfileRequest(BaseModel):
    """SGLang's ProfileReqInput, the fields served here (its output_dir and the like are the workers' own)."""

    model_config = ConfigDict(extra="ignore")

    record_shapes: bool = False
    with_stack: bool = False


async def _on_each(pools: Sequence[WorkerPool], call) -> list[dict]:
    """`call(stub)` on every serving worker at once; APIError naming the first that failed."""
    workers = serving_workers(pools)
    if not workers:
        raise APIError(503, "no worker is serving", code="unavailable")
    results = await asyncio.gather(*(call(profile_pb2_grpc.ProfilerStub(w.channel)) for _, w in workers),
                                   return_exceptions=True)
    for (kind, worker), result in zip(workers, results, strict=True):
        if isinstance(result, grpc.aio.AioRpcError):
            status = 400 if result.code() == grpc.StatusCode.FAILED_PRECONDITION else 503
            raise APIError(status, f"{kind} worker {worker.address}: {result.details()}",
                           code=None if status == 400 else "unavailable")
        if isinstance(result, BaseException):
            raise result
    return [_answer(kind, worker, result) for (kind, worker), result in zip(workers, results, strict=True)]


def _answer(kind: str, worker: Worker, reply) -> dict:
    answer = {"kind": kind, "address": worker.address}
    if isinstance(reply, profile_pb2.StopProfileResponse):
        answer["trace"] = reply.trace_path
    return answer


def add_profile_routes(app: FastAPI, pools: Sequence[WorkerPool]) -> None:
    async def start_profile(request: Request) -> JSONResponse:
        body = await optional_body(request, StartProfileRequest)
        asked = profile_pb2.StartProfileRequest(record_shapes=body.record_shapes, with_stack=body.with_stack)
        return JSONResponse({"workers": await _on_each(pools, lambda stub: stub.Start(asked,
                                                                                       timeout=PROFILE_TIMEOUT_S))})

    async def stop_profile(_: Request) -> JSONResponse:
        return JSONResponse({"workers": await _on_each(pools, lambda stub: stub.Stop(
            profile_pb2.StopProfileRequest(), timeout=PROFILE_TIMEOUT_S))})

    app.add_route("/start_profile", start_profile, methods=["POST"])
    app.add_route("/stop_profile", stop_profile, methods=["POST"])
