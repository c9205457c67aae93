"""The request ledger: where each request's time went, phase by phase, readable in the
response when asked and from `GET /v1/requests/{id}/timeline` afterwards.

A request's time on the gateway's clock is cut into consecutive intervals by marks
(`PhaseClock.mark`); each interval is charged to one phase, so the phases add up to
the end-to-end time exactly. A worker's own figures (prefill's queue, compute and KV
write; decode's queue) subdivide the interval the gateway spent waiting on that call,
and what they do not account for is charged to `rpc`: the network, serialization and
gRPC's own cost. Overlap is charged once, to the phase the gateway was in: decode's
queue runs while the first token is still being handed out, so `decode_queue` is only
the part of it the gateway then waited for.

Phases (milliseconds in the JSON), in the order a request meets them:

- `ingress`: the HTTP request's arrival → the pipeline has it (body read, parsed, checked);
- `tokenize`: the tokenizer service's Encode or ApplyChatTemplate;
- `route`: the context check, choosing the workers (the router's copy of the prefix index,
  or a Redis round trip while it has none);
- `prefill_queue`, `host_tier_read`, `prefill_admit`, `prefill_compute`: as the prefill
  worker reported them: its wait, reading prefix blocks from a kvstore node, its engine
  taking the request in (`add_request`: checks and queueing), and its engine's steps to
  the first token (for a prompt prefilled on the decode worker, its local prefill is
  `prefill_compute` and its wait `decode_queue`);
- `rpc`: the rest of the time spent waiting on prefill's first token (or on a local
  prefill's); for a prefill worker on the gateway's host, `rpc_legs_ms` beside the phases tells
  two parts of it apart, by the worker's monotonic clock and the gateway's: `to_prefill`, from
  before the prompt's write to the worker having it, and `from_prefill`, from the worker sending
  the first token to the gateway having it (the rest of `rpc` is the worker's own code around its
  engine, and the hand-offs to and from its engine thread);
- `first_token`: detokenizing the first token and handing it to the client, up to the server's write of it
  having completed (gRPC's or the HTTP stream's: the client may have it before that);
- `kv_transfer`: after that, waiting for the prefill worker's handoff (it reserves pages
  on the decode worker and writes the KV into them while the first token goes out);
- `decode_queue`: waiting for the decode worker to take the request into its batch;
- `decode_steps`: waiting for the following tokens;
- `detokenize_egress`: detokenizing, stop strings and handing each later token out;
- `failed`: from the last mark to the error, for a request that failed.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

PHASES = ("ingress", "tokenize", "route", "prefill_queue", "host_tier_read", "prefill_admit", "prefill_compute", "rpc",
          "first_token", "kv_transfer", "decode_queue", "decode_steps", "detokenize_egress", "failed")

DEFAULT_HISTORY = 1000


class PhaseClock:
    """One request's (one choice's) consecutive phases, from `start` (a `time.perf_counter()`)."""

    __slots__ = ("request_id", "start", "last", "seconds", "prefilled_on", "status", "handing_out", "rpc_legs")

    def __init__(self, request_id: str, start: float) -> None:
        self.request_id = request_id
        self.start = start
        self.last = start
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.prefilled_on: str | None = None  # "prefill" (a prefill worker) or "decode" (the decode worker itself)
        # The part of `rpc` that was the prompt's way to its prefill worker and the first token's way
        # back, by the worker's clock and this one's (known for a worker on this host; else None).
        self.rpc_legs: dict[str, float] | None = None
        self.status = "running"
        # What handing out the last output is charged to when the request ends as it goes out (its
        # consumer may close the stream there, before anything after it runs): set as it goes.
        self.handing_out = "detokenize_egress"

    def mark(self, phase: str) -> None:
        """Charge the time since the last mark to `phase`."""
        now = time.perf_counter()
        self.seconds[phase] += now - self.last
        self.last = now

    def mark_split(self, reported: Sequence[tuple[str, float]], rest: str, at: float | None = None) -> None:
        """Charge the time since the last mark, up to `at` (a `time.perf_counter()`; by default
        now), to the phases a worker `reported`, in order, each cut to what is left of the
        interval, and what remains to `rest`."""
        now = time.perf_counter() if at is None else at
        left = now - self.last
        for phase, seconds in reported:
            charged = min(max(seconds, 0.0), left)
            self.seconds[phase] += charged
            left -= charged
        self.seconds[rest] += left
        self.last = now

    def end(self, status: str) -> None:
        """The request finished ("finished") or failed (anything else, the reason); the time
        since the last mark goes to `failed` when it failed, else to handing the output out
        (`handing_out`: `first_token` when that output is the first)."""
        if self.status != "running":
            return
        self.mark(self.handing_out if status == "finished" else "failed")
        self.status = status

    @property
    def e2e_seconds(self) -> float:
        return self.last - self.start

    def to_json(self) -> dict[str, Any]:
        made = {"request_id": self.request_id, "status": self.status, "prefilled_on": self.prefilled_on,
                "e2e_ms": _ms(self.e2e_seconds), "phases_ms": {p: _ms(s) for p, s in self.seconds.items()}}
        if self.rpc_legs is not None:
            made["rpc_legs_ms"] = {leg: _ms(s) for leg, s in self.rpc_legs.items()}
        return made


class ResponseTimeline:
    """The ledger of one HTTP response: a `PhaseClock` per choice, all from the request's arrival."""

    def __init__(self, response_id: str, arrival: float, created: int) -> None:
        self.response_id = response_id
        self.arrival = arrival
        self.created = created
        self.choices: list[PhaseClock] = []

    def clock(self, request_id: str) -> PhaseClock:
        clock = PhaseClock(request_id, self.arrival)
        self.choices.append(clock)
        return clock

    def finish(self, status: str = "finished") -> None:
        """The response is out (or failed): close every choice still open."""
        for clock in self.choices:
            clock.end(status)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.response_id, "object": "baton.request.timeline", "created": self.created,
                "e2e_ms": _ms(max((c.e2e_seconds for c in self.choices), default=0.0)),
                "choices": [{"index": i, **c.to_json()} for i, c in enumerate(self.choices)]}


class TimelineStore:
    """The ledgers of the most recent `capacity` responses, by response id (oldest dropped first)."""

    def __init__(self, capacity: int = DEFAULT_HISTORY) -> None:
        self.capacity = capacity
        self._timelines: OrderedDict[str, ResponseTimeline] = OrderedDict()

    def add(self, timeline: ResponseTimeline) -> None:
        if self.capacity <= 0:
            return
        self._timelines[timeline.response_id] = timeline
        self._timelines.move_to_end(timeline.response_id)
        while len(self._timelines) > self.capacity:
            self._timelines.popitem(last=False)

    def get(self, response_id: str) -> ResponseTimeline | None:
        return self._timelines.get(response_id)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 4)
