"""A request's timing in its response, as vLLM's `--enable-per-request-metrics` gives it: the
`metrics` object of a chat, completion or Responses reply that generated one sequence.

vLLM's figures are taken from when the engine queued the request, when it scheduled it, and when
its first and last tokens came. Here the engine is a worker's (the prefill worker's, or the decode
worker's for a prompt it prefilled itself); on the gateway's clock the request reaches that engine
after the gateway's own phases (ingress, tokenize, route) and, where the worker is on this host,
the prompt's way to it (`to_prefill`). It is scheduled after the wait the worker reports
(`queue_seconds`, which `baton_request_queue_duration_seconds` observes too). The tokens are timed
as they reach the gateway, so the time to the first token includes its way back."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common.metrics import RequestTimer
from services.gateway.timeline import PhaseClock

# A worker's wait, as the ledger charges it (timeline.py): a prefill worker's, split into these.
PREFILL_WAIT = ("prefill_queue", "host_tier_read", "prefill_admit")
GATEWAY_PHASES = ("ingress", "tokenize", "route")


@dataclass(frozen=True)
class RequestTiming:
    """Milliseconds (tokens per second for the last); None where a figure cannot be had (no token
    came; `mean_itl_ms` of a reply of one token)."""

    time_to_first_token_ms: float | None = None  # scheduled → the first token
    generation_time_ms: float | None = None  # the first token → the last
    queue_time_ms: float | None = None  # queued in the worker's engine → scheduled
    mean_itl_ms: float | None = None  # the mean wait for each token after the first
    tokens_per_second: float | None = None  # every token generated over scheduled → the last token
    scheduled_at: float | None = None  # when (a `time.perf_counter()`) it was scheduled: not in the reply

    def to_json(self) -> dict[str, Any]:
        return {"time_to_first_token_ms": self.time_to_first_token_ms, "generation_time_ms": self.generation_time_ms,
                "queue_time_ms": self.queue_time_ms, "mean_itl_ms": self.mean_itl_ms,
                "tokens_per_second": self.tokens_per_second}


UNKNOWN = RequestTiming()


def request_timing(clock: PhaseClock, timer: RequestTimer) -> RequestTiming:
    """The timing of a request whose last token has come, from its ledger (`clock`, settled up to
    that token) and its token times (`timer`)."""
    first, last, num_tokens = timer.first_token_time, timer.last_token_time, timer.num_generated
    if first is None:
        return UNKNOWN
    wait = _engine_wait(clock)
    scheduled = _queued_at(clock) + wait
    return RequestTiming(
        time_to_first_token_ms=_ms(first - scheduled), generation_time_ms=_ms(last - first),
        queue_time_ms=_ms(wait), mean_itl_ms=_ms((last - first) / (num_tokens - 1)) if num_tokens > 1 else None,
        tokens_per_second=round(num_tokens / (last - scheduled), 3) if last > scheduled else None,
        scheduled_at=scheduled)


def _engine_wait(clock: PhaseClock) -> float:
    """Seconds the request waited for the worker's engine that computed its first token."""
    seconds = clock.seconds
    return sum(seconds[p] for p in PREFILL_WAIT) if clock.prefilled_on == "prefill" else seconds["decode_queue"]


def _queued_at(clock: PhaseClock) -> float:
    """When (a `time.perf_counter()`) the request reached that engine, on the gateway's clock."""
    queued = clock.start + sum(clock.seconds[p] for p in GATEWAY_PHASES)
    if clock.rpc_legs is not None:
        queued += clock.rpc_legs["to_prefill"]
    return queued


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)
