"""The ledger's arithmetic: consecutive marks add up to end to end, a worker's figures are
cut to the interval they fall in, and the store keeps only the most recent ledgers."""
from __future__ import annotations

import time

from services.gateway.timeline import PHASES, PhaseClock, ResponseTimeline, TimelineStore


def test_marks_add_up_to_end_to_end():
    clock = PhaseClock("r", time.perf_counter())
    for phase in ("ingress", "tokenize", "route"):
        time.sleep(0.002)
        clock.mark(phase)
    clock.end("finished")
    assert clock.status == "finished"
    assert abs(sum(clock.seconds.values()) - clock.e2e_seconds) < 1e-9
    assert all(clock.seconds[p] >= 0.002 for p in ("ingress", "tokenize", "route"))
    assert set(clock.seconds) == set(PHASES)


def test_reported_figures_are_cut_to_the_interval_and_the_rest_is_charged_to_rest():
    clock = PhaseClock("r", time.perf_counter())
    time.sleep(0.01)
    # The worker claims more than the gateway waited: its figures are cut, in order.
    clock.mark_split([("prefill_queue", 0.004), ("prefill_compute", 10.0), ("kv_transfer", 1.0)], rest="rpc")
    assert clock.seconds["prefill_queue"] == 0.004
    assert clock.seconds["prefill_compute"] == clock.e2e_seconds - 0.004
    assert clock.seconds["kv_transfer"] == 0.0 and clock.seconds["rpc"] == 0.0
    time.sleep(0.01)
    clock.mark_split([("decode_queue", 0.003), ("prefill_compute", -1.0)], rest="rpc")
    assert clock.seconds["decode_queue"] == 0.003 and clock.seconds["rpc"] >= 0.0069
    assert abs(sum(clock.seconds.values()) - clock.e2e_seconds) < 1e-9


def test_a_failed_request_charges_its_last_interval_to_failed_and_ends_once():
    clock = PhaseClock("r", time.perf_counter())
    clock.mark("ingress")
    time.sleep(0.002)
    clock.end("context_length_exceeded")
    clock.end("finished")  # a consumer closing afterwards changes nothing
    assert clock.status == "context_length_exceeded" and clock.seconds["failed"] >= 0.002
    assert clock.seconds["detokenize_egress"] == 0.0


def test_the_store_keeps_the_most_recent():
    store = TimelineStore(capacity=2)
    for i in range(3):
        store.add(ResponseTimeline(f"cmpl-{i}", time.perf_counter(), 0))
    assert store.get("cmpl-0") is None and store.get("cmpl-1") is not None and store.get("cmpl-2") is not None


def test_json_lists_every_choice_in_milliseconds():
    timeline = ResponseTimeline("chatcmpl-x", time.perf_counter() - 0.05, 1)
    for request_id in ("chatcmpl-x-0", "chatcmpl-x-1"):
        clock = timeline.clock(request_id)
        clock.mark("ingress")
        clock.end("finished")
    body = timeline.to_json()
    assert body["id"] == "chatcmpl-x" and [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][1]["request_id"] == "chatcmpl-x-1"
    assert body["e2e_ms"] >= 50.0 and body["choices"][0]["phases_ms"]["ingress"] >= 50.0
