"""The Profiler service of a prefill or decode worker (protos/profile.proto): torch's profiler
over the engine's steps between the gateway's /start_profile and /stop_profile, as vLLM's and
SGLang's, its trace written into the worker's --profiler-dir in Chrome's trace format (Perfetto,
chrome://tracing). It starts and stops on the engine's thread, which runs every step; the trace
is written off it."""
from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import grpc
import torch

from protos import profile_pb2, profile_pb2_grpc
from services.common.cache_servicer import PrefixCacheServicer
from services.common.engine_errors import EngineDeadError

SERVICE_NAME = profile_pb2.DESCRIPTOR.services_by_name["Profiler"].full_name


class ProfilerServicer(profile_pb2_grpc.ProfilerServicer):
    """`cache`: the worker's PrefixCache servicer, whose engine it shares; `trace_dir`: its --profiler-dir
    ("": refused); `kind`: prefill or decode, which its traces are named after with its host and pid."""

    def __init__(self, cache: PrefixCacheServicer, trace_dir: str, kind: str) -> None:
        self.cache = cache
        self.trace_dir = trace_dir
        self.name = f"{kind}-{socket.gethostname()}-{os.getpid()}"
        self._profile: torch.profiler.profile | None = None

    async def Start(self, request: profile_pb2.StartProfileRequest, context) -> profile_pb2.StartProfileResponse:
        engine_loop = await self._ready(context)
        if self._profile is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the profiler is recording already")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities, record_shapes=request.record_shapes,
                                         with_stack=request.with_stack)
        self._profile = profile
        try:
            await engine_loop.call(lambda engine: profile.start())
        except EngineDeadError as e:
            self._profile = None
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return profile_pb2.StartProfileResponse()

    async def Stop(self, request: profile_pb2.StopProfileRequest, context) -> profile_pb2.StopProfileResponse:
        engine_loop = await self._ready(context)
        profile, self._profile = self._profile, None
        if profile is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the profiler is not recording")
        try:
            await engine_loop.call(lambda engine: profile.stop())
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        path = Path(self.trace_dir) / f"{self.name}-{time.time_ns()}.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(profile.export_chrome_trace, str(path))
        except OSError as e:
            await context.abort(grpc.StatusCode.INTERNAL, f"the trace could not be written to {path}: {e}")
        return profile_pb2.StopProfileResponse(trace_path=str(path))

    async def _ready(self, context):
        if not self.trace_dir:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "profiling is off: start the worker with --profiler-dir DIR ($BATON_PROFILER_DIR)")
        if self.cache.engine_loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        return self.cache.engine_loop
