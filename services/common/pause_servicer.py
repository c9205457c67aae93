"""The Generation service of a prefill or decode worker (protos/pause.proto): SGLang's pause_generation
in place or in retract mode, and continue_generation. The engine stops stepping between steps and
requests wait where they are; a decode worker's reservations stop running out meanwhile, since the
prefill worker filling them may be paused too."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from protos import pause_pb2, pause_pb2_grpc
from services.common.cache_servicer import PrefixCacheServicer
from services.common.engine_loop import EngineDeadError

if TYPE_CHECKING:
    from services.decode.leases import LeaseTable

SERVICE_NAME = pause_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class GenerationServicer(pause_pb2_grpc.GenerationServicer):
    """`cache`: the worker's PrefixCache servicer, whose engine it shares; `leases`: a decode worker's
    reservations (None until it serves, and on a prefill worker)."""

    def __init__(self, cache: PrefixCacheServicer, leases: Callable[[], LeaseTable | None] = lambda: None) -> None:
        self.cache = cache
        self.leases = leases

    async def Pause(self, request: pause_pb2.PauseRequest, context) -> pause_pb2.PauseResponse:
        if request.mode not in (pause_pb2.PAUSE_MODE_IN_PLACE, pause_pb2.PAUSE_MODE_RETRACT):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "mode must be IN_PLACE or RETRACT")
        engine_loop = await self._ready(context)
        leases = self.leases()
        if leases is not None:
            leases.hold()
        try:
            num_running = await engine_loop.pause(retract=request.mode == pause_pb2.PAUSE_MODE_RETRACT)
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return pause_pb2.PauseResponse(num_running=num_running)

    async def Resume(self, request: pause_pb2.ResumeRequest, context) -> pause_pb2.ResumeResponse:
        engine_loop = await self._ready(context)
        try:
            await engine_loop.resume()
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        leases = self.leases()
        if leases is not None and leases.is_held:
            leases.release()
        return pause_pb2.ResumeResponse()

    async def _ready(self, context):
        if self.cache.engine_loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        return self.cache.engine_loop
