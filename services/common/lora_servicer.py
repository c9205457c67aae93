"""The LoRAAdapters service of a prefill or decode worker (protos/lora.proto): LoRA adapters loaded
into its engine and unloaded while it runs, when it was started with --allow-runtime-lora-updating.
The adapter's files are read on a thread of their own; only adding it to (or taking it from) what the
engine serves waits for a step to end."""
from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from engine.lora import LoRAError
from engine.lora_manager import LoRAConflictError
from protos import lora_pb2, lora_pb2_grpc
from services.common.engine_loop import EngineLoop

SERVICE_NAME = lora_pb2.DESCRIPTOR.services_by_name["LoRAAdapters"].full_name


class LoRAAdaptersServicer(lora_pb2_grpc.LoRAAdaptersServicer):
    def __init__(self, is_allowed: bool) -> None:
        self.is_allowed = is_allowed
        self.engine_loop: EngineLoop | None = None  # once the engine is loaded

    async def Load(self, request: lora_pb2.LoadLoRAAdapterRequest, context) -> lora_pb2.LoadLoRAAdapterResponse:
        engine_loop = await self._engine_loop(context, request.lora_name)
        if not request.path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "path is required")
        name, path = request.lora_name, Path(request.path)
        if await self._is_loaded_from(engine_loop, name, path):
            return lora_pb2.LoadLoRAAdapterResponse(was_loaded=True)
        try:
            adapter = await asyncio.to_thread(engine_loop.engine.loras.read, name, path)
        except LoRAError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            await engine_loop.call(lambda engine: engine.loras.add(adapter))
        except LoRAConflictError as e:
            if await self._is_loaded_from(engine_loop, name, path):  # another call loaded it meanwhile
                return lora_pb2.LoadLoRAAdapterResponse(was_loaded=True)
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        return lora_pb2.LoadLoRAAdapterResponse(was_loaded=False)

    async def Unload(self, request: lora_pb2.UnloadLoRAAdapterRequest,
                     context) -> lora_pb2.UnloadLoRAAdapterResponse:
        engine_loop = await self._engine_loop(context, request.lora_name)
        name = request.lora_name
        if not await engine_loop.call(lambda engine: engine.loras.remove(name, engine.is_adapter_in_use)):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {name!r} is not served here")
        return lora_pb2.UnloadLoRAAdapterResponse()

    async def _engine_loop(self, context, name: str) -> EngineLoop:
        if not self.is_allowed:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this worker loads no LoRA adapter at run time: start it with "
                                "--allow-runtime-lora-updating (or BATON_ALLOW_RUNTIME_LORA_UPDATING=1)")
        if not name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_name is required")
        if self.engine_loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        return self.engine_loop

    @staticmethod
    async def _is_loaded_from(engine_loop: EngineLoop, name: str, path: Path) -> bool:
        served = await engine_loop.call(lambda engine: engine.loras.path_of(name))
        return served is not None and served.resolve() == path.resolve()
