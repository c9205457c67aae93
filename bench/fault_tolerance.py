"""What a stalled process costs the mesh's clients: traffic through `baton up` while one of its
processes is frozen, against the same traffic with none frozen.

    .venv/bin/python bench/fault_tolerance.py [--model DIR] [--prefill 2] [--decode 2] [--clients 8]
        [--phase-s 30] [--freeze-s 15] [--faults decode-0,prefill-0,...] [--seed 0]

A mesh of --prefill and --decode workers (with its tokenizer, kvstore node, Redis and gateway,
each its own process) serves --clients `openai` clients, each looping random requests: chat or
completion, streamed or not, of 10 to 400 random words and 20 to 80 greedy tokens (EOS ignored), and
one stream in five read for a few chunks and then closed (a client that went away, not an error).
Half the requests are of one of NUM_PROMPTS such prompts drawn once, whose texts read whole are
checked against the prompt's text as the mesh gave it before any traffic, one request at a time
(`wrong_texts` of `checked`: a request moved or prefilled again must read the same; KV written over
by another request's would not); the other half's prompts are new each time. The run
is in phases of --phase-s seconds (after 10 s of the same traffic, not counted), each started on a
settled mesh and ended by letting the requests in flight finish: a baseline with no fault, then one
phase per process in --faults (default: every process of the mesh but the second and later workers
of a kind, which the first stands for), that process SIGSTOPped 2 s in and SIGCONTed --freeze-s
later. SIGSTOP, not SIGKILL: `baton up` stops the whole mesh when one of its processes exits, and a
frozen process (swapped out, a stop-the-world pause, a host that stopped answering) is the fault its
peers cannot tell from a slow one. On a host with fewer cores than processes, a frozen worker's cores
go to the others: its phase may see more requests through than the baseline.

For each phase: requests completed, errors (by kind), texts not the prompt's greedy one, streams
closed early, the completed
requests' p50 / p99 / slowest time end to end, throughput against the baseline's
(`throughput_vs_baseline`), and what the gateway did about it (its counters' increase over the
phase: decode migrations, requests moved off a full decode worker, lost handoffs and prefill
retries, tokenizer fallbacks). After the last phase, every worker's KV pages in use, running
requests and waiting reservations, which should be 0 (`pages_leaked`: the decode workers' pages
in use). The last line of output is one JSON object with every figure; `errors_total` and
`wrong_texts_total` are those of all phases, baseline included.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.local_mesh import LocalMesh, log  # noqa: E402
from engine.demo_model import ensure_demo_model  # noqa: E402
from loadgen.metrics import summarize  # noqa: E402

FREEZE_AT_S = 2.0
WARMUP_S = 10.0  # of the same traffic, not counted: the baseline would carry the mesh's first requests
SETTLE_S = 3.0  # between phases: a thawed worker's health watch and the registry's heartbeats catch up
REQUEST_TIMEOUT_S = 120.0
CUT_SHARE = 0.2  # of streams, read for a few chunks and closed
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta")
NUM_PROMPTS = 12
# The gateway's counters of what it did for requests whose workers failed them (services/gateway/).
GATEWAY_COUNTERS = {"migrations": "baton_gateway_decode_migrations",
                    "full_decode_moves": "baton_gateway_full_decode_moves",
                    "lost_handoffs": "baton_gateway_lost_handoffs",
                    "prefill_retries": "baton_gateway_prefill_retries",
                    "tokenizer_fallbacks": "baton_gateway_tokenizer_fallbacks"}
# Pages a stalled copy holds (baton_kv_pages_fenced) are among the used ones, named apart.
LEAK_GAUGES = ("baton_kv_pages_used", "baton_requests_running", "baton_kv_reserves_waiting", "baton_kv_pages_fenced")


@dataclass(frozen=True)
class Prompt:
    text: str
    max_tokens: int


@dataclass
class PhaseResult:
    seconds: list[float] = field(default_factory=list)  # each completed request's, end to end
    errors: collections.Counter = field(default_factory=collections.Counter)
    texts: list[tuple[tuple[int, bool], str]] = field(default_factory=list)  # (checked prompt, is_chat), text
    num_cut: int = 0


def random_prompt(rng: random.Random) -> Prompt:
    return Prompt(" ".join(rng.choice(WORDS) for _ in range(rng.choice((10, 100, 400)))), rng.randint(20, 80))


async def request_text(client: openai.AsyncOpenAI, model: str, prompt: Prompt, is_chat: bool, stream: bool,
                       cut_after: int | None = None) -> str | None:
    """The greedy reply's text (None: the stream was closed after `cut_after` chunks)."""
    common = dict(model=model, max_tokens=prompt.max_tokens, stream=stream, temperature=0,
                  extra_body={"ignore_eos": True})
    if is_chat:
        response = await client.chat.completions.create(messages=[{"role": "user", "content": prompt.text}],
                                                        **common)
    else:
        response = await client.completions.create(prompt=prompt.text, **common)
    if not stream:
        choice = response.choices[0]
        return choice.message.content if is_chat else choice.text
    pieces = []
    async for chunk in response:
        if chunk.choices:
            pieces.append((chunk.choices[0].delta.content if is_chat else chunk.choices[0].text) or "")
        if cut_after is not None and len(pieces) >= cut_after:
            await response.close()
            return None
    return "".join(pieces)


