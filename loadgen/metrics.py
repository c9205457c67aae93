"""From timed requests to the numbers a serving benchmark reports.

Latencies are in milliseconds, percentiles numpy's linear interpolation (as vLLM's and
SGLang's benchmarks compute them). Throughputs divide by the run's duration and count
completed requests only.

Goodput follows DistServe: a request meets the SLO when its TTFT and its TPOT are both
within their limits (a limit not given always holds; a failed request never meets it, and
one with a single output token has no TPOT to miss). A run's attainment is the share of
all its requests that meet the SLO, and `goodput_rps` those requests per second (vLLM's
"request goodput"). The goodput of a sweep is the highest request rate whose attainment
is at least 90 %: the offered rate of each run, or its measured request throughput when it
had none (all at once, under a concurrency cap).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

from loadgen.client import RequestResult
from loadgen.runner import RunResult

DEFAULT_PERCENTILES = (50.0, 95.0, 99.0)
ATTAINMENT_TARGET = 0.9


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for name, value in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms)):
            if value is not None and not value > 0:
                raise ValueError(f"the {name} SLO must be above 0 ms, got {value}")

    @property
    def is_set(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def is_met(self, result: RequestResult) -> bool:
        if not result.is_ok:
            return False
        if self.ttft_ms is not None and result.ttft * 1e3 > self.ttft_ms:
            return False
        tpot = result.tpot
        return self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms


def summarize(values_ms, percentiles=DEFAULT_PERCENTILES) -> dict[str, float] | None:
    """mean, std, min, max and `p<q>` for each percentile q; None for no values."""
    values = np.asarray(list(values_ms), dtype=np.float64)
    if values.size == 0:
        return None
    out = {"mean": float(values.mean()), "std": float(values.std()), "min": float(values.min()),
           "max": float(values.max())}
    for q, value in zip(percentiles, np.percentile(values, percentiles)):
        out[percentile_key(q)] = float(value)
    return out


def percentile_key(q: float) -> str:
    return f"p{q:g}"


@dataclass(frozen=True)
class RunMetrics:
    """Everything reported for one run (JSON-ready through `to_dict`)."""

    request_rate: float | None  # None: no rate, all at once
    burstiness: float
    max_concurrency: int | None
    duration_s: float
    num_requests: int
    completed: int
    num_errors: int
    errors: dict[str, int]
    error_examples: dict[str, str]
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: int | None
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: dict[str, float] | None
    tpot_ms: dict[str, float] | None
    itl_ms: dict[str, float] | None
    e2e_ms: dict[str, float] | None
    slo_attainment: float | None
    goodput_rps: float | None

    @property
    def rate_for_goodput(self) -> float:
        return self.request_rate if self.request_rate is not None else self.request_throughput

    def to_dict(self) -> dict:
        return asdict(self)


def run_metrics(run: RunResult, slo: Slo, percentiles=DEFAULT_PERCENTILES) -> RunMetrics:
    ok = [r for r in run.results if r.is_ok]
    failed = [r for r in run.results if not r.is_ok]
    duration = run.duration if run.duration > 0 else math.inf
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    examples: dict[str, str] = {}
    for r in failed:
        examples.setdefault(r.error, r.error_message)
    num_met = sum(slo.is_met(r) for r in run.results) if slo.is_set else None
    return RunMetrics(
        request_rate=run.load.request_rate if math.isfinite(run.load.request_rate) else None,
        burstiness=run.load.burstiness,
        max_concurrency=run.load.max_concurrency,
        duration_s=run.duration,
        num_requests=len(run.results),
        completed=len(ok),
        num_errors=len(failed),
        errors=dict(Counter(r.error for r in failed).most_common()),
        error_examples=examples,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        total_cached_tokens=sum(cached) if cached else None,
        request_throughput=len(ok) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(input_tokens + output_tokens) / duration,
        ttft_ms=summarize((r.ttft * 1e3 for r in ok), percentiles),
        tpot_ms=summarize((r.tpot * 1e3 for r in ok if r.tpot is not None), percentiles),
        itl_ms=summarize((gap * 1e3 for r in ok for gap in r.itl), percentiles),
        e2e_ms=summarize((r.e2e * 1e3 for r in ok), percentiles),
        slo_attainment=num_met / len(run.results) if num_met is not None else None,
        goodput_rps=num_met / duration if num_met is not None else None,
    )


def goodput(runs: list[RunMetrics], target: float = ATTAINMENT_TARGET) -> float | None:
    """DistServe's goodput: the highest rate among runs whose SLO attainment is at least
    `target`; None when no run meets it or no SLO was given."""
    # The epsilon keeps a share equal to the target that floating point rounds just below it.
    rates = [m.rate_for_goodput for m in runs
             if m.slo_attainment is not None and m.slo_attainment >= target - 1e-9]
    return max(rates) if rates else None
