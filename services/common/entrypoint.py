"""The one way a Baton service process runs: `python -m services.<name>` calls `run_service`.

Binds first and prints `<name> listening on HOST:PORT` (the line `baton up` reads);
a worker whose config has `metrics_port` (not -1) then serves Prometheus' /metrics there
and prints `<name> metrics on HOST:PORT`. Then it starts the service (loads its model,
warms up) while health reports NOT_SERVING, then SERVING. SIGTERM or SIGINT: health
turns NOT_SERVING, in-flight calls get a grace period, the service releases what it
holds, exit code 0. A bad setting, an address that cannot be bound or an unloadable
model exits 2 with one line on stderr. A service that can no longer serve (a worker whose
engine failed) stops the same way, with exit code 1 (`Stop.fail`): `baton up` then stops
the mesh, an orchestrator restarts the process.

Tracing (services/common/tracing.py) is set up before the server is built, from the
config's `otlp_endpoint` (`--otlp-endpoint`) or the standard `OTEL_*` variables; start-up
is one `boot` span (the service's own phases beneath it), and batched spans are flushed at exit.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import gc
import io
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from services.common.addresses import advertised_address, instance_id
from services.common.grpc_server import AddServicer, HealthServicer, make_server, set_serving, stop_server
from services.common.keepalive import keepalive_seconds
from services.common.metrics import ServiceMetrics
from services.common.settings import ConfigError
from services.common.tracing import BATON_INSTANCE_ID, setup_tracing, shutdown_tracing, tracer

T = TypeVar("T")
C = TypeVar("C", bound="ServiceConfig")

# Beyond the grace period, how long closing may take before it reports what it still waits on.
SLOW_CLOSE_S = 5.0


class ServiceConfig(Protocol):
    """What the entry point reads from a service's config dataclass. Read too when present:
    `metrics_port` (-1: none; absent: the service serves its metrics itself, as the gateway
    on its HTTP port), `instance_id` and `served_model_name` (the metrics' labels), and
    `otlp_endpoint` (tracing.py; "" or absent: as the OTEL_* variables say)."""
    model_dir: Path | None  # None: the service loads no model (kvstore)
    host: str
    max_message_bytes: int
    grace_s: float

    @property
    def address(self) -> str: ...


class Stop(asyncio.Event):
    """Set to stop the process: by SIGTERM or SIGINT (exit code 0), or by `fail` (exit code 1)."""

    exit_code = 0

    def fail(self, name: str, reason: str) -> None:
        logging.getLogger(f"baton.{name}").error("stopping: %s", reason)
        self.exit_code = 1
        self.set()


class Service(Protocol):
    """A service's own part of the process: its servicers, start-up and shutdown."""
    servicers: Sequence[tuple[AddServicer, Any]]  # registered on the server before it binds
    service_names: Sequence[str]  # what health and reflection report
    port: int  # set by the entry point once the server is bound, before `start`
    metrics: ServiceMetrics  # set by the entry point once the server is bound, before `start`

    async def start(self, stop: Stop) -> str | None:
        """Load and warm up while health is NOT_SERVING. Return the line to log once SERVING,
        or None when `stop` came first (exit 0 without serving). Raise ModelLoadError when
        the model cannot be loaded (exit 2)."""

    async def close(self) -> None:
        """Release what `start` made; runs after the server stopped, whether `start` finished or not."""


class ModelLoadError(Exception):
    """The model cannot be loaded; printed as `<name>: cannot load MODEL_DIR: <message>`."""


class StartError(Exception):
    """The service cannot start for another reason (a second port that cannot be bound);
    printed as `<name>: <message>`, exit 2."""


async def load_in_thread(stop: asyncio.Event, fn: Callable[..., T], /, *args: Any, finish_on_stop: bool = False,
                         thread: concurrent.futures.Executor | None = None, **kwargs: Any) -> T | None:
    """`fn(*args, **kwargs)` in a worker thread (in `thread`: an EngineThread), racing `stop`.

    Returns None when `stop` is set first: the thread finishes loading on its own
    and nothing it makes outlives the process. With `finish_on_stop` the load runs
    to the end all the same and its result is returned, for a caller that must
    release what it made (a shared-memory segment). OSError and ValueError from
    `fn` become ModelLoadError."""
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)  # as asyncio.to_thread
    load = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(thread, call))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([load, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if stop.is_set() and not finish_on_stop:
        load.cancel()
        return None
    try:
        return await load
    except (OSError, ValueError) as e:
        raise ModelLoadError(str(e)) from e


async def serve(name: str, config: C, make_service: Callable[[C], Service]) -> int:
    boot_start_ns = time.time_ns()
    stop = Stop()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    service = make_service(config)  # inside the loop: servicers may make asyncio objects
    health_servicer = HealthServicer()
    try:
        server, port = await make_server(service.servicers, service.service_names, address=config.address,
                                         max_message_bytes=config.max_message_bytes,
                                         health_servicer=health_servicer, is_serving=False)
    except RuntimeError as e:  # the address is taken or cannot be bound
        print(f"{name}: {e}", file=sys.stderr, flush=True)
        return 2
    await server.start()
    print(f"{name} listening on {config.host}:{port}", flush=True)
    metrics = service_metrics(name, config, port)
    try:
        try:
            metrics_port = getattr(config, "metrics_port", -1)
            if metrics_port != -1:
                try:
                    metrics_port = metrics.serve_http(config.host, metrics_port)
                except OSError as e:
                    raise StartError(f"cannot serve metrics on {config.host}:{metrics_port}: {e}") from e
                print(f"{name} metrics on {config.host}:{metrics_port}", flush=True)
            service.port = port
            service.metrics = metrics
            with tracer().start_as_current_span("boot", start_time=boot_start_ns,
                                                attributes={BATON_INSTANCE_ID: metrics.labels["instance"]}):
                serving_line = await service.start(stop)
        except ModelLoadError as e:
            print(f"{name}: cannot load {config.model_dir}: {e}", file=sys.stderr, flush=True)
            return 2
        except StartError as e:
            print(f"{name}: {e}", file=sys.stderr, flush=True)
            return 2
        if serving_line is not None:
            freeze_startup_heap()
            await set_serving(health_servicer, service.service_names, True)
            logging.getLogger(f"baton.{name}").info("%s", serving_line)
            await stop.wait()
        return stop.exit_code
    finally:
        closing_metrics = asyncio.create_task(asyncio.to_thread(metrics.close))  # meanwhile: it polls
        await stop_server(server, health_servicer, grace_s=config.grace_s)
        await close_service(name, service, report_after_s=config.grace_s + SLOW_CLOSE_S)
        await closing_metrics


async def close_service(name: str, service: Service, report_after_s: float) -> None:
    """`service.close()`; one still closing after `report_after_s` logs the stack of every task
    and thread still running, so a shutdown that hangs (until its supervisor kills it) says where."""
    closing = asyncio.ensure_future(service.close())
    done, _ = await asyncio.wait([closing], timeout=report_after_s)
    if not done:
        logging.getLogger(f"baton.{name}").warning("still closing after %.1f s; what runs:\n%s", report_after_s,
                                                   running_stacks(skip=asyncio.current_task()))
    await closing


def running_stacks(skip: asyncio.Task | None = None) -> str:
    """The stacks of this loop's tasks (but `skip`) and of every thread, as text."""
    out = io.StringIO()
    for task in asyncio.all_tasks():
        if task is not skip:
            # Not `task.print_stack`: a frame of a task may have no line number (3.11: None), on which it fails.
            frames = ((frame, frame.f_lineno or frame.f_code.co_firstlineno) for frame in task.get_stack())
            out.write(f"{task!r}:\n{''.join(traceback.StackSummary.extract(frames).format())}")
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        out.write(f"Thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}")
    return out.getvalue()


def freeze_startup_heap() -> None:
    """Move what start-up made out of the collector's sight, as vLLM does once its engine is up.

    A warmed worker holds about 200,000 objects (torch's and protobuf's modules, the model), all
    alive for good, and each full collection walked every one: 190 ms here with the GIL held, a
    stall of every stream the process serves, and again about a second at exit. Frozen, a full
    collection walks only what was made since (0.0 ms right after), and a worker stops in 0.3 s
    instead of 1.3."""
    gc.collect()
    gc.freeze()


def service_metrics(name: str, config: ServiceConfig, port: int) -> ServiceMetrics:
    """Labelled with the served model's name (the model directory's by default), and the
    instance id the instance registry knows it by."""
    instance = instance_id(name, advertised_address(config.host, port), getattr(config, "instance_id", ""))
    return ServiceMetrics(name, model=served_model(config), instance=instance)


def served_model(config: ServiceConfig) -> str:
    return getattr(config, "served_model_name", "") or (config.model_dir.name if config.model_dir else "")


def start_tracing(name: str, config: ServiceConfig) -> bool:
    """`setup_tracing` for this service. Its instance id is the registry's when known before
    binding (--instance-id, or a fixed port), else KIND-HOSTNAME-PID; the `boot` span carries
    the registry's id all the same."""
    configured = getattr(config, "instance_id", "")
    if configured or config.port:
        instance = instance_id(name, advertised_address(config.host, config.port), configured)
    else:
        instance = f"{name}-{socket.gethostname()}-{os.getpid()}"
    return setup_tracing(name, instance=instance, model=served_model(config),
                         endpoint=getattr(config, "otlp_endpoint", "") or None)


def run_service(name: str, config_from_args: Callable[[Sequence[str] | None], C],
                make_service: Callable[[C], Service], argv: Sequence[str] | None = None) -> int:
    """Parse the config from `argv` (ConfigError: one line on stderr, exit 2), build the
    service from it, and serve until SIGTERM or SIGINT; returns the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = config_from_args(argv)
        keepalive_seconds()  # read by every channel and server it makes: a bad one stops it here
    except ConfigError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    start_tracing(name, config)
    try:
        try:
            import uvloop  # optional: faster event loop where installed
        except ImportError:
            return asyncio.run(serve(name, config, make_service))
        return uvloop.run(serve(name, config, make_service))
    finally:
        shutdown_tracing()