async def one_request(client: openai.AsyncOpenAI, model: str, prompts: list[Prompt], rng: random.Random,
                      result: PhaseResult) -> None:
    index = rng.randrange(len(prompts)) if rng.random() < 0.5 else None  # None: a new prompt, unchecked
    prompt = prompts[index] if index is not None else random_prompt(rng)
    is_chat, stream = rng.random() < 0.5, rng.random() < 0.5
    cut_after = rng.randint(1, 5) if stream and rng.random() < CUT_SHARE else None
    start = time.perf_counter()
    try:
        text = await request_text(client, model, prompt, is_chat, stream, cut_after)
    except openai.APIError as e:
        result.errors[f"{type(e).__name__}: {str(e)[:120]}"] += 1
        return
    if text is None:
        result.num_cut += 1
        return
    result.seconds.append(time.perf_counter() - start)
    if index is not None:
        result.texts.append(((index, is_chat), text))


async def reference_texts(mesh: LocalMesh, prompts: list[Prompt]) -> dict[tuple[int, bool], str]:
    """Each prompt's greedy text, chat and completion, one request at a time on the mesh at rest."""
    async with openai.AsyncOpenAI(base_url=f"http://{mesh.http}/v1", api_key="none", max_retries=0,
                                  timeout=REQUEST_TIMEOUT_S) as client:
        return {(index, is_chat): await request_text(client, mesh.model_name, prompt, is_chat, stream=False)
                for index, prompt in enumerate(prompts) for is_chat in (False, True)}


