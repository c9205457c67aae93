from __future__ import annotations

import math

import pytest

from loadgen.client import RequestResult
from loadgen.metrics import Slo, goodput, run_metrics, summarize
from loadgen.runner import LoadPoint, RunResult


def ok(index: int, ttft: float, e2e: float, output_tokens: int, itl=(), prompt_tokens: int = 10,
       cached: int | None = None) -> RequestResult:
    return RequestResult(index=index, ttft=ttft, e2e=e2e, output_tokens=output_tokens, itl=list(itl),
                         prompt_tokens=prompt_tokens, cached_tokens=cached)


def failed(index: int, kind: str = "HTTP 429", message: str = "no free pages") -> RequestResult:
    return RequestResult(index=index, error=kind, error_message=message)


def test_summarize_percentiles_on_known_values():
    stats = summarize(range(1, 101), percentiles=(50, 95, 99))
    assert stats["mean"] == 50.5 and stats["min"] == 1 and stats["max"] == 100
    # numpy's linear interpolation: rank q/100 * (n - 1).
    assert stats["p50"] == pytest.approx(50.5)
    assert stats["p95"] == pytest.approx(95.05)
    assert stats["p99"] == pytest.approx(99.01)
    assert summarize([]) is None
    assert summarize([7.0], percentiles=(99.9,)) == {"mean": 7.0, "std": 0.0, "min": 7.0, "max": 7.0,
                                                     "p99.9": 7.0}


def test_tpot_excludes_the_first_token():
    assert ok(0, ttft=0.1, e2e=0.5, output_tokens=5).tpot == pytest.approx(0.1)
    assert ok(0, ttft=0.1, e2e=0.1, output_tokens=1).tpot is None
    assert failed(0).tpot is None


def test_slo_needs_both_limits_and_a_success():
    slo = Slo(ttft_ms=200, tpot_ms=50)
    assert slo.is_met(ok(0, ttft=0.2, e2e=0.6, output_tokens=9))       # both exactly at the limit
    assert not slo.is_met(ok(0, ttft=0.21, e2e=0.3, output_tokens=9))  # TTFT over
    assert not slo.is_met(ok(0, ttft=0.1, e2e=0.6, output_tokens=9))   # TPOT 62.5 ms
    assert slo.is_met(ok(0, ttft=0.1, e2e=5.0, output_tokens=1))       # no TPOT to miss
    assert not slo.is_met(failed(0))
    assert Slo(ttft_ms=200).is_met(ok(0, ttft=0.1, e2e=9.0, output_tokens=2))
    assert not Slo().is_set
    with pytest.raises(ValueError):
        Slo(tpot_ms=0)


def test_run_metrics_counts_throughput_and_attainment():
    results = [ok(0, 0.1, 0.5, 5, itl=[0.1] * 4, cached=0),
               ok(1, 0.3, 0.7, 5, itl=[0.1] * 4, cached=8),      # TTFT over the SLO
               ok(2, 0.1, 0.9, 5, itl=[0.2] * 4, cached=8),      # TPOT over the SLO
               ok(3, 0.2, 0.6, 5, itl=[0.1] * 4, cached=8),
               failed(4), failed(5), failed(6, "ConnectError", "refused")]
    m = run_metrics(RunResult(LoadPoint(request_rate=2.0), duration=2.0, results=results),
                    Slo(ttft_ms=200, tpot_ms=100), percentiles=(50,))
    assert (m.num_requests, m.completed, m.num_errors) == (7, 4, 3)
    assert m.errors == {"HTTP 429": 2, "ConnectError": 1}
    assert m.error_examples == {"HTTP 429": "no free pages", "ConnectError": "refused"}
    assert (m.total_input_tokens, m.total_output_tokens, m.total_cached_tokens) == (40, 20, 24)
    assert m.request_throughput == 2.0 and m.output_throughput == 10.0 and m.total_token_throughput == 30.0
    assert m.ttft_ms["p50"] == pytest.approx(150) and m.e2e_ms["mean"] == pytest.approx(675)
    assert m.tpot_ms["max"] == pytest.approx(200) and m.itl_ms["p50"] == pytest.approx(100)
    assert m.slo_attainment == pytest.approx(2 / 7)  # failures count against it
    assert m.goodput_rps == pytest.approx(1.0)
    assert m.request_rate == 2.0 and m.rate_for_goodput == 2.0


def test_no_slo_no_attainment():
    m = run_metrics(RunResult(LoadPoint(), duration=1.0, results=[ok(0, 0.1, 0.2, 2)]), Slo())
    assert m.slo_attainment is None and m.goodput_rps is None and m.request_rate is None
    assert m.total_cached_tokens is None


def metrics_at(rate: float | None, num_met: int, num: int = 10, concurrency: int | None = None):
    results = [ok(i, 0.1 if i < num_met else 1.0, 1.0, 1) for i in range(num)]
    load = LoadPoint(request_rate=rate if rate is not None else math.inf, max_concurrency=concurrency)
    return run_metrics(RunResult(load, duration=num / (rate or 5.0), results=results), Slo(ttft_ms=500))


def test_goodput_is_the_highest_rate_with_ninety_percent_attainment():
    runs = [metrics_at(1, 10), metrics_at(2, 9), metrics_at(4, 8), metrics_at(8, 10)]
    # Not monotone on purpose: the highest qualifying rate wins, whatever lies between.
    assert goodput(runs) == 8
    assert goodput(runs[:3]) == 2  # exactly 90 % qualifies
    assert goodput([metrics_at(1, 8)]) is None
    assert goodput([metrics_at(1, 27, num=30)]) == 1


def test_goodput_of_a_concurrency_run_is_its_measured_rate():
    run = metrics_at(None, 10, concurrency=2)
    assert run.request_rate is None and goodput([run]) == pytest.approx(run.request_throughput) == 5.0
