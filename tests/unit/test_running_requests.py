"""The gateway's running requests, as an operator's abort_all ends them: on the decode worker their
stream comes from, at once, or as their stream begins there; each once; none once it is over."""
from __future__ import annotations

from services.gateway.running_requests import RunningRequests
from services.gateway.workers import Worker


def worker(n: int) -> Worker:
    return Worker(f"10.0.0.{n}:50052", channel=None, stub=None)


def test_a_streaming_request_is_aborted_at_once_and_a_prefilling_one_as_its_stream_begins():
    aborted: list[tuple[str, str]] = []
    running = RunningRequests(lambda w, request_id: aborted.append((w.address, request_id)))
    with running.running("a") as streaming, running.running("b") as prefilling, running.running("c"):
        streaming.streams_from(worker(1), "a")
        assert running.abort_all() == 3
        assert aborted == [("10.0.0.1:50052", "a")]
        prefilling.streams_from(worker(2), "b")
        assert aborted[-1] == ("10.0.0.2:50052", "b")
        prefilling.streams_from(worker(3), "b~1")  # moved to another worker: aborted there too
        assert aborted[-1] == ("10.0.0.3:50052", "b~1")
        running.abort_all()  # asked again: each was aborted already
        assert len(aborted) == 3
    assert running.abort_all() == 0  # none is running now


def test_a_request_is_aborted_by_its_id_or_its_samples_by_theirs():
    aborted: list[str] = []
    running = RunningRequests(lambda w, request_id: aborted.append(request_id))
    with running.running("cmpl-1") as one, running.running("cmpl-12"), running.running("cmpl-2-0") as sample0, \
            running.running("cmpl-2-1") as sample1:
        for request, request_id in ((one, "cmpl-1"), (sample0, "cmpl-2-0"), (sample1, "cmpl-2-1")):
            request.streams_from(worker(1), request_id)
        assert running.abort("cmpl-1") == 1 and aborted == ["cmpl-1"]  # not cmpl-12
        assert running.abort("cmpl-2") == 2 and aborted[1:] == ["cmpl-2-0", "cmpl-2-1"]
        assert running.abort("nobody") == 0
