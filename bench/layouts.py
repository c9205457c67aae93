"""Colocated against disaggregated: `baton bench` on both layouts of the demo model, on
the same cores, at the same request rates.

    .venv/bin/python bench/layouts.py [--model DIR] [--request-rates 2,8,32] [--num-requests 60]
                                      [--colocated-workers 1] [--quick]

- Disaggregated: `baton up --prefill 1 --decode 1 --no-kvstore`, every prompt through the
  prefill worker and a KV transfer into the decode worker
  (BATON_LOCAL_PREFILL_MAX_TOKENS=0: no conditional disaggregation, so the layout is
  pure).
- Colocated: `baton up --colocated --decode N` (N = --colocated-workers, default 1): each
  worker prefills its prompts in its own running batch (chunked prefill mixed with the
  decode steps), no KV transfer.
- What is held equal: the host and so its cores (each engine process runs torch's
  default threads, one per core, so the disaggregated layout's two engines share the
  cores the colocated worker has alone), the KV memory (a colocated worker gets 2048
  pages, the 1024 + 1024 of a prefill and a decode worker), the prefill chunk (the
  engine's 2048-token step budget in both), the gateway, tokenizer and Redis, and the
  workload. --colocated-workers 2 gives the colocated layout as many engine processes as
  the disaggregated one instead.
- The load, per layout: `baton bench` (a subprocess, its --json document read back) at
  each of --request-rates, Poisson arrivals, --num-requests requests per rate, prompts of
  uniform:128:512 token ids of which half is one shared prefix, 32 output tokens
  (ignore_eos), streamed; 4 warm-up requests first. SLOs: TTFT <= 300 ms and TPOT <= 30 ms.
  Per rate: TTFT and TPOT p50/p95, SLO attainment (the share of requests meeting both),
  and goodput_rps (requests meeting both per second). The layout's goodput is
  DistServe's: the highest rate at which at least 90 % of requests meet the SLOs (null
  when none does); goodput_colocated_over_disaggregated is the ratio of the two, and
  goodput_rps_ratio_by_rate the ratio of goodput_rps at each rate.

The last line of output is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.local_mesh import LocalMesh, log  # noqa: E402
from engine.demo_model import ensure_demo_model  # noqa: E402

LAYOUTS = ("disaggregated", "colocated")
WORKLOAD = ("--prompt-len", "uniform:128:512", "--output-len", "32", "--shared-prefix-ratio", "0.5")
SLO_TTFT_MS = 300.0
SLO_TPOT_MS = 30.0
NUM_WARMUP = 4
BENCH_TIMEOUT_S = 1800


def up_args(layout: str, colocated_workers: int) -> tuple[tuple[str, ...], dict[str, str]]:
    """`baton up` flags and BATON_* variables of a layout."""
    if layout == "colocated":
        return ("--colocated", "--decode", str(colocated_workers)), {}
    return ("--prefill", "1", "--decode", "1", "--no-kvstore"), {"BATON_LOCAL_PREFILL_MAX_TOKENS": "0"}


def run_bench(mesh: LocalMesh, args) -> dict:
    """`baton bench --json` against the mesh: its document."""
    command = [sys.executable, "-m", "cli", "bench", "--base-url", f"http://{mesh.http}/v1",
               "--model", mesh.model_name, "--num-requests", str(args.num_requests),
               "--request-rate", args.request_rates, *WORKLOAD, "--warmup", str(NUM_WARMUP),
               "--slo-ttft-ms", str(SLO_TTFT_MS), "--slo-tpot-ms", str(SLO_TPOT_MS), "--percentiles", "50,95",
               "--seed", str(args.seed), "--json", "--no-progress"]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"baton bench exited with {done.returncode}: {done.stderr.strip()}")
    return json.loads(done.stdout)


def figures(document: dict) -> dict:
    """Per rate: latency percentiles, SLO attainment and goodput; and the layout's goodput."""
    runs = []
    for run in document["runs"]:
        ttft, tpot = run["ttft_ms"] or {}, run["tpot_ms"] or {}
        runs.append({"request_rate": run["request_rate"], "completed": run["completed"], "errors": run["num_errors"],
                     "ttft_p50_ms": ttft.get("p50"), "ttft_p95_ms": ttft.get("p95"),
                     "tpot_p50_ms": tpot.get("p50"), "tpot_p95_ms": tpot.get("p95"),
                     "slo_attainment": run["slo_attainment"], "goodput_rps": run["goodput_rps"]})
    return {"goodput": document["goodput"]["request_rate"], "runs": runs}


