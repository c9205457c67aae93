"""outlines-core index builds run on threads of their own, each waited for up to a deadline.

A regex's index is built before its first token, and how long that takes is known only by doing it:
an automaton that blows up in states (`(a|b)*a(a|b){n}`: doubling with n, 4.4 s at 14 over the demo's
8k tokens) has few positions to count ahead (engine/regex_size.py). A build past its deadline goes on,
the request guided by llguidance meanwhile; later requests of the regex use the index once it is built.
A build cannot be stopped midway, so at most MAX_BUILDS run at once per engine, on daemon threads (one
never ending must not hold up the process's exit); the others wait for a place within their deadline.
"""
from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

MAX_BUILDS = 2


class IndexBuilds:
    """Builds by `build(regex)` (which keeps what it builds), one at a time per regex."""

    def __init__(self, build: Callable[[str], object], max_builds: int = MAX_BUILDS) -> None:
        self._build = build
        self._places = threading.BoundedSemaphore(max_builds)
        self._lock = threading.Lock()
        self._running: dict[str, concurrent.futures.Future] = {}
        self._overdue: set[str] = set()

    def wait(self, regex: str, deadline_s: float) -> bool:
        """True once `regex`'s build is done (its ValueError raised), False when it is not within `deadline_s`
        (it goes on; `is_overdue` says so until it ends)."""
        with self._lock:
            future = self._running.get(regex)
            if future is None:
                future = self._running[regex] = concurrent.futures.Future()
                threading.Thread(target=self._run, args=(regex, future), daemon=True,
                                 name="guide-index-build").start()
        try:
            future.result(timeout=deadline_s)
        except concurrent.futures.TimeoutError:
            with self._lock:
                if not future.done():
                    self._overdue.add(regex)
                    return False
            future.result()
        return True

    def is_overdue(self, regex: str) -> bool:
        """Whether `regex`'s build ran past a deadline and has not ended yet."""
        with self._lock:
            return regex in self._overdue

    def _run(self, regex: str, future: concurrent.futures.Future) -> None:
        with self._places:
            try:
                self._build(regex)
            except BaseException as e:
                outcome = e
            else:
                outcome = None
        with self._lock:  # told under the lock: a waiter past its deadline then sees it done, or marks it overdue
            del self._running[regex]
            self._overdue.discard(regex)
            if outcome is None:
                future.set_result(None)
            else:
                future.set_exception(outcome)
