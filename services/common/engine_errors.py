"""What a worker's servicers hear from an engine that has stopped for good: its own module, without torch,
so that a service that only publishes what it holds (a kvstore node) need not import the engine."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop has ended on a failed step: nothing more runs on this engine."""
