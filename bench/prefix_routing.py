"""What prefix-aware routing buys: prefix-cache hit rate and TTFT with 2 prefill workers
under prefix-aware, load-only and random routing, and TTFT with the prefix cache on
against off.

    .venv/bin/python bench/prefix_routing.py [--model DIR] [--requests 200] [--concurrency 8]
                                             [--kv-blocks N] [--overlap-weight W] [--quick]

- Routing: a real mesh (`baton up --prefill 2 --decode 1`, with its own Redis, so the
  prefill workers publish what they cache and the gateway's router reads it), started
  afresh for each policy (`BATON_ROUTING=prefix|load|random`) so that every policy
  begins with empty caches. Every request goes through a prefill worker
  (`BATON_LOCAL_PREFILL_MAX_TOKENS=0`). The workload is the same for all three: 8
  system prompts of --system-tokens random token ids, each request one of them (drawn
  with a fixed seed) plus a user suffix of 16-32 new ids, --requests requests by
  --concurrency clients at once, streamed through the OpenAI completions API with
  max_tokens 4. TTFT is the time to the first streamed chunk; the hit rate is
  Σ usage.prompt_tokens_details.cached_tokens / Σ prompt_tokens, over all requests and
  over the requests after the first of their system prompt (the first must miss).
- The prefill workers' pools are sized (BATON_PREFILL_KV_BLOCKS; default: half the
  system prompts' pages plus 3 pages per client, 4 x 69 + 8 x 3 = 300) so that one
  worker can hold only about half the system prompts: the regime routing is for. With
  pools that hold every prompt, every policy ends up hitting after the first round.
  The router counters printed per policy are the gateway's baton_router_* metrics over
  the run (decisions: prefix = the chosen worker held part of the prompt, spread = no worker
  held half of it and the one with the fewest blocks routed lately took it, load = it
  held none, balance = the imbalance guard chose; none are kept for load-only).
- Cache on against off: TTFT of a --shared-tokens prompt (default 2000, a RAG document)
  that shares its first 90 % with a prompt sent just before it, through a mesh with
  prefill's prefix cache on and one with it off (BATON_PREFILL_PREFIX_CACHING=0); p50
  over --shared-repeats fresh pairs each. cache_on_over_off = p50(on) / p50(off), on
  --shared-model: by default a random-weight Llama shaped like the models people serve
  rather than like the demo model (2048 wide, MLP 3.5x as in Llama 3, 16 query and 2 KV
  heads, 2 layers: 140 M parameters, made once under ~/.cache/baton/). Why not the demo
  model: it is 256 wide, so attention over the cached 90 % costs as much as a third of
  the new tokens' matmuls (attention grows with context x width, matmuls with width^2),
  and its whole prefill takes 80-150 ms here, so the costs every request pays cached or
  not (HTTP, the gRPC hops, the KV handoff of every page: 5-15 ms) weigh as much as the
  cache does. In-process, with no mesh, the shared model's ratio is 0.12-0.13 at 2000
  tokens (0.14-0.17 at 1100: the 10 % left is then too few rows for the matmuls to run at
  full speed on this CPU). The demo model's ratio is printed too (cache_on_over_off_demo,
  on the prefix-routing mesh after its run against a mesh with the cache off).

Targets (issue 4): hit rate (prefix-aware) >= 90 %; ttft_p50_speedup_vs_random =
p50(random) / p50(prefix-aware) >= 3; cache_on_over_off <= 1/6. The last line of
output is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.local_mesh import LocalMesh, log  # noqa: E402
from engine.demo_model import ensure_demo_model  # noqa: E402

POLICIES = ("prefix", "load", "random")
NUM_SYSTEM_PROMPTS = 8
SUFFIX_TOKENS = (16, 32)
MAX_TOKENS = 4
BLOCK_SIZE = 16  # the engine's page size (engine/config.py)
# The default --shared-model (see the docstring): its 2000-token prefill takes about 2 s here.
SHARED_MODEL_DIMS = {"hidden_size": 2048, "intermediate_size": 7168, "num_layers": 2, "num_heads": 16,
                     "num_kv_heads": 2}
SHARED_MODEL_DIR = Path("~/.cache/baton/bench-model-2048x2")
PUBLISH_WAIT_S = 1.0  # > the publisher's 0.25 s interval and the router's 1 s instance refresh
SETTLE_S = 0.3


def percentile_ms(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] * 1e3


def router_metrics(mesh: LocalMesh) -> dict[str, float]:
    """The gateway's routing counters (decisions by kind, matched and routed blocks, failed
    prefix-index lookups)."""
    text = httpx.get(f"http://{mesh.http}/metrics", timeout=10).text
    figures = {}
    for match in re.finditer(r'^baton_router_(requests_total\{decision="(\w+)"\}|matched_blocks_total|'
                             r'prompt_blocks_total|redis_failures_total) (\S+)$', text, re.MULTILINE):
        figures[match.group(2) or match.group(1)] = float(match.group(3))
    return figures


@dataclass
class Result:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


async def complete(client: httpx.AsyncClient, mesh: LocalMesh, prompt: list[int]) -> Result:
    """One streamed completion: seconds to its first chunk, and its usage."""
    body = {"model": mesh.model_name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    start = time.perf_counter()
    first, usage = None, None
    async with client.stream("POST", f"http://{mesh.http}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if first is None:
                first = time.perf_counter() - start
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            usage = chunk.get("usage") or usage
    return Result(first, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"])


def make_workload(args, vocab_size: int) -> tuple[list[list[int]], list[tuple[int, list[int]]]]:
    """The system prompts, and the requests as (system prompt index, suffix): the same for every policy."""
    rng = random.Random(args.seed)
    systems = [[rng.randrange(4, vocab_size) for _ in range(args.system_tokens)] for _ in range(NUM_SYSTEM_PROMPTS)]
    requests = [(rng.randrange(NUM_SYSTEM_PROMPTS),
                 [rng.randrange(4, vocab_size) for _ in range(rng.randint(*SUFFIX_TOKENS))])
                for _ in range(args.requests)]
    return systems, requests


async def warm_up(mesh: LocalMesh, vocab_size: int, n: int) -> None:
    """First calls are slow everywhere (allocations, lazy imports): a few short unrelated
    prompts, two at a time so both prefill workers get some, whatever the policy."""
    rng = random.Random(-1)
    async with httpx.AsyncClient(timeout=300) as client:
        for _ in range(n // 2):
            await asyncio.gather(*(complete(client, mesh, [rng.randrange(4, vocab_size) for _ in range(48)])
                                   for _ in range(2)))


async def run_workload(mesh: LocalMesh, systems: list[list[int]], requests: list[tuple[int, list[int]]],
                       concurrency: int) -> tuple[list[Result], list[int], float]:
    """The requests in order by `concurrency` clients; their results by request index, and the
    indices of the first request of each system prompt; wall seconds."""
    results: list[Result | None] = [None] * len(requests)
    queue = iter(range(len(requests)))

    async def client_loop(client: httpx.AsyncClient) -> None:
        for i in queue:
            system, suffix = requests[i]
            results[i] = await complete(client, mesh, systems[system] + suffix)

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=concurrency)) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    wall_s = time.perf_counter() - start
    seen: dict[int, int] = {}
    for i, (system, _) in enumerate(requests):
        seen.setdefault(system, i)
    return results, sorted(seen.values()), wall_s


def bench_policy(policy: str, model_dir: Path, num_prefill: int, kv_blocks: int, systems, requests, args,
                 vocab_size: int) -> tuple[dict, LocalMesh]:
    env = {"BATON_ROUTING": policy, "BATON_LOCAL_PREFILL_MAX_TOKENS": "0", "BATON_PREFILL_KV_BLOCKS": str(kv_blocks)}
    if args.overlap_weight is not None:
        env["BATON_ROUTER_OVERLAP_WEIGHT"] = str(args.overlap_weight)
    started = time.perf_counter()
    mesh = LocalMesh(model_dir, "--prefill", str(num_prefill), "--decode", "1", "--no-kvstore", env=env)
    try:
        log(f"[{policy}] mesh up in {time.perf_counter() - started:.1f} s at {mesh.http}")
        asyncio.run(warm_up(mesh, vocab_size, args.warmup))
        time.sleep(PUBLISH_WAIT_S)  # the router knows both workers' instance ids
        before = router_metrics(mesh)
        results, firsts, wall_s = asyncio.run(run_workload(mesh, systems, requests, args.concurrency))
        time.sleep(0.1)
        after = router_metrics(mesh)
    except BaseException:
        mesh.stop()
        raise
    routed = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    first_of_prompt = set(firsts)
    later = [r for i, r in enumerate(results) if i not in first_of_prompt]
    ttfts = [r.ttft_s for r in results]
    figures = {
        "hit_rate": sum(r.cached_tokens for r in results) / sum(r.prompt_tokens for r in results),
        "hit_rate_after_first": sum(r.cached_tokens for r in later) / sum(r.prompt_tokens for r in later),
        "ttft_p50_ms": percentile_ms(ttfts, 0.5), "ttft_p95_ms": percentile_ms(ttfts, 0.95),
        "requests_per_s": len(results) / wall_s,
        "routed": {k: int(v) for k, v in routed.items() if v},
    }
    log(f"[{policy}] {len(results)} requests at concurrency {args.concurrency}: hit rate "
        f"{figures['hit_rate']:.1%} (after the first of each prompt {figures['hit_rate_after_first']:.1%}); "
        f"TTFT p50 {figures['ttft_p50_ms']:.1f} ms, p95 {figures['ttft_p95_ms']:.1f} ms; "
        f"{figures['requests_per_s']:.2f} requests/s; router counters {figures['routed']}")
    return figures, mesh


def shared_prompt_ttft(mesh: LocalMesh, vocab_size: int, args, seed: int) -> list[float]:
    """TTFT of prompts 90 % shared with the one sent just before each, one pair at a time."""
    rng = random.Random(seed)
    shared = round(args.shared_tokens * 0.9)
    own = args.shared_tokens - shared

    async def pairs() -> list[float]:
        samples = []
        async with httpx.AsyncClient(timeout=300) as client:
            for _ in range(args.shared_repeats):
                prefix = [rng.randrange(4, vocab_size) for _ in range(shared)]
                await complete(client, mesh, prefix + [rng.randrange(4, vocab_size) for _ in range(own)])
                await asyncio.sleep(SETTLE_S)  # published, and the prefill worker's threads idle
                result = await complete(client, mesh, prefix + [rng.randrange(4, vocab_size) for _ in range(own)])
                samples.append(result.ttft_s)
                await asyncio.sleep(SETTLE_S)
        return samples

    return asyncio.run(pairs())


def shared_prompt_ttft_on_fresh_mesh(model_dir: Path, num_prefill: int, caching: bool, kv_blocks: int,
                                     args) -> list[float]:
    """`shared_prompt_ttft` through a mesh of its own on `model_dir`, prefix cache on or off."""
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    mesh = LocalMesh(model_dir, "--prefill", str(num_prefill), "--decode", "1", "--no-kvstore",
                     env={"BATON_LOCAL_PREFILL_MAX_TOKENS": "0", "BATON_PREFILL_PREFIX_CACHING": str(int(caching)),
                          "BATON_PREFILL_KV_BLOCKS": str(kv_blocks)})
    try:
        asyncio.run(warm_up(mesh, vocab_size, args.warmup))
        return shared_prompt_ttft(mesh, vocab_size, args, seed=args.seed + 1)
    finally:
        mesh.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the demo model)")
    parser.add_argument("--requests", type=int, default=200, help="requests per routing policy")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1100, help="tokens of each system prompt")
    parser.add_argument("--kv-blocks", type=int, default=None,
                        help="each prefill worker's KV pool in pages; default: half the system prompts' pages "
                             "plus room for the requests in flight")
    parser.add_argument("--overlap-weight", type=float, default=None,
                        help="the prefix router's --router-overlap-weight (default: the gateway's own)")
    parser.add_argument("--shared-repeats", type=int, default=10, help="pairs timed for cache on against off")
    parser.add_argument("--shared-tokens", type=int, default=2000, help="tokens of the prompt timed cache on/off")
    parser.add_argument("--shared-model", type=Path, default=None,
                        help="model directory for cache on against off (default: a 140 M-parameter random-weight "
                             "Llama, made on first use)")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 40 requests, 3 shared-prompt pairs")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.shared_repeats = 40, 3
    model_dir = args.model or ensure_demo_model()
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompt_blocks = -(-args.system_tokens // BLOCK_SIZE)
    # Half the system prompts, plus each request in flight's own pages (its suffix and the
    # partial block before it); at most, a worker holds all in-flight requests at once.
    in_flight_blocks = args.concurrency * (-(-SUFFIX_TOKENS[1] // BLOCK_SIZE) + 1)
    kv_blocks = args.kv_blocks or NUM_SYSTEM_PROMPTS // 2 * prompt_blocks + in_flight_blocks
    log(f"model {model_dir}; {NUM_SYSTEM_PROMPTS} system prompts of {args.system_tokens} tokens "
        f"({prompt_blocks} pages each, {NUM_SYSTEM_PROMPTS * prompt_blocks} in all); 2 prefill workers of "
        f"{kv_blocks} pages each (~{kv_blocks / prompt_blocks:.1f} system prompts)")

    systems, requests = make_workload(args, vocab_size)
    by_policy: dict[str, dict] = {}
    for policy in POLICIES:
        figures, mesh = bench_policy(policy, model_dir, 2, kv_blocks, systems, requests, args, vocab_size)
        try:
            by_policy[policy] = figures
            if policy == "prefix":
                demo_on = shared_prompt_ttft(mesh, vocab_size, args, seed=args.seed + 1)
        finally:
            mesh.stop()

    demo_off = shared_prompt_ttft_on_fresh_mesh(model_dir, 2, False, kv_blocks, args)
    demo_on_ms, demo_off_ms = statistics.median(demo_on) * 1e3, statistics.median(demo_off) * 1e3
    shared_model = args.shared_model or ensure_demo_model(SHARED_MODEL_DIR.expanduser(), **SHARED_MODEL_DIMS)
    log(f"cache on against off on {shared_model}")
    cache_on, cache_off = (shared_prompt_ttft_on_fresh_mesh(shared_model, 1, caching, kv_blocks, args)
                           for caching in (True, False))
    on_ms, off_ms = statistics.median(cache_on) * 1e3, statistics.median(cache_off) * 1e3

    prefix, load, rand = (by_policy[p] for p in POLICIES)
    speedup_random = rand["ttft_p50_ms"] / prefix["ttft_p50_ms"]
    speedup_load = load["ttft_p50_ms"] / prefix["ttft_p50_ms"]
    log(f"prefix-aware against random: hit rate {prefix['hit_rate']:.1%} (target >= 90 %) against "
        f"{rand['hit_rate']:.1%}; TTFT p50 {speedup_random:.2f}x better (target >= 3x), "
        f"p95 {rand['ttft_p95_ms'] / prefix['ttft_p95_ms']:.2f}x; against load-only: TTFT p50 {speedup_load:.2f}x")
    log(f"a {args.shared_tokens}-token prompt 90 % shared with the previous one, p50 of {args.shared_repeats}: "
        f"TTFT {on_ms:.1f} ms with the prefix cache on, {off_ms:.1f} ms off: on/off {on_ms / off_ms:.3f} "
        f"(target <= {1 / 6:.3f}); on the demo model {demo_on_ms:.1f} against {demo_off_ms:.1f} ms: "
        f"{demo_on_ms / demo_off_ms:.3f}")
    figures = {"hit_rate": round(prefix["hit_rate"], 4), "ttft_p50_speedup_vs_random": round(speedup_random, 3),
               "cache_on_over_off": round(on_ms / off_ms, 4), "ttft_p50_speedup_vs_load": round(speedup_load, 3),
               "cache_on_over_off_demo": round(demo_on_ms / demo_off_ms, 4)}
    for policy, values in by_policy.items():
        figures |= {f"hit_rate_{policy}": round(values["hit_rate"], 4),
                    f"hit_rate_after_first_{policy}": round(values["hit_rate_after_first"], 4),
                    f"ttft_p50_ms_{policy}": round(values["ttft_p50_ms"], 2),
                    f"ttft_p95_ms_{policy}": round(values["ttft_p95_ms"], 2),
                    f"requests_per_s_{policy}": round(values["requests_per_s"], 3),
                    f"routed_{policy}": values["routed"]}
    figures |= {"ttft_shared_cache_on_ms": round(on_ms, 2), "ttft_shared_cache_off_ms": round(off_ms, 2),
                "ttft_shared_cache_on_ms_demo": round(demo_on_ms, 2),
                "ttft_shared_cache_off_ms_demo": round(demo_off_ms, 2),
                "shared_model": str(shared_model),
                "requests": args.requests, "concurrency": args.concurrency, "system_tokens": args.system_tokens,
                "shared_tokens": args.shared_tokens,
                "kv_blocks": kv_blocks}
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
