"""The PrefixCache service of a prefill or decode worker (protos/cache.proto): every cached block
forgotten at an operator's word (the gateway's `/reset_prefix_cache`), between steps, when no request
holds pages, and with it (`host_tier_reset`, a prefill worker's) what its kvstore node stores. The
hashes it forgets leave the Redis prefix index with its next publish, as evicted ones do."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import grpc

from protos import cache_pb2, cache_pb2_grpc
from services.common.engine_errors import EngineDeadError

if TYPE_CHECKING:  # a kvstore node names this service too, and imports no engine
    from services.common.engine_loop import EngineLoop

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["PrefixCache"].full_name


class PrefixCacheServicer(cache_pb2_grpc.PrefixCacheServicer):
    def __init__(self) -> None:
        self.engine_loop: EngineLoop | None = None  # once the engine is loaded and warm
        self.host_tier_reset: Callable[[], Awaitable[int]] | None = None  # the blocks its kvstore node forgot

    async def Reset(self, request: cache_pb2.ResetPrefixCacheRequest, context) -> cache_pb2.ResetPrefixCacheResponse:
        engine_loop = self.engine_loop
        if engine_loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        try:
            forgotten = await engine_loop.call(lambda engine: engine.reset_prefix_cache())
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if forgotten is None:
            return cache_pb2.ResetPrefixCacheResponse(reset=False)
        try:
            on_tier = await self.host_tier_reset() if self.host_tier_reset is not None else 0
        except grpc.aio.AioRpcError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the kvstore node did not reset: {e.details()}")
        return cache_pb2.ResetPrefixCacheResponse(reset=True, num_blocks=forgotten, num_host_tier_blocks=on_tier)
