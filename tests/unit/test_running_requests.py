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
    with running.running() as streaming, running.running() as prefilling, running.running():
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
