"""The scheduling policy (fcfs or priority): where a sequence goes in the scheduler's waiting and
running queues. The scheduler gives its budget and admits from the front of each queue and
preempts from the back of the running one, so a queue's order is the policy."""
from __future__ import annotations

import bisect
from collections import deque

from engine.sequence import Sequence


class FcfsPolicy:
    """Arrival order: a new sequence waits last, one admitted runs last, and one preempted waits
    first: it is recomputed before anything new is admitted."""

    is_by_priority = False

    @staticmethod
    def wait(waiting: deque[Sequence], seq: Sequence) -> None:
        waiting.append(seq)

    @staticmethod
    def wait_again(waiting: deque[Sequence], seq: Sequence) -> None:
        waiting.appendleft(seq)

    @staticmethod
    def run(running: list[Sequence], seq: Sequence) -> None:
        running.append(seq)


class PriorityPolicy:
    """(priority, arrival) order in both queues: the most urgent is given the budget and admitted
    first, the least urgent running one is preempted first."""

    is_by_priority = True

    @staticmethod
    def wait(waiting: deque[Sequence], seq: Sequence) -> None:
        bisect.insort(waiting, seq, key=urgency)

    wait_again = wait

    @staticmethod
    def run(running: list[Sequence], seq: Sequence) -> None:
        bisect.insort(running, seq, key=urgency)


def scheduling_policy(name: str) -> type[FcfsPolicy] | type[PriorityPolicy]:
    """The policy `name` names; EngineConfig allows "fcfs" and "priority" alone."""
    return PriorityPolicy if name == "priority" else FcfsPolicy


def urgency(seq: Sequence) -> tuple[int, float]:
    """The priority policy's order: lower priority values first, then earlier arrivals."""
    return seq.sampling_params.priority, seq.arrival_time
