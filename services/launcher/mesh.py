"""The one-host mesh of `baton up`: start order, supervision and shutdown.

Start: a Redis server first (unless one is given, or none is wanted), which takes
milliseconds; then the kvstore node, on a port held for it (held_port.py) so that the
prefill workers are given its address as they start; once the GPUs that workers are placed
on are counted, the other workers of the layout (specs.py: tokenizer, N prefill and M
decode workers, or tokenizer and M colocated workers) at once, since loading is the slow
part; once every one is listening (a worker binds its port before it loads), the gateway
with their addresses, which waits for them to serve before it does; once every process is
SERVING, the banner. The services in REDIS_CLIENTS
get the Redis URL. Supervision: a child that exits, or is not ready within the
start timeout, is reported with its last stderr lines and everything stops with
exit code 1; Redis alone is optional (routing falls back to load only), so a
redis-server that is missing, fails to start or exits is reported and the rest
goes on. SIGINT or SIGTERM: the gateway gets SIGTERM first, then the workers,
then Redis, each SIGKILLed after the stop timeout; exit code 0 (a second signal
SIGKILLs everything at once). Shared-memory segments of decode (and colocated) workers
that could not unlink their own (SIGKILLed) are removed at the end. An API key
(`--api-key`) reaches the gateway in its environment, not on its command line, where
every user of the host could read it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import re
import signal
from pathlib import Path
from typing import TextIO
from urllib.parse import urlsplit

from services.launcher.console import Console, process_table
from services.launcher.environment import child_environment
from services.launcher.gateway_probe import http_model_name
from services.launcher.held_port import HeldPort
from services.launcher.process import ChildFailed, ChildProcess, ChildSpec, describe_exit
from services.launcher.redis_server import RedisProcess, start_optional_redis
from services.launcher.segments import SEGMENT_LINE, mapped_segments, remove_segment
from services.launcher.specs import (
    DECODE_NAME_PREFIXES,
    MeshConfig,
    devices_by_worker,
    gateway_spec,
    kv_events_endpoints,
    kvstore_spec,
    worker_specs,
)

REDIS_START_TIMEOUT_S = 10.0  # it answers PING within milliseconds; bounded by --start-timeout
SERVICES_ROOT = Path(__file__).resolve().parents[2]  # where `python -m services.<name>` resolves
EXIT_FAILED = 1
SEGMENT_LINE_WAIT_S = 2.0  # the segment line follows SERVING at once
# A worker prints where it serves Prometheus' /metrics right after its listening line.
METRICS_LINE = r"^\S+ metrics on (\S+)$"
# Where a GPU driver shows itself, if there is one: NVIDIA's (on the host and in a container given its
# GPUs), WSL 2's GPU paravirtualization, and ROCm's (whose GPUs torch counts as CUDA devices too).
GPU_DRIVER_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg", "/dev/kfd")


def visible_gpu_count() -> int:
    """The CUDA devices torch sees here (as CUDA_VISIBLE_DEVICES leaves them; the count makes no CUDA
    context in the launcher); 0 without a GPU or torch's CUDA build. A host with no GPU driver has none:
    that is answered without importing torch, a second of CPU beside the kvstore node's start."""
    if not any(os.path.exists(path) for path in GPU_DRIVER_PATHS):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class Mesh:
    """Runs the mesh until a signal, a failure or `stop()`; `await run()` returns the exit code.
    `banner_to`: where the banner and the children's stdout lines go (default stdout)."""

    def __init__(self, config: MeshConfig, console: Console | None = None, banner_to: TextIO | None = None):
        self.config = config
        self.console = console or Console(["redis", *(spec.name for spec in worker_specs(config)), "gateway"],
                                          stdout=banner_to)
        self.redis: RedisProcess | None = None  # the one it started
        self.redis_url = config.redis_url  # the one the services are given; None: none
        self.workers: list[ChildProcess] = []  # made once the Redis URL is known
        self.gateway: ChildProcess | None = None
        self.addresses: dict[str, str] = {}  # shown in the table; the gateway's lists both ports
        self.segments: dict[str, str] = {}  # decode worker name → its shared-memory segment
        self._segment_lines: dict[str, asyncio.Future[re.Match[str]]] = {}
        self._metrics_lines: dict[str, asyncio.Future[re.Match[str]]] = {}
        self.metrics_addresses: dict[str, str] = {}  # worker name -> host:port of its /metrics
        self.failure: ChildFailed | None = None
        self.stop_signal: int | None = None
        self.is_stopping = False
        self.up = asyncio.Event()  # set once every service serves
        self.api_url: str | None = None  # the gateway's HTTP API, before its /v1, once up
        self._done = asyncio.Event()

    @property
    def children(self) -> list[ChildProcess]:
        return [*([self.redis] if self.redis else []), *self.workers, *([self.gateway] if self.gateway else [])]

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        startup = asyncio.create_task(self._start())
        startup.add_done_callback(lambda _: self._done.set() if not self.is_up else None)
        try:
            await self._done.wait()
        finally:
            self.is_stopping = True
            startup.cancel()
            await asyncio.gather(startup, return_exceptions=True)
            await self._stop_all()
            self._remove_leftover_segments()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        if not startup.cancelled() and startup.exception() is not None:
            raise startup.exception()  # a bug or an unstartable command (OSError): the CLI reports it
        if self.failure is not None:
            self.console.note(f"stopped because {self.failure}")
            return EXIT_FAILED
        self.console.note("stopped")
        return 0

    async def _start(self) -> None:
        # Counting imports torch in this process where a GPU driver is, a second of CPU: done beside Redis's
        # and the kvstore node's start rather than before them (the workers' devices are the first to need it).
        gpu_count = asyncio.create_task(asyncio.to_thread(visible_gpu_count))
        kvstore_port: HeldPort | None = None
        try:
            if self.config.with_redis and self.config.redis_url is None:
                await self._start_redis()
            deadline = asyncio.get_running_loop().time() + self.config.start_timeout_s
            kvstore_address = None
            if self.config.with_kvstore:
                # Its address is what the prefill workers need: known at once, its port held for it, so they
                # start beside it (its health is waited for with theirs).
                kvstore_port = HeldPort()
                kvstore = self._child(kvstore_spec(self.config, self.redis_url, kvstore_port.port))
                self.workers.append(kvstore)
                self._metrics_lines["kvstore"] = kvstore.expect(METRICS_LINE)
                await kvstore.start()
                self._supervise(kvstore)
                kvstore_address = self.addresses["kvstore"] = kvstore_port.address
            self.config = dataclasses.replace(self.config, num_gpus=await gpu_count)
            # torch's modules, if imported to count, out of the collector's sight as a service's start-up heap is
            # (entrypoint.freeze_startup_heap): walked by every full collection, and at exit half a second of CPU.
            gc.freeze()
            starting = [self._child(spec) for spec in worker_specs(self.config, self.redis_url, kvstore_address)]
            self.workers += starting
            for worker in starting:
                if worker.name.startswith(DECODE_NAME_PREFIXES):
                    self._segment_lines[worker.name] = worker.expect(SEGMENT_LINE, "stderr")
                self._metrics_lines[worker.name] = worker.expect(METRICS_LINE)
                await worker.start()
                self._supervise(worker)
            async with asyncio.TaskGroup() as group:  # the first failure cancels the other waits
                listening = [group.create_task(worker.wait_listening(deadline)) for worker in self.workers]
            self.addresses |= {worker.name: task.result() for worker, task in zip(self.workers, listening, strict=True)}
            if kvstore_port is not None:
                kvstore_port.release()
            if self.config.with_gateway:
                # Started while the workers load: it waits for them to serve before it does, and its own
                # start (a second of imports) no longer follows theirs.
                self.gateway = self._child(gateway_spec(self.config, self.addresses, self.redis_url))
                http_line = self.gateway.expect(r"^gateway (https?) listening on (\S+)$")
                await self.gateway.start()
                self._supervise(self.gateway)
            async with asyncio.TaskGroup() as group:
                for worker in self.workers:
                    group.create_task(worker.wait_ready(deadline))
            self._add_metrics_addresses()
            await self._learn_segments()
            if not self.config.with_gateway:
                self.up.set()
                self.console.print("Baton workers are up (no gateway):")
                self.console.print(self._table())
                self._print_redis_line()
                return
            deadline = asyncio.get_running_loop().time() + self.config.start_timeout_s
            grpc_address = await self.gateway.wait_ready(deadline)
            scheme, http_address = (await self.gateway.wait_for(http_line, "serving HTTP", deadline)).groups()
            model = await self.gateway.wait_for(http_model_name(scheme, http_address, self.config.api_key),
                                                "answering HTTP GET /health", deadline)
            self.addresses["gateway"] = f"{grpc_address} (gRPC), {http_address} (HTTP)"
            self.api_url = f"{scheme}://{http_address}"
            self.up.set()
            keyed = "; API key required" if self.config.api_key else ""
            self.console.print(f"Baton is up: OpenAI API at {scheme}://{http_address}/v1 "
                               f"(model {model or self.config.model_dir.name}{keyed}); gRPC Generate at {grpc_address}")
            self.console.print(self._table())
            self._print_redis_line()
            self.console.print("Stop with Ctrl-C.")
        except* ChildFailed as group:
            self._fail(group.exceptions[0])
        finally:
            gpu_count.cancel()  # when the start failed before the workers
            if kvstore_port is not None:
                kvstore_port.release()

    async def _start_redis(self) -> None:
        self.redis = await start_optional_redis(self.console.note, lambda *line: self.console.forward(*line),
                                                min(REDIS_START_TIMEOUT_S, self.config.start_timeout_s))
        if self.redis is not None:
            self.redis_url = self.addresses["redis"] = self.redis.url
            self.redis.exited.add_done_callback(self._on_redis_exit)

    def _on_redis_exit(self, exited: asyncio.Task[int]) -> None:
        if not self.is_stopping and not exited.cancelled():
            self.console.note(f"redis {describe_exit(exited.result())}; "
                              f"the services go on without it (routing by load only)")

    def _print_redis_line(self) -> None:
        """Where the services find Redis, when it is not a row of the table."""
        if self.redis is not None:
            return
        if self.redis_url is not None:
            self.console.print(f"Redis: {_without_password(self.redis_url)} (given with --redis)")
        else:
            self.console.print("Redis: none (routing by load only)")

    def _add_metrics_addresses(self) -> None:
        """Each worker's /metrics address, shown beside its gRPC one (the gateway serves its
        metrics on its HTTP port)."""
        for name, line in self._metrics_lines.items():
            if line.done() and not line.cancelled():
                self.metrics_addresses[name] = line.result()[1]

    def _table(self) -> str:
        shown = {name: f"{address}, {self.metrics_addresses[name]} (metrics)" if name in self.metrics_addresses
                 else address for name, address in self.addresses.items()}
        for name, endpoints in kv_events_endpoints(self.config).items():
            if name in shown:
                shown[name] += f", {endpoints} (KV events)"
        for name, device in devices_by_worker(self.config).items():
            if name in shown:
                shown[name] += f", on {device}"
        return process_table(self.children, shown)

    async def _learn_segments(self) -> None:
        """Each decode worker's segment, from its log line or else from what it has mapped."""
        lines = self._segment_lines
        if lines:
            await asyncio.wait(lines.values(), timeout=SEGMENT_LINE_WAIT_S)
        for worker in self.workers:
            if worker.name not in lines:
                continue
            line = lines[worker.name]
            names = [line.result()[1]] if line.done() and not line.cancelled() else mapped_segments(worker.pid)
            if names:
                self.segments[worker.name] = names[0]
            else:
                self.console.note(f"cannot tell {worker.name}'s shared-memory segment; "
                                  f"if it is killed, its segment may stay in /dev/shm")

    def _child(self, spec: ChildSpec) -> ChildProcess:
        env = child_environment(self.config, spec.name)
        return ChildProcess(spec, lambda *line: self.console.forward(*line), cwd=str(SERVICES_ROOT), env=env)

    def _supervise(self, child: ChildProcess) -> None:
        def on_exit(exited: asyncio.Task[int]) -> None:
            if not self.is_stopping and not exited.cancelled():
                self._fail(ChildFailed(child, describe_exit(exited.result())))
        child.exited.add_done_callback(on_exit)

    def _fail(self, failure: ChildFailed) -> None:
        if self.failure is not None or self.is_stopping:
            return
        self.failure = failure
        self.is_stopping = True
        self.console.note(f"{failure}; stopping everything")
        if failure.child.tail:
            self.console.note(f"last lines {failure.child.name} wrote to stderr:")
            for line in failure.child.tail:
                self.console.note(f"  {line}")
        self._done.set()

    @property
    def is_up(self) -> bool:
        return self.up.is_set()

    def stop(self) -> None:
        """Stop every process, the gateway first, as a signal does (`run` then returns 0)."""
        self.is_stopping = True
        self._done.set()

    def _on_signal(self, sig: int) -> None:
        if self.stop_signal is not None or self.is_stopping:
            self.console.note(f"{signal.Signals(sig).name} again: killing every process now")
            for child in self.children:
                child.kill()
            return
        self.stop_signal = sig
        self.is_stopping = True
        self.console.note(f"{signal.Signals(sig).name}: stopping every process"
                          + (", the gateway first" if self.gateway is not None else ""))
        self._done.set()

    async def _stop_all(self) -> None:
        timeout_s = self.config.stop_after_s
        if self.gateway is not None:
            await self._stop(self.gateway, timeout_s)
        await asyncio.gather(*(self._stop(worker, timeout_s) for worker in self.workers))
        if self.redis is not None and not self.redis.exited.done():  # last: the services use it as they stop
            await self._stop(self.redis, timeout_s)

    async def _stop(self, child: ChildProcess, timeout_s: float) -> None:
        returncode = await child.stop(timeout_s)
        if child.was_killed:
            self.console.note(f"{child.name} did not stop within {timeout_s:g}s of SIGTERM; killed it")
        elif returncode not in (0, None) and (self.failure is None or child is not self.failure.child):
            self.console.note(f"{child.name} {describe_exit(returncode)}")

    def _remove_leftover_segments(self) -> None:
        """Unlink what a decode worker logged as its segment and could not unlink itself."""
        for name, segment in self.segments.items():
            if remove_segment(segment):
                self.console.note(f"removed shared-memory segment {segment} left by {name}")


def _without_password(url: str) -> str:
    """`url` fit to print: a password in it replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)).geturl()
