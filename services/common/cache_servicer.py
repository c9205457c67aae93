"""The PrefixCache service of a prefill or decode worker (protos/cache.proto): every cached block
forgotten at an operator's word (the gateway's `/reset_prefix_cache`), between steps, when no request
holds pages. The hashes it forgets leave the Redis prefix index with its next publish, as evicted ones do."""
from __future__ import annotations

import grpc

from protos import cache_pb2, cache_pb2_grpc
from services.common.engine_loop import EngineDeadError, EngineLoop

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["PrefixCache"].full_name


class PrefixCacheServicer(cache_pb2_grpc.PrefixCacheServicer):
    def __init__(self) -> None:
        self.engine_loop: EngineLoop | None = None  # once the engine is loaded and warm

    async def Reset(self, request: cache_pb2.ResetPrefixCacheRequest, context) -> cache_pb2.ResetPrefixCacheResponse:
        engine_loop = self.engine_loop
        if engine_loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        try:
            forgotten = await engine_loop.call(lambda engine: engine.reset_prefix_cache())
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return cache_pb2.ResetPrefixCacheResponse(reset=forgotten is not None, num_blocks=forgotten or 0)
