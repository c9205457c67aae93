"""`RequestMetrics`: per-request latencies and token counts, as the gateway sees a request
from arrival to its last token (as vLLM's frontend counts them).

- time to first token: arrival → the first generated token;
- inter-token latency: once per token after the first, its share of the wait since the
  arrival before it (k tokens that come together share it: a decode worker's chunk, a
  speculative step), 0 for those that came with the first;
- time per output token: (last token − first token) / (tokens − 1), once per finished
  request of at least two tokens;
- end to end: arrival → the last token, once per finished request;
- per prompt whose sequences all ended, as vLLM's: how many there were (`n`) and the most tokens one
  generated;
- per finished request, as vLLM's `vllm:request_*` histograms: its prompt's and its output's tokens,
  the `max_tokens` it asked for, and from when the engine that computed its first token took it
  (`scheduled`, on this clock) to that token (prefill time) and to its last (inference time), and
  from its first token to its last (decode time);
- queue: how long the prefill worker's engine took to pick the request up (its
  reported `queue_seconds`), and the KV transfer it then made, by transport;
- the two legs of the wait for a prefill worker's first token besides the worker's own time,
  for a worker on the gateway's host (the ledger's `rpc_legs_ms`): the prompt's way there
  (`leg="to_prefill"`) and the first token's way back (`leg="from_prefill"`).
"""
from __future__ import annotations

import time

from prometheus_client import Counter, Histogram

from services.common.metrics.service import LABELS, LATENCY_BUCKETS, ServiceMetrics

# A hop between two processes of one host takes tenths of a millisecond: LATENCY_BUCKETS' first
# bound (1 ms) would hold nearly all of them.
# Tokens, 1-2-5 per decade to a million (vLLM's buckets, for any context).
TOKEN_BUCKETS = (*(m * 10 ** e for e in range(6) for m in (1, 2, 5)), 1_000_000)
N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's, for a request's n
HOP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class RequestMetrics:
    def __init__(self, metrics: ServiceMetrics) -> None:
        self.metrics = metrics
        registry, labels = metrics.registry, metrics.labels

        def histogram(name: str, documentation: str):
            return Histogram(name, documentation, LABELS, buckets=LATENCY_BUCKETS, registry=registry).labels(**labels)

        def counter(name: str, documentation: str):
            return Counter(name, documentation, LABELS, registry=registry).labels(**labels)

        self.queue = histogram("baton_request_queue_duration_seconds",
                               "Waiting for an engine to take the request (prefill worker's queue)")
        self.time_to_first_token = histogram("baton_time_to_first_token_seconds", "Arrival to the first token")
        self.time_per_output_token = histogram("baton_time_per_output_token_seconds",
                                               "Mean time per token after the first, per finished request")
        self.inter_token_latency = histogram("baton_inter_token_latency_seconds",
                                             "Each token's share of the wait since the tokens before it came")
        self.e2e_latency = histogram("baton_e2e_request_latency_seconds", "Arrival to the last token")
        def token_histogram(name: str, documentation: str):
            return Histogram(name, documentation, LABELS, buckets=TOKEN_BUCKETS, registry=registry).labels(**labels)

        self.request_prompt_tokens = token_histogram("baton_request_prompt_tokens",
                                                     "Prompt tokens per finished request")
        self.request_generation_tokens = token_histogram("baton_request_generation_tokens",
                                                         "Tokens generated per finished request")
        self.request_max_tokens = token_histogram("baton_request_params_max_tokens",
                                                  "The max_tokens of each finished request")
        self.request_n = Histogram("baton_request_params_n", "Sequences generated for each prompt (its n)", LABELS,
                                   buckets=N_BUCKETS, registry=registry).labels(**labels)
        self.request_max_generation_tokens = token_histogram(
            "baton_request_max_num_generation_tokens", "The most tokens any one sequence of a prompt generated")
        self.request_prefill_time = histogram("baton_request_prefill_time_seconds",
                                              "A worker's engine taking a request to its first token")
        self.request_decode_time = histogram("baton_request_decode_time_seconds", "A request's first token to its last")
        self.request_inference_time = histogram("baton_request_inference_time_seconds",
                                                "A worker's engine taking a request to its last token")
        self.prompt_tokens = counter("baton_prompt_tokens", "Prompt tokens of requests that got a first token")
        self.generation_tokens = counter("baton_generation_tokens", "Tokens generated")
        self._kv_duration = Histogram("baton_kv_transfer_duration_seconds", "Writing a prompt's KV pages to decode",
                                      [*LABELS, "transport"], buckets=LATENCY_BUCKETS, registry=registry)
        self._kv_bytes = Counter("baton_kv_transfer_bytes", "KV bytes written from prefill to decode",
                                 [*LABELS, "transport"], registry=registry)
        self._kv_early_bytes = Counter("baton_kv_transfer_early_bytes",
                                       "Of those, the bytes written while the prompt was still computing",
                                       [*LABELS, "transport"], registry=registry)
        self._rpc_legs = Histogram("baton_prefill_rpc_leg_duration_seconds",
                                   "The prompt's way to a prefill worker on this host (to_prefill) and its first "
                                   "token's way back (from_prefill)", [*LABELS, "leg"], buckets=HOP_BUCKETS,
                                   registry=registry)

    def start(self) -> RequestTimer:
        """A request arrives now."""
        return RequestTimer(self, time.perf_counter())

    def observe_sequence_group(self, num_sequences: int, max_generation_tokens: int) -> None:
        """One prompt's sequences have all ended (the gateway's sequence_groups.py counts them)."""
        self.request_n.observe(num_sequences)
        self.request_max_generation_tokens.observe(max_generation_tokens)

    def observe_prefill(self, queue_s: float, transport: str | None, transfer_s: float, transfer_bytes: int,
                        rpc_legs: dict[str, float] | None = None, early_bytes: int = 0) -> None:
        """What a prefill worker reported; `transport` None when no pages moved; `rpc_legs` (seconds by
        leg) None when they are not known (a worker on another host); `early_bytes`: of `transfer_bytes`,
        those written while the prompt computed."""
        self.queue.observe(queue_s)
        if transport is not None:
            self._kv_duration.labels(**self.metrics.labels, transport=transport).observe(transfer_s)
            self._kv_bytes.labels(**self.metrics.labels, transport=transport).inc(transfer_bytes)
            self._kv_early_bytes.labels(**self.metrics.labels, transport=transport).inc(early_bytes)
        for leg, seconds in (rpc_legs or {}).items():
            self._rpc_legs.labels(**self.metrics.labels, leg=leg).observe(seconds)


