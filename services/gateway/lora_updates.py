"""vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (and SGLang's, without /v1), over the
mesh (served with --allow-runtime-lora-updating, off by default as in vLLM: whoever may call them
loads files from the workers' hosts into their engines).

A load goes to every serving prefill and decode worker (their LoRAAdapters service); the gateway names
the adapter (`/v1/models`, requests' `model`) only once every one of them serves it, and where any one
fails, those that loaded it unload it again. An unload stops the gateway naming the adapter first, then
goes to every worker, whose requests using it finish with it. A worker that joins later (a replica
added, or one restarted) is given the adapters loaded at run time before the gateway routes to it
(WorkerPool.before_serving); one that cannot load them stays out of routing, and is tried again.
Loading one again with the same path is accepted.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict

from protos import lora_pb2, lora_pb2_grpc
from services.gateway.errors import APIError
from services.gateway.http_body import parsed_body
from services.gateway.served_models import ServedModels
from services.gateway.workers import Worker, WorkerPool

# What a worker's refusal is to the caller: its input was wrong (400), or the mesh is (500, 503).
STATUS_OF_CODE = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.ALREADY_EXISTS: 400,
                  grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 503}


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str


class LoRAUpdates:
    """Loads and unloads adapters on `pools`' workers, and names them in `models`, one update at a time
    (a load and an unload of a name must not interleave)."""

    def __init__(self, models: ServedModels, pools: Sequence[WorkerPool], deadline_s: float = 120.0) -> None:
        self.models = models
        self.pools = pools
        self.deadline_s = deadline_s
        self.loaded: dict[str, str] = {}  # name → path of the adapters loaded here, at run time
        self._lock = asyncio.Lock()
        for pool in pools:
            pool.before_serving(self.bring_up_to_date)

    async def load(self, name: str, path: str) -> str:
        if not name or not path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        async with self._lock:
            if name in self.models.names:
                raise APIError(400, f"{name!r} names the model itself, not an adapter", param="lora_name")
            served = self.models.adapters.get(name)
            if served is not None and served != path:
                raise APIError(400, f"The lora adapter '{name}' has already been loaded (from {served}).",
                               param="lora_name")
            workers = self._serving_workers()
            request = lora_pb2.LoadLoRAAdapterRequest(request_id=f"load-{name}", lora_name=name, path=path)
            results = await self._on_each(workers, lambda stub: stub.Load(request, timeout=self.deadline_s))
            failed = [(w, r) for w, r in zip(workers, results) if isinstance(r, BaseException)]
            if failed:
                if served is None:  # served by none rather than by some
                    newly = [w for w, r in zip(workers, results)
                             if not isinstance(r, BaseException) and not r.was_loaded]
                    await self._unload_from(newly, name)
                raise _refusal("load", name, failed)
            self.models.adapters[name] = path
            self.loaded[name] = path
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str) -> str:
        async with self._lock:
            if not self.models.serves_adapter(name):
                raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                               code="lora_adapter_not_found")
            del self.models.adapters[name]  # first: no request names it from here on
            self.loaded.pop(name, None)
            workers = self._serving_workers()
            results = await self._unload_from(workers, name)
            failed = [(w, r) for w, r in zip(workers, results) if isinstance(r, BaseException)
                      and not (isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.NOT_FOUND)]
            if failed:
                raise _refusal("unload", name, failed)
        return f"Success: LoRA adapter '{name}' removed successfully."

    async def bring_up_to_date(self, worker: Worker) -> None:
        """Load the adapters loaded at run time onto `worker`, which was away when they were; raises
        where it cannot."""
        async with self._lock:
            stub = lora_pb2_grpc.LoRAAdaptersStub(worker.channel)
            for name, path in self.loaded.items():
                await stub.Load(lora_pb2.LoadLoRAAdapterRequest(request_id=f"load-{name}", lora_name=name, path=path),
                                timeout=self.deadline_s)

    def _serving_workers(self) -> list[Worker]:
        workers = [worker for pool in self.pools for worker in pool.workers if worker.is_serving]
        if not workers:
            raise APIError(503, "no worker is serving to load or unload an adapter on", code="unavailable")
        return workers

    async def _unload_from(self, workers: Sequence[Worker], name: str) -> list:
        request = lora_pb2.UnloadLoRAAdapterRequest(request_id=f"unload-{name}", lora_name=name)
        return await self._on_each(workers, lambda stub: stub.Unload(request, timeout=self.deadline_s))

    @staticmethod
    async def _on_each(workers: Sequence[Worker], call) -> list:
        """`call(stub)` on every worker at once: each one's response, or the error it failed with."""
        return await asyncio.gather(*(call(lora_pb2_grpc.LoRAAdaptersStub(w.channel)) for w in workers),
                                    return_exceptions=True)


def _refusal(verb: str, name: str, failed: list[tuple[Worker, BaseException]]) -> APIError:
    """The error a failed update answers with: the first worker's, its status as its code says."""
    worker, error = failed[0]
    if isinstance(error, grpc.aio.AioRpcError):
        status, detail = STATUS_OF_CODE.get(error.code(), 500), f"{error.code().name}: {error.details()}"
    else:
        status, detail = 500, f"{type(error).__name__}: {error}"
    others = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
    return APIError(status, f"could not {verb} LoRA adapter '{name}' on {worker.address}{others}: {detail}",
                    param="lora_path" if status == 400 and verb == "load" else "lora_name")


def add_lora_update_routes(app: FastAPI, updates: LoRAUpdates) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter, answered in plain text as vLLM does;
    SGLang's /load_lora_adapter and /unload_lora_adapter, answered as SGLang does: `{"success",
    "error_message", "loaded_adapters"}` (every adapter served, name → path), a failure with its
    status (400, 404 or 503)."""

    async def in_sglangs_shape(update: Awaitable[str]) -> JSONResponse:
        try:
            await update
        except APIError as e:
            return JSONResponse({"success": False, "error_message": e.message,
                                 "loaded_adapters": dict(updates.models.adapters)}, status_code=e.status)
        return JSONResponse({"success": True, "error_message": "", "loaded_adapters": dict(updates.models.adapters)})

    @app.post("/load_lora_adapter")
    async def sglang_load_lora_adapter(request: Request) -> JSONResponse:
        body = await parsed_body(request, LoadLoRAAdapterRequest)
        return await in_sglangs_shape(updates.load(body.lora_name, body.lora_path))

    @app.post("/unload_lora_adapter")
    async def sglang_unload_lora_adapter(request: Request) -> JSONResponse:
        body = await parsed_body(request, UnloadLoRAAdapterRequest)
        return await in_sglangs_shape(updates.unload(body.lora_name))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = await parsed_body(request, LoadLoRAAdapterRequest)
        return PlainTextResponse(await updates.load(body.lora_name, body.lora_path))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = await parsed_body(request, UnloadLoRAAdapterRequest)
        return PlainTextResponse(await updates.unload(body.lora_name))