def bench_layout(layout: str, model_dir: Path, args) -> dict:
    flags, env = up_args(layout, args.colocated_workers)
    started = time.perf_counter()
    mesh = LocalMesh(model_dir, *flags, env=env)
    try:
        log(f"[{layout}] mesh up in {time.perf_counter() - started:.1f} s at {mesh.http}: "
            f"{', '.join(sorted(mesh.addresses))}")
        result = figures(run_bench(mesh, args))
    finally:
        mesh.stop()
    return result


def table(layout: str, result: dict) -> str:
    rows = [f"{layout}: goodput {_number(result['goodput'])} requests/s "
            f"(the highest rate with >= 90 % of requests within TTFT {SLO_TTFT_MS:g} ms and TPOT {SLO_TPOT_MS:g} ms)",
            f"  {'rate/s':>7} {'done':>5} {'TTFT p50':>9} {'TTFT p95':>9} {'TPOT p50':>9} {'TPOT p95':>9} "
            f"{'SLO met':>8} {'goodput/s':>10}"]
    for run in result["runs"]:
        rows.append(f"  {run['request_rate']:>7g} {run['completed']:>5} {_number(run['ttft_p50_ms']):>9} "
                    f"{_number(run['ttft_p95_ms']):>9} {_number(run['tpot_p50_ms']):>9} "
                    f"{_number(run['tpot_p95_ms']):>9} {run['slo_attainment']:>8.0%} {run['goodput_rps']:>10.2f}")
    return "\n".join(rows)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the demo model)")
    parser.add_argument("--request-rates", default="2,8,32", help="requests per second, one run each")
    parser.add_argument("--num-requests", type=int, default=60, help="requests per rate")
    parser.add_argument("--colocated-workers", type=int, default=1,
                        help="workers of the colocated layout (2: as many engine processes as disaggregated)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 12 requests per rate")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests = 12
    model_dir = args.model or ensure_demo_model()
    log(f"model {model_dir}; rates {args.request_rates}/s, {args.num_requests} requests each, "
        f"{' '.join(WORKLOAD)}; colocated workers {args.colocated_workers}")

    results = {layout: bench_layout(layout, model_dir, args) for layout in LAYOUTS}
    for layout in LAYOUTS:
        print(table(layout, results[layout]), flush=True)
    disaggregated, colocated = results["disaggregated"], results["colocated"]
    summary = {
        **results,
        "colocated_workers": args.colocated_workers,
        "slo": {"ttft_ms": SLO_TTFT_MS, "tpot_ms": SLO_TPOT_MS},
        "goodput_colocated_over_disaggregated": _ratio(colocated["goodput"], disaggregated["goodput"]),
        "goodput_rps_ratio_by_rate": {
            f"{d['request_rate']:g}": _ratio(c["goodput_rps"], d["goodput_rps"])
            for d, c in zip(disaggregated["runs"], colocated["runs"], strict=True)},
    }
    ratio = summary["goodput_colocated_over_disaggregated"]
    print(f"goodput colocated / disaggregated: {'-' if ratio is None else f'{ratio:.2f}'}; "
          f"by rate (requests within the SLOs per second): {summary['goodput_rps_ratio_by_rate']}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
