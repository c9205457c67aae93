"""`baton bench` (also `python -m loadgen`): flags in, runs out, the report printed.

Without `--json` the report goes to stdout; with it stdout holds the JSON document alone.
The progress bar and notes go to stderr. The exit status is 0, 1 when some run had no
request complete, 2 for a bad flag or a server that cannot be asked for its model.

This module imports only the standard library at load time, so `baton --help` stays fast.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
from pathlib import Path

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"

DESCRIPTION = (
    "Send a synthetic load to any OpenAI-compatible server (Baton, vLLM, SGLang) and report TTFT, "
    "TPOT, ITL and end-to-end latency percentiles, throughput, errors, and goodput under TTFT/TPOT SLOs. "
    "Requests are streamed. Completions prompts are random token ids, so their lengths are exact; chat "
    "prompts are random common words (about one token each). Several --request-rate or --concurrency values "
    "make a sweep; with an SLO, the goodput is the highest rate at which at least 90% of requests meet it "
    "(DistServe's definition).")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default=DEFAULT_BASE_URL,
                        help=f"the API's base URL, up to /v1 (default {DEFAULT_BASE_URL})")
    target.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    target.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                        help="/v1/completions or /v1/chat/completions (default completions)")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as a bearer token (default $OPENAI_API_KEY; none when unset)")
    target.add_argument("--timeout", type=float, default=600.0, metavar="S",
                        help="seconds one request may take in all (default 600)")

    load = parser.add_argument_group("load")
    load.add_argument("--num-requests", type=int, default=100, metavar="N", help="requests per run (default 100)")
    load.add_argument("--request-rate", default="inf", metavar="R[,R...]",
                      help="requests per second, Poisson arrivals; several values make a sweep "
                           "(default inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0, metavar="B",
                      help="gamma shape of the gaps between arrivals: 1 = Poisson, below 1 burstier, "
                           "above 1 more even (default 1)")
    load.add_argument("--concurrency", metavar="C[,C...]",
                      help="requests in flight at most; alone, a closed loop at that concurrency; "
                           "several values make a sweep (default: no cap)")
    load.add_argument("--warmup", type=int, default=0, metavar="N",
                      help="requests sent one at a time before measuring, not reported (default 0)")

    workload = parser.add_argument_group("workload")
    workload.add_argument("--dataset-name", choices=("random", "sharegpt"), default="random",
                          help="random prompts (the flags below), or ShareGPT conversations as vLLM's benchmark "
                               "samples them: first turn the prompt, second the reply's length (default random)")
    workload.add_argument("--dataset-path", metavar="FILE",
                          help="the ShareGPT JSON file (with --dataset-name sharegpt)")
    workload.add_argument("--tokenizer", metavar="DIR",
                          help="the model directory whose tokenizer.json counts a ShareGPT pair's tokens")
    workload.add_argument("--prompt-len", default="256", metavar="DIST",
                          help="prompt length in tokens: N, fixed:N, uniform:LO:HI, normal:MEAN:STD or "
                               "lognormal:MEDIAN:SIGMA (default 256)")
    workload.add_argument("--output-len", default="64", metavar="DIST",
                          help="max_tokens of each request, the same syntax (default 64)")
    workload.add_argument("--prompt-format", choices=("ids", "text"),
                          help="token-id prompts (exact lengths; completions only) or text of common words "
                               "(approximate) (default: ids for completions, text for chat)")
    workload.add_argument("--token-id-range", default="100:1000", metavar="LO:HI",
                          help="token-id prompts draw ids from [LO, HI) (default 100:1000: inside any "
                               "vocabulary, above where special tokens usually sit)")
    workload.add_argument("--shared-prefix-ratio", type=float, default=0.0, metavar="R",
                          help="share of each prompt taken from one of the shared prefixes (default 0)")
    workload.add_argument("--num-prefixes", type=int, default=1, metavar="K",
                          help="shared prefixes to draw from (default 1)")
    workload.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                          help="send ignore_eos, so each output is exactly its length (default: on)")
    workload.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    workload.add_argument("--extra-body", metavar="JSON", help="more fields for every request body")
    workload.add_argument("--seed", type=int, default=0, help="seed of the workload and arrivals (default 0)")

    report = parser.add_argument_group("report")
    report.add_argument("--slo-ttft-ms", type=float, metavar="MS", help="TTFT SLO for attainment and goodput")
    report.add_argument("--slo-tpot-ms", type=float, metavar="MS", help="TPOT SLO for attainment and goodput")
    report.add_argument("--percentiles", default="50,95,99", metavar="Q[,Q...]",
                        help="latency percentiles to report (default 50,95,99)")
    report.add_argument("--json", action="store_true", help="print one JSON document on stdout instead of tables")
    report.add_argument("--plot", metavar="DIR", type=Path,
                        help="write PNG histograms and CDFs of the latencies into DIR (needs matplotlib)")
    report.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bar (it is shown only when stderr is a terminal)")


def run_bench(args: argparse.Namespace) -> int:
    # Imported here: numpy and httpx load only when a benchmark runs.
    import asyncio

    import numpy as np

    from loadgen.client import RequestOptions
    from loadgen.distributions import LengthDistribution
    from loadgen.metrics import Slo, goodput, run_metrics
    from loadgen.report import format_run, format_sweep, json_document
    from loadgen.runner import LoadPoint, run_load
    from loadgen.workload import WorkloadConfig, build_workload

    prompt_format = args.prompt_format or ("ids" if args.endpoint == "completions" else "text")
    if args.endpoint == "chat" and prompt_format == "ids":
        raise ValueError("chat takes text prompts only: drop --prompt-format ids")
    workload = WorkloadConfig(
        num_requests=args.num_requests, prompt_len=LengthDistribution.parse(args.prompt_len),
        output_len=LengthDistribution.parse(args.output_len), prompt_format=prompt_format,
        shared_prefix_ratio=args.shared_prefix_ratio, num_prefixes=args.num_prefixes,
        token_id_range=_int_pair(args.token_id_range, "--token-id-range"))
    build = _sharegpt_builder(args, prompt_format) if args.dataset_name == "sharegpt" else build_workload
    loads = [LoadPoint(request_rate=rate, burstiness=args.burstiness, max_concurrency=conc)
             for rate, conc in itertools.product(_floats(args.request_rate, "--request-rate"),
                                                 _concurrencies(args.concurrency))]
    slo = Slo(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    percentiles = _floats(args.percentiles, "--percentiles")
    if not all(0 <= q <= 100 for q in percentiles):
        raise ValueError(f"percentiles must be within [0, 100], got {args.percentiles!r}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be above 0, got {args.timeout}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must not be negative, got {args.warmup}")
    extra_body = _json_object(args.extra_body) if args.extra_body else {}
    if args.plot is not None:
        from loadgen.plot import require_matplotlib
        require_matplotlib()

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or first_model(args.base_url, headers, args.timeout)
    options = RequestOptions(base_url=args.base_url, model=model, endpoint=args.endpoint,
                             ignore_eos=args.ignore_eos, temperature=args.temperature,
                             timeout_s=args.timeout, extra_body=extra_body)
    progress = args.progress and sys.stderr.isatty()
    out = sys.stdout

    async def measure():
        if args.warmup:
            note(f"warming up with {args.warmup} request(s)")
            # A stream of its own, so the measured runs' prompts stay cold.
            warm = build(dataclasses.replace(workload, num_requests=args.warmup),
                         np.random.default_rng([args.seed, 1 << 20]))
            await run_load(warm, options, LoadPoint(max_concurrency=1), np.random.default_rng(0), headers=headers)
        runs = []
        for i, load in enumerate(loads):
            # Each run its own prompts: one run's prompts must not find the last one's in the prefix cache.
            specs = build(workload, np.random.default_rng([args.seed, i, 0]))
            runs.append(await run_load(specs, options, load, np.random.default_rng([args.seed, i, 1]),
                                       headers=headers, progress=progress))
            if not args.json:
                m = run_metrics(runs[-1], slo, percentiles)
                print(format_run(f"{model} @ {load.describe()}", m, slo, percentiles), file=out, flush=True)
        return runs

    runs = asyncio.run(measure())
    metrics = [run_metrics(run, slo, percentiles) for run in runs]
    goodput_rate = goodput(metrics) if slo.is_set else None
    plots = []
    if args.plot is not None:
        from loadgen.plot import plot_latencies
        plots = plot_latencies([(run.load.describe(), run) for run in runs], args.plot)
    if args.json:
        setup = {"base_url": args.base_url, "endpoint": args.endpoint, "model": model,
                 "workload": {"dataset": args.dataset_name, "dataset_path": args.dataset_path,
                              "num_requests": workload.num_requests, "prompt_len": str(workload.prompt_len),
                              "output_len": str(workload.output_len), "prompt_format": prompt_format,
                              "shared_prefix_ratio": workload.shared_prefix_ratio,
                              "num_prefixes": workload.num_prefixes, "ignore_eos": args.ignore_eos,
                              "temperature": args.temperature, "seed": args.seed},
                 "plots": [str(p) for p in plots]}
        json.dump(json_document(setup, slo, percentiles, metrics, goodput_rate), out, indent=2)
        out.write("\n")
    else:
        if len(metrics) > 1 or slo.is_set:
            print(format_sweep(metrics, slo, goodput_rate), file=out)
        for path in plots:
            print(f"wrote {path}", file=out)
    out.flush()

    failed_runs = [(run, m) for run, m in zip(runs, metrics) if m.completed == 0]
    for run, m in failed_runs:
        kind, count = next(iter(m.errors.items()))
        note(f"every request failed at {run.load.describe()}: {kind} x{count} ({m.error_examples[kind]})")
    return 1 if failed_runs else 0


def _sharegpt_builder(args: argparse.Namespace, prompt_format: str):
    """build_workload's stand-in for ShareGPT: the same (config, generator) in, requests out."""
    from loadgen.sharegpt import load_tokenizer, read_conversations, sharegpt_workload

    if not args.dataset_path or not args.tokenizer:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (the JSON file) and --tokenizer (the model "
                         "directory whose tokenizer counts the tokens)")
    pairs, tokenizer = read_conversations(args.dataset_path), load_tokenizer(args.tokenizer)
    return lambda config, rng: sharegpt_workload(pairs, tokenizer, config.num_requests, prompt_format, rng)


