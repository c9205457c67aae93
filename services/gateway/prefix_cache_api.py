"""vLLM's `POST /reset_prefix_cache` (SGLang's `/flush_cache`): every prefill and decode worker's
prefix cache forgotten, for a cold start of what comes next (a benchmark's run). A worker forgets
its cache only when no request holds its pages, as vLLM's and SGLang's do: one that holds some
refuses, the others having reset, and the answer is a 409 naming it (send it again once the mesh
is idle). Each prefill worker has its kvstore node forget its host-memory tier too (that node's
blocks count in the worker's `num_host_tier_blocks`). The hashes leave the Redis prefix index with
the next publish."""
from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from protos import cache_pb2, cache_pb2_grpc
from services.gateway.errors import APIError
from services.gateway.workers import Worker, WorkerPool, serving_workers

RESET_TIMEOUT_S = 10.0


async def reset_prefix_caches(pools: Sequence[WorkerPool]) -> list[dict]:
    """Each serving worker's answer: its kind, address, whether it reset, and the blocks it forgot (one
    not serving is left out: its health watch finds it down or not yet up)."""
    workers = serving_workers(pools)
    return list(await asyncio.gather(*(_reset(kind, worker) for kind, worker in workers)))


async def _reset(kind: str, worker: Worker) -> dict:
    try:
        reply = await cache_pb2_grpc.PrefixCacheStub(worker.channel).Reset(cache_pb2.ResetPrefixCacheRequest(),
                                                                            timeout=RESET_TIMEOUT_S)
    except grpc.aio.AioRpcError as e:
        raise APIError(503, f"{kind} worker {worker.address} did not reset its prefix cache: {e.code().name}: "
                            f"{e.details()}", code="unavailable") from None
    return {"kind": kind, "address": worker.address, "reset": reply.reset, "num_blocks": reply.num_blocks,
            "num_host_tier_blocks": reply.num_host_tier_blocks}


def add_prefix_cache_routes(app: FastAPI, pools: Sequence[WorkerPool]) -> None:
    async def reset(_: Request) -> JSONResponse:
        workers = await reset_prefix_caches(pools)
        busy = [f"{w['kind']} {w['address']}" for w in workers if not w["reset"]]
        if busy:
            raise APIError(409, f"Prefix caches not reset on {', '.join(busy)}: requests hold their pages (the "
                                f"others reset). Reset once they are done.", code="workers_busy")
        return JSONResponse({"reset": True, "workers": workers})

    for path in ("/reset_prefix_cache", "/flush_cache"):
        app.add_route(path, reset, methods=["POST"])
