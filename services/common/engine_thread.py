"""`EngineThread`: the one thread an engine is built on and then stepped on (engine_loop.py says why
it is one thread)."""
from __future__ import annotations

import concurrent.futures
import queue
import threading


class EngineThread(concurrent.futures.Executor):
    """One thread that runs what is submitted to it, in turn: an engine's build
    (`loop.run_in_executor`), then the EngineLoop given it. A daemon, as the loop's thread
    always was: a process that never stopped its loop still exits."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._jobs.put(None)
        if wait:
            self._thread.join()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args, kwargs = job
            del job
            result = error = None
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as e:
                    error = e
            # Let go of the job before its caller hears it is done, not once the next job comes: the
            # caller may free what the job held then (a decode worker unmaps the shared-memory pool its
            # engine's tensors view, which fails while any of them is alive).
            del fn, args, kwargs
            if error is not None:
                future.set_exception(error)
            elif not future.cancelled():
                future.set_result(result)
            del future, result, error
