"""The Scheduler service of a prefill or decode worker (protos/scheduler.proto): SGLang's
pause_generation in place or in retract mode and continue_generation, its release and
resume_memory_occupation (vLLM's sleep and wake_up), and what its get_server_info reports of a
scheduler. Paused, the engine stops stepping between steps and requests wait where they
are; a decode worker's reservations stop running out meanwhile, since the prefill worker filling them
may be paused too."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from engine.llm_engine import LLMEngine
from engine.memory_release import MemoryBusyError
from protos import scheduler_pb2, scheduler_pb2_grpc
from services.common.cache_servicer import PrefixCacheServicer
from services.common.converters import MEMORY_KINDS
from services.common.engine_errors import EngineDeadError

if TYPE_CHECKING:
    from services.decode.leases import LeaseTable

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """`cache`: the worker's PrefixCache servicer, whose engine it shares; `leases`: a decode worker's
    reservations (None until it serves, and on a prefill worker)."""

    def __init__(self, cache: PrefixCacheServicer, leases: Callable[[], LeaseTable | None] = lambda: None) -> None:
        self.cache = cache
        self.leases = leases

    async def Pause(self, request: scheduler_pb2.PauseRequest, context) -> scheduler_pb2.PauseResponse:
        if request.mode not in (scheduler_pb2.PAUSE_MODE_IN_PLACE, scheduler_pb2.PAUSE_MODE_RETRACT):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "mode must be IN_PLACE or RETRACT")
        engine_loop = await self._ready(context)
        leases = self.leases()
        if leases is not None:
            leases.hold()
        try:
            num_running = await engine_loop.pause(retract=request.mode == scheduler_pb2.PAUSE_MODE_RETRACT)
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return scheduler_pb2.PauseResponse(num_running=num_running)

    async def Resume(self, request: scheduler_pb2.ResumeRequest, context) -> scheduler_pb2.ResumeResponse:
        engine_loop = await self._ready(context)
        try:
            await engine_loop.resume()
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        leases = self.leases()
        if leases is not None and leases.is_held:
            leases.release()
        return scheduler_pb2.ResumeResponse()

    async def ReleaseMemory(self, request: scheduler_pb2.MemoryRequest, context) -> scheduler_pb2.ReleaseMemoryResponse:
        kinds = await _memory_kinds(request, context)
        engine_loop = await self._ready(context)
        try:
            released = await engine_loop.release_memory(kinds)
        except MemoryBusyError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"nothing released: {e}")
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return scheduler_pb2.ReleaseMemoryResponse(bytes_released=released)

    async def ResumeMemory(self, request: scheduler_pb2.MemoryRequest, context) -> scheduler_pb2.ResumeMemoryResponse:
        kinds = await _memory_kinds(request, context)
        engine_loop = await self._ready(context)
        try:
            await engine_loop.resume_memory(kinds)
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return scheduler_pb2.ResumeMemoryResponse()

    async def Describe(self, request: scheduler_pb2.DescribeRequest, context) -> scheduler_pb2.SchedulerInfo:
        engine_loop = await self._ready(context)
        try:
            info = await engine_loop.call(describe)
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        info.is_paused = engine_loop.is_paused
        return info

    async def _ready(self, context):
        if self.cache.engine_loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        return self.cache.engine_loop


async def _memory_kinds(request: scheduler_pb2.MemoryRequest, context) -> list[str]:
    if any(kind not in MEMORY_KINDS for kind in request.kinds):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "kinds must be WEIGHTS or KV_CACHE")
    return [MEMORY_KINDS[kind] for kind in request.kinds] or list(MEMORY_KINDS.values())


def describe(engine: LLMEngine) -> scheduler_pb2.SchedulerInfo:
    """Read on the engine's thread, between steps."""
    config, scheduler = engine.config, engine.scheduler
    return scheduler_pb2.SchedulerInfo(
        model=config.model, dtype=config.dtype, kv_cache_dtype=config.kv_cache_dtype, block_size=config.block_size,
        num_kv_blocks=engine.num_kv_blocks, num_free_blocks=engine.block_manager.num_free_blocks,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=engine.max_model_len, scheduling_policy=config.scheduling_policy,
        enable_prefix_caching=config.enable_prefix_caching, num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting), num_preemptions=scheduler.num_preemptions,
        num_speculative_tokens=config.speculative.num_speculative_tokens if config.speculative else 0,
        speculative_method=config.speculative.method if config.speculative else "",
        num_drafts=scheduler.num_drafts, num_accepted_tokens=scheduler.num_accepted_tokens,
        released_memory=[kind for kind, name in MEMORY_KINDS.items() if name in engine.released_memory])
