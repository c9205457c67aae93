"""`serve`: a service that can no longer serve stops the process as a signal does, but exits 1;
what a service made while starting is frozen out of the collector's sight once it serves; a close
that takes long logs what it waits on."""
from __future__ import annotations

import asyncio
import gc
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.common import entrypoint
from services.common.entrypoint import serve
from services.common.limits import DEFAULT_MAX_MESSAGE_BYTES


@pytest.fixture(autouse=True)
def unfrozen():
    """`serve` freezes this test process's heap: the rest of the session collects as before."""
    gc.unfreeze()
    yield
    gc.unfreeze()


@dataclass
class Config:
    model_dir: Path | None = None
    host: str = "127.0.0.1"
    port: int = 0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_s: float = 1.0
    metrics_port: int = -1

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class BreaksAfterServing:
    """Serves, then fails as a worker does when its engine fails (`Stop.fail`)."""
    servicers = ()
    service_names = ()

    def __init__(self, config: Config) -> None:
        self.is_closed = False
        self.failed_while_serving = False

    async def start(self, stop) -> str:
        asyncio.get_running_loop().call_later(0.2, self._break, stop)
        return "serving"

    def _break(self, stop) -> None:
        self.failed_while_serving = not stop.is_set()
        stop.fail("test", "its engine failed")

    async def close(self) -> None:
        self.is_closed = True


def test_a_service_that_fails_while_serving_stops_gracefully_with_exit_code_1(caplog):
    made: list[BreaksAfterServing] = []

    def make(config: Config) -> BreaksAfterServing:
        made.append(BreaksAfterServing(config))
        return made[-1]

    assert asyncio.run(asyncio.wait_for(serve("test", Config(), make), 30)) == 1
    assert made[0].failed_while_serving and made[0].is_closed
    assert any("stopping: its engine failed" in r.getMessage() for r in caplog.records)


class StopsOnceServing:
    """Holds what it made while starting (a stand-in for a model) and looks at the collector once serving."""
    servicers = ()
    service_names = ()

    def __init__(self, config: Config) -> None:
        self.model: list[dict] = []
        self.frozen_while_serving = 0

    async def start(self, stop) -> str:
        self.model = [{"layer": i} for i in range(1000)]
        asyncio.get_running_loop().call_later(0.1, self._look, stop)
        return "serving"

    def _look(self, stop) -> None:
        self.frozen_while_serving = gc.get_freeze_count()
        stop.set()

    async def close(self) -> None:
        pass


def test_what_start_up_made_is_frozen_once_serving():
    made: list[StopsOnceServing] = []

    def make(config: Config) -> StopsOnceServing:
        made.append(StopsOnceServing(config))
        return made[-1]

    assert gc.get_freeze_count() == 0
    assert asyncio.run(asyncio.wait_for(serve("test", Config(), make), 30)) == 0
    assert made[0].frozen_while_serving >= len(made[0].model)


class ClosesSlowly:
    """Serves, is stopped, and takes a second to close, in a coroutine named for the test to find."""
    servicers = ()
    service_names = ()

    def __init__(self, config: Config) -> None:
        self.is_closed = False

    async def start(self, stop) -> str:
        asyncio.get_running_loop().call_later(0.1, stop.set)
        return "serving"

    async def close(self) -> None:
        await asyncio.gather(self._flush_the_last_spans())
        self.is_closed = True

    async def _flush_the_last_spans(self) -> None:
        await asyncio.sleep(1.0)


def test_a_slow_close_logs_where_it_waits_and_still_finishes(monkeypatch, caplog):
    monkeypatch.setattr(entrypoint, "SLOW_CLOSE_S", 0.2 - Config.grace_s)  # report after 0.2 s
    made: list[ClosesSlowly] = []

    def make(config: Config) -> ClosesSlowly:
        made.append(ClosesSlowly(config))
        return made[-1]

    assert asyncio.run(asyncio.wait_for(serve("test", Config(), make), 30)) == 0
    assert made[0].is_closed
    [report] = [r.getMessage() for r in caplog.records if "still closing after" in r.getMessage()]
    assert "_flush_the_last_spans" in report and "Thread MainThread" in report


def test_the_stacks_logged_include_grpcs_own_tasks_whose_frames_have_no_line_number():
    """grpc.aio's tasks run Cython coroutines whose frames give no line number (None), on which
    `Task.print_stack` fails (a gateway hanging at shutdown then crashed instead of saying where)."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    async def stacks_during_a_call() -> str:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
                await call.read()  # the call's status is awaited in a task of grpc's own meanwhile
                stacks = entrypoint.running_stacks(skip=asyncio.current_task())
                call.cancel()
        finally:
            await server.stop(None)
        return stacks

    assert "_handle_status_once_received" in asyncio.run(stacks_during_a_call())