async def traffic(mesh: LocalMesh, prompts: list[Prompt], num_clients: int, seconds: float, seed: int,
                  fault_pid: int | None, freeze_s: float) -> PhaseResult:
    """`num_clients` looping requests for `seconds` (those in flight then finish), `fault_pid` frozen from
    FREEZE_AT_S for `freeze_s`."""
    result = PhaseResult()
    end = time.monotonic() + seconds

    async def loop(i: int) -> None:
        client = openai.AsyncOpenAI(base_url=f"http://{mesh.http}/v1", api_key="none", max_retries=0,
                                    timeout=REQUEST_TIMEOUT_S)
        rng = random.Random(seed * 1000 + i)
        async with client:
            while time.monotonic() < end:
                await one_request(client, mesh.model_name, prompts, rng, result)

    async def freeze() -> None:
        await asyncio.sleep(FREEZE_AT_S)
        os.kill(fault_pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(freeze_s)
        finally:
            os.kill(fault_pid, signal.SIGCONT)

    tasks = [loop(i) for i in range(num_clients)] + ([freeze()] if fault_pid is not None else [])
    await asyncio.gather(*tasks)
    return result


def gateway_counts(client: httpx.Client, mesh: LocalMesh) -> dict[str, float]:
    """The gateway's GATEWAY_COUNTERS now, each summed over its labels."""
    counts = dict.fromkeys(GATEWAY_COUNTERS, 0.0)
    by_name = {name: key for key, name in GATEWAY_COUNTERS.items()}
    for family in text_string_to_metric_families(client.get(f"http://{mesh.http}/metrics").text):
        if family.name in by_name:
            counts[by_name[family.name]] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return counts


def leftovers(client: httpx.Client, mesh: LocalMesh) -> dict[str, dict[str, float]]:
    """Each prefill and decode worker's LEAK_GAUGES now."""
    found = {}
    for name, address in mesh.metrics_addresses.items():
        if not name.startswith(("prefill", "decode")):
            continue
        gauges = {}
        for family in text_string_to_metric_families(client.get(f"http://{address}/metrics").text):
            if family.name in LEAK_GAUGES:
                gauges[family.name] = sum(s.value for s in family.samples)
        found[name] = gauges
    return found


def phase_figures(result: PhaseResult, wall_s: float, counts: dict[str, float],
                  references: dict[tuple[int, bool], str]) -> dict:
    summary = summarize(result.seconds, (50, 99)) or {}
    return {"completed": len(result.seconds), "errors": sum(result.errors.values()), "error_kinds": dict(result.errors),
            "checked": len(result.texts), "wrong_texts": sum(text != references[key] for key, text in result.texts),
            "cut": result.num_cut, "requests_per_s": round(len(result.seconds) / wall_s, 3),
            **{name: round(summary[key], 3) if summary else None
               for name, key in (("p50_s", "p50"), ("p99_s", "p99"), ("slowest_s", "max"))},
            "gateway": {key: round(value) for key, value in counts.items() if value}}


def default_faults(mesh: LocalMesh) -> list[str]:
    """Every process but the second and later workers of a kind: one frozen prefill or decode worker
    stands for any of them."""
    return [name for name in mesh.pids if not re.search(r"-[1-9]\d*$", name)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the demo model)")
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--phase-s", type=float, default=30.0)
    parser.add_argument("--freeze-s", type=float, default=15.0)
    parser.add_argument("--faults", default=None, help="comma-separated process names, as baton up's table "
                        "lists them (default: all but the gateway's extra peers of one kind)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.freeze_s + FREEZE_AT_S > args.phase_s:
        parser.error("--freeze-s must end within the phase (--phase-s - 2)")
    model_dir = args.model or ensure_demo_model()
    mesh = LocalMesh(model_dir, "--prefill", str(args.prefill), "--decode", str(args.decode))
    try:
        faults = args.faults.split(",") if args.faults else default_faults(mesh)
        unknown = [name for name in faults if name not in mesh.pids]
        if unknown:
            parser.error(f"--faults: no process {', '.join(unknown)} (the mesh has {', '.join(mesh.pids)})")
        log(f"mesh up: {', '.join(f'{name} {pid}' for name, pid in mesh.pids.items())}")
        phases: dict[str, dict] = {}
        prompts = [random_prompt(random.Random(args.seed * 1000 + i)) for i in range(NUM_PROMPTS)]
        references = asyncio.run(reference_texts(mesh, prompts))
        asyncio.run(traffic(mesh, prompts, args.clients, WARMUP_S, args.seed - 1, None, 0))
        with httpx.Client(timeout=10) as http:
            for phase, fault in [("baseline", None), *((name, name) for name in faults)]:
                time.sleep(SETTLE_S)
                before, start = gateway_counts(http, mesh), time.monotonic()
                result = asyncio.run(traffic(mesh, prompts, args.clients, args.phase_s, args.seed + len(phases),
                                             mesh.pids[fault] if fault else None, args.freeze_s))
                wall_s = time.monotonic() - start
                after = gateway_counts(http, mesh)
                figures = phase_figures(result, wall_s, {k: after[k] - before[k] for k in after}, references)
                if phase != "baseline":
                    baseline = phases["baseline"]["requests_per_s"]
                    figures["throughput_vs_baseline"] = round(figures["requests_per_s"] / baseline, 3) if baseline \
                        else None
                phases[phase] = figures
                frozen = f"{fault} frozen {args.freeze_s:g} s" if fault else "nothing frozen"
                log(f"{phase:>10}: {frozen}; {figures['completed']} completed, {figures['errors']} errors"
                    + (f" {figures['error_kinds']}" if figures["error_kinds"] else "")
                    + f", {figures['wrong_texts']} wrong texts of {figures['checked']} checked, {figures['cut']} "
                    f"closed early; end to end p50 "
                    f"{figures['p50_s']} s, p99 {figures['p99_s']} s, slowest {figures['slowest_s']} s; "
                    f"{figures['requests_per_s']} requests/s"
                    + (f" ({figures['throughput_vs_baseline']}x the baseline's)" if fault else "")
                    + (f"; the gateway: {figures['gateway']}" if figures["gateway"] else ""))
            time.sleep(SETTLE_S)
            left = leftovers(http, mesh)
        is_up = mesh.proc.poll() is None
    finally:
        mesh.stop()
    pages_leaked = sum(gauges.get("baton_kv_pages_used", 0) for name, gauges in left.items()
                       if name.startswith("decode"))
    log(f"after the last phase: {json.dumps(left)}; the mesh {'still up' if is_up else 'had stopped'}")
    print(json.dumps({"errors_total": sum(p["errors"] for p in phases.values()),
                      "wrong_texts_total": sum(p["wrong_texts"] for p in phases.values()), "pages_leaked": pages_leaked,
                      "mesh_up": is_up, "phases": phases, "leftovers": left, "clients": args.clients,
                      "phase_s": args.phase_s, "freeze_s": args.freeze_s, "prefill": args.prefill,
                      "decode": args.decode}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
