"""The gateway's running requests, as an operator's abort_all ends them: on the decode worker their
stream comes from, at once, or as their stream begins there; each once; none once it is over. One
waiting at the gateway's pause is ended by its id, but left waiting by an abort of all."""
from __future__ import annotations

import asyncio

from services.gateway.running_requests import RunningRequests
from services.gateway.workers import Worker


def worker(n: int) -> Worker:
    return Worker(f"10.0.0.{n}:50052", channel=None, stub=None)


def test_a_streaming_request_is_aborted_at_once_and_a_prefilling_one_as_its_stream_begins():
    aborted: list[tuple[str, str]] = []
    running = RunningRequests(lambda w, request_id: aborted.append((w.address, request_id)))
    with running.running("a") as streaming, running.running("b") as prefilling, running.running("c"):
        streaming.streams_from(worker(1), "a")
        assert running.abort_all() == ["a", "b", "c"]
        assert aborted == [("10.0.0.1:50052", "a")]
        prefilling.streams_from(worker(2), "b")
        assert aborted[-1] == ("10.0.0.2:50052", "b")
        prefilling.streams_from(worker(3), "b~1")  # moved to another worker: aborted there too
        assert aborted[-1] == ("10.0.0.3:50052", "b~1")
        running.abort_all()  # asked again: each was aborted already
        assert len(aborted) == 3
    assert running.abort_all() == []  # none is running now


def test_a_request_is_aborted_by_its_id_or_its_samples_by_theirs():
    aborted: list[str] = []
    running = RunningRequests(lambda w, request_id: aborted.append(request_id))
    with running.running("cmpl-1") as one, running.running("cmpl-12"), running.running("cmpl-2-0") as sample0, \
            running.running("cmpl-2-1") as sample1:
        for request, request_id in ((one, "cmpl-1"), (sample0, "cmpl-2-0"), (sample1, "cmpl-2-1")):
            request.streams_from(worker(1), request_id)
        assert running.abort("cmpl-1") == ["cmpl-1"] and aborted == ["cmpl-1"]  # not cmpl-12
        assert running.abort("cmpl-2") == ["cmpl-2-0", "cmpl-2-1"] and aborted[1:] == ["cmpl-2-0", "cmpl-2-1"]
        assert running.abort("nobody") == []


def test_one_waiting_at_the_pause_is_aborted_by_its_id_but_not_with_all():
    async def scenario() -> tuple[int, int, bool, bool]:
        running = RunningRequests(lambda w, request_id: None)
        pause = asyncio.get_running_loop().create_future()  # stands for the end of the gateway's pause
        with running.running("held") as held, running.running("tokenizing") as tokenizing:
            held.is_held = True
            held.waits_on(pause)
            by_all = len(running.abort_all())
            still_waiting = not pause.done()
            by_id = len(running.abort("held"))
            return by_all, by_id, still_waiting and pause.cancelled(), tokenizing.is_aborted
    assert asyncio.run(scenario()) == (1, 1, True, True)


def test_what_it_waits_on_after_an_abort_is_cancelled_at_once():
    async def scenario() -> bool:
        running = RunningRequests(lambda w, request_id: None)
        with running.running("late") as late:
            late.abort()
            call = asyncio.get_running_loop().create_future()  # stands for the first token's call
            late.waits_on(call)
            return call.cancelled()
    assert asyncio.run(scenario())
