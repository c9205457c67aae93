"""A reply's `metrics` (vLLM's per-request metrics) from its ledger and token times: the engine's
queue begins after the gateway's phases and the prompt's way to a prefill worker, and the time to
the first token, the generation time, the mean inter-token latency and the tokens per second are
taken from when it was scheduled, as vLLM takes them."""
from __future__ import annotations

import pytest

from services.common.metrics import RequestMetrics, ServiceMetrics
from services.gateway.request_timing import UNKNOWN, request_timing
from services.gateway.timeline import PhaseClock

START = 100.0


def ledger(prefilled_on: str, **phases_s: float) -> PhaseClock:
    clock = PhaseClock("r", START)
    clock.prefilled_on = prefilled_on
    clock.seconds.update(phases_s)
    return clock


def tokens_at(*times: float):
    timer = RequestMetrics(ServiceMetrics("gateway")).start()
    timer.arrival = START
    for at in times:
        timer.add_tokens(1, at)
    return timer


def test_a_prompt_prefilled_by_a_prefill_worker_is_queued_once_it_reaches_it():
    clock = ledger("prefill", ingress=0.001, tokenize=0.002, route=0.001, prefill_queue=0.003, host_tier_read=0.002,
                   prefill_admit=0.001, prefill_compute=0.040, rpc=0.005,
                   decode_queue=0.5)  # after the first token: not the prompt's wait
    clock.rpc_legs = {"to_prefill": 0.0005, "from_prefill": 0.0007}
    # queued at 100.0045, scheduled 6 ms later at 100.0105
    timing = request_timing(clock, tokens_at(START + 0.0545, START + 0.0645, START + 0.0845))
    assert timing.queue_time_ms == 6.0
    assert timing.time_to_first_token_ms == 44.0
    assert timing.generation_time_ms == 30.0
    assert timing.mean_itl_ms == 15.0
    assert timing.tokens_per_second == pytest.approx(3 / 0.074, abs=1e-3)


def test_a_prompt_the_decode_worker_prefilled_waits_in_its_queue_and_has_no_legs():
    clock = ledger("decode", ingress=0.001, tokenize=0.001, route=0.002, decode_queue=0.004, prefill_compute=0.01)
    timing = request_timing(clock, tokens_at(START + 0.02))
    assert timing.queue_time_ms == 4.0
    assert timing.time_to_first_token_ms == 12.0
    assert timing.generation_time_ms == 0.0
    assert timing.mean_itl_ms is None  # one token: no interval between tokens
    assert timing.tokens_per_second == pytest.approx(1 / 0.012, abs=1e-3)


def test_a_request_that_got_no_token_has_no_figures():
    assert request_timing(ledger("prefill", ingress=0.001), tokens_at()) is UNKNOWN
    assert set(UNKNOWN.to_json().values()) == {None}
    assert list(UNKNOWN.to_json()) == ["time_to_first_token_ms", "generation_time_ms", "queue_time_ms",
                                       "mean_itl_ms", "tokens_per_second"]