class RequestTimer:
    """One request's timestamps, observed into `RequestMetrics` as they happen. Ends with
    exactly one of `finish` (counted a success) or `fail` (an error, by reason)."""

    __slots__ = ("metrics", "arrival", "first_token_time", "last_token_time", "num_generated", "num_prompt_tokens",
                 "is_done")

    def __init__(self, metrics: RequestMetrics, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.first_token_time: float | None = None
        self.last_token_time = arrival
        self.num_generated = 0
        self.num_prompt_tokens = 0  # set once the prompt is known; counted at the first token
        self.is_done = False

    def add_tokens(self, num_tokens: int, now: float | None = None) -> None:
        """`num_tokens` more, generated at `now` (a `time.perf_counter()`; by default, now)."""
        if num_tokens == 0:
            return
        now = time.perf_counter() if now is None else now
        m = self.metrics
        if self.first_token_time is None:
            self.first_token_time = now
            m.time_to_first_token.observe(now - self.arrival)
            m.prompt_tokens.inc(self.num_prompt_tokens)
            num_waited, share = num_tokens - 1, 0.0
        else:
            num_waited, share = num_tokens, (now - self.last_token_time) / num_tokens
        for _ in range(num_waited):
            m.inter_token_latency.observe(share)
        self.last_token_time = now
        self.num_generated += num_tokens
        m.generation_tokens.inc(num_tokens)

    def finish(self, finish_reason: str, scheduled: float | None = None, max_tokens: int = 0) -> None:
        """`scheduled`: when (a `time.perf_counter()`) the engine that computed the first token took
        the request; `max_tokens` as the request asked (0: not given)."""
        m = self.metrics
        m.e2e_latency.observe(time.perf_counter() - self.arrival)
        if self.num_generated > 1:
            m.time_per_output_token.observe((self.last_token_time - self.first_token_time) / (self.num_generated - 1))
        m.request_prompt_tokens.observe(self.num_prompt_tokens)
        m.request_generation_tokens.observe(self.num_generated)
        if max_tokens:
            m.request_max_tokens.observe(max_tokens)
        if self.first_token_time is not None:
            m.request_decode_time.observe(self.last_token_time - self.first_token_time)
            if scheduled is not None:
                m.request_prefill_time.observe(self.first_token_time - scheduled)
                m.request_inference_time.observe(self.last_token_time - scheduled)
        m.metrics.count_success(finish_reason)
        self.is_done = True

    def fail(self, reason: str) -> None:
        """Counts the error unless the request already finished (a consumer closing after the last delta)."""
        if not self.is_done:
            self.metrics.metrics.count_error(reason)
            self.is_done = True
