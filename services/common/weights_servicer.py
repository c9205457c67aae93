"""The Weights service of a prefill or decode worker (protos/weights.proto): SGLang's
update_weights_from_disk, a trainer's next checkpoint read in place of the served one, between
steps, when no request holds pages. The prefix cache goes with the old weights, and with a prefill
worker's its kvstore node's host tier, as the PrefixCache service (cache_servicer.py) forgets them."""
from __future__ import annotations

import time
from pathlib import Path

import grpc

from protos import weights_pb2, weights_pb2_grpc
from services.common.cache_servicer import PrefixCacheServicer
from services.common.engine_errors import EngineDeadError

SERVICE_NAME = weights_pb2.DESCRIPTOR.services_by_name["Weights"].full_name


class WeightsServicer(weights_pb2_grpc.WeightsServicer):
    """`cache`: the worker's PrefixCache servicer, whose engine and kvstore node it shares."""

    def __init__(self, cache: PrefixCacheServicer) -> None:
        self.cache = cache

    async def UpdateFromDisk(self, request: weights_pb2.UpdateWeightsRequest,
                             context) -> weights_pb2.UpdateWeightsResponse:
        engine_loop = self.cache.engine_loop
        if engine_loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        if not request.model_path or not Path(request.model_path).is_dir():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"model_path {request.model_path!r} is not a directory on this worker's host")
        start = time.perf_counter()
        try:
            forgotten = await engine_loop.call(lambda engine: engine.update_weights(request.model_path))
        except (ValueError, OSError) as e:  # not this model's shape, no checkpoint there, or unreadable
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if forgotten is None:
            return weights_pb2.UpdateWeightsResponse(updated=False)
        seconds = time.perf_counter() - start
        try:
            on_tier = await self.cache.host_tier_reset() if self.cache.host_tier_reset is not None else 0
        except grpc.aio.AioRpcError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the kvstore node did not forget its host tier "
                                                             f"(the weights are updated): {e.details()}")
        return weights_pb2.UpdateWeightsResponse(updated=True, num_blocks=forgotten, num_host_tier_blocks=on_tier,
                                                 seconds=seconds)