def first_model(base_url: str, headers: dict[str, str], timeout_s: float) -> str:
    """The first model of GET {base_url}/models."""
    import httpx

    url = base_url.rstrip("/") + "/models"
    try:
        response = httpx.get(url, headers=headers, timeout=min(timeout_s, 30.0))
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"cannot learn the model from {url} ({type(exc).__name__}: {exc}); "
                         f"is the server up? (or pass --model)") from None


def note(message: str) -> None:
    print(f"baton bench: {message}", file=sys.stderr, flush=True)


def _floats(text: str, flag: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated numbers, got {text!r}") from None
    if not values or any(math.isnan(v) for v in values):
        raise ValueError(f"{flag} takes comma-separated numbers, got {text!r}")
    return values


def _concurrencies(text: str | None) -> list[int | None]:
    if text is None:
        return [None]
    values = _floats(text, "--concurrency")
    if any(v != int(v) or v < 1 for v in values):
        raise ValueError(f"--concurrency takes whole numbers of at least 1, got {text!r}")
    return [int(v) for v in values]


def _int_pair(text: str, flag: str) -> tuple[int, int]:
    try:
        lo, hi = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"{flag} takes LO:HI, got {text!r}") from None
    return lo, hi


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--extra-body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("--extra-body must be a JSON object")
    return value

