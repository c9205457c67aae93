"""Waiting in a test for what another process makes true (a worker out of routing, a queue drained)."""
from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], timeout_s: float = 10.0, poll_s: float = 0.02) -> None:
    """Poll `condition` until it is true; fail the test once `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not true within {timeout_s} s"
        time.sleep(poll_s)
