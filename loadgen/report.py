"""The report: a table per run for people, one JSON document for machines."""
from __future__ import annotations

from typing import Any

from loadgen.metrics import ATTAINMENT_TARGET, RunMetrics, Slo, percentile_key

LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))
WIDTH = 64


def slo_text(slo: Slo) -> str:
    parts = []
    if slo.ttft_ms is not None:
        parts.append(f"TTFT <= {slo.ttft_ms:g} ms")
    if slo.tpot_ms is not None:
        parts.append(f"TPOT <= {slo.tpot_ms:g} ms")
    return " and ".join(parts)


def format_run(title: str, m: RunMetrics, slo: Slo, percentiles) -> str:
    lines = [f" {title} ".center(WIDTH, "=")]

    def row(label: str, value: str) -> None:
        lines.append(f"{label + ':':<36}{value:>{WIDTH - 36}}")

    row("Requests sent / completed / failed", f"{m.num_requests} / {m.completed} / {m.num_errors}")
    row("Duration (s)", f"{m.duration_s:.2f}")
    row("Input tokens / output tokens", f"{m.total_input_tokens} / {m.total_output_tokens}")
    if m.total_cached_tokens is not None and m.total_input_tokens:
        row("Cached input tokens", f"{m.total_cached_tokens} ({m.total_cached_tokens / m.total_input_tokens:.1%})")
    row("Request throughput (req/s)", f"{m.request_throughput:.2f}")
    row("Output token throughput (tok/s)", f"{m.output_throughput:.1f}")
    row("Total token throughput (tok/s)", f"{m.total_token_throughput:.1f}")
    if m.slo_attainment is not None:
        lines.append(f"SLO: {slo_text(slo)}")
        row("SLO attainment", f"{m.slo_attainment:.1%}")
        row("Goodput (req/s meeting the SLO)", f"{m.goodput_rps:.2f}")
    keys = ["mean", *(percentile_key(q) for q in percentiles)]
    lines.append(f"{'(ms)':<8}" + "".join(f"{k:>{(WIDTH - 8) // len(keys)}}" for k in keys))
    for label, field in LATENCIES:
        stats = getattr(m, field)
        cells = [f"{stats[k]:.2f}" if stats else "-" for k in keys]
        lines.append(f"{label:<8}" + "".join(f"{c:>{(WIDTH - 8) // len(keys)}}" for c in cells))
    for kind, count in m.errors.items():
        lines.append(f"error {kind} x{count}: {m.error_examples.get(kind, '')[:WIDTH * 2]}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def format_sweep(runs: list[RunMetrics], slo: Slo, goodput_rate: float | None) -> str:
    """One line per run and DistServe's goodput, after the per-run tables of a sweep."""
    lines = [" Sweep ".center(WIDTH, "="),
             f"{'rate':>10}{'conc':>6}{'req/s':>10}{'tok/s':>10}{'errors':>8}{'SLO met':>10}{'good/s':>10}"]
    for m in runs:
        rate = f"{m.request_rate:g}" if m.request_rate is not None else "inf"
        conc = str(m.max_concurrency) if m.max_concurrency is not None else "-"
        met = f"{m.slo_attainment:.1%}" if m.slo_attainment is not None else "-"
        good = f"{m.goodput_rps:.2f}" if m.goodput_rps is not None else "-"
        lines.append(f"{rate:>10}{conc:>6}{m.request_throughput:>10.2f}{m.output_throughput:>10.1f}"
                     f"{m.num_errors:>8}{met:>10}{good:>10}")
    if slo.is_set:
        verdict = f"{goodput_rate:.2f} req/s" if goodput_rate is not None else "none of these rates"
        lines.append(f"Goodput ({ATTAINMENT_TARGET:.0%} of requests within {slo_text(slo)}): {verdict}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def json_document(setup: dict[str, Any], slo: Slo, percentiles, runs: list[RunMetrics],
                  goodput_rate: float | None) -> dict[str, Any]:
    """`runs[i].request_rate` is null for a run with no rate (everything at once); `goodput` is
    null without an SLO, and its `request_rate` null when no run met it."""
    return {
        **setup,
        "percentiles": list(percentiles),
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms} if slo.is_set else None,
        "runs": [m.to_dict() for m in runs],
        "goodput": ({"attainment_target": ATTAINMENT_TARGET, "request_rate": goodput_rate}
                    if slo.is_set else None),
    }
