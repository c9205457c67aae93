"""What watching the prefix cache costs an engine: vLLM's KV events published over ZeroMQ
(--kv-events-config) and its KV block residency metrics on every block (--kv-cache-metrics
--kv-cache-metrics-sample 1, the most they can cost).

    .venv/bin/python bench/cache_observability.py [--model DIR] [--rounds 7] [--prompts 32]

Three engines on the same model in this process, one plain, one whose prefix-cache changes are
handed after every step to a KVEventPublisher (encoded and sent on its own thread, as a worker's
are), one following every cached block's residency, each given a small pool (every round's new
prompts evict the last round's: events and evictions on every step) and run over the same new
prompts in turn, round by round, each round starting with a different engine, so all three see the
same machine. Printed: each one's p50 wall time for a round and the plain engine's throughput over
each of the others' (kv_events_throughput_ratio, kv_cache_metrics_throughput_ratio: 1.0 costs
nothing), and the events each round published.

The last line of output is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.local_mesh import log  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.demo_model import ensure_demo_model  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from services.common.kv_event_publisher import KVEventPublisher  # noqa: E402
from services.common.kv_events_config import KVEventsConfig  # noqa: E402

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def run_round(engine: LLMEngine, prompts: list[list[int]], publish=None) -> tuple[float, int]:
    """Seconds to finish every prompt, and the events handed to `publish`."""
    start = time.perf_counter()
    num_events = 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, PARAMS)
    while engine.has_unfinished_requests():
        engine.step()
        if publish is not None:
            events = engine.block_manager.take_kv_events()
            if events:
                publish(events)
                num_events += len(events)
    return time.perf_counter() - start, num_events


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the demo model)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    args = parser.parse_args(argv)
    model_dir = str(args.model or ensure_demo_model())

    def engine(sample: float = 0.0) -> LLMEngine:
        return LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=256, kv_cache_metrics_sample=sample))

    engines = {"plain": engine(), "kv_events": engine(), "kv_cache_metrics": engine(1.0)}
    publisher = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://bench-kv-events"),
                                 engines["kv_events"].config.block_size, "CPU")
    publisher.publish(engines["kv_events"].block_manager.enable_kv_events())
    vocab = engines["plain"].model_config.vocab_size
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    events_per_round = []
    order = list(engines)
    for r in range(args.rounds + 1):  # the first round warms up
        prompts = [[(7919 * (r * args.prompts + i) + 31 * j) % (vocab - 10) + 5 for j in range(args.prompt_tokens)]
                   for i in range(args.prompts)]
        for name in order[r % 3:] + order[: r % 3]:
            took, num_events = run_round(engines[name], prompts,
                                         publisher.publish if name == "kv_events" else None)
            if r:
                seconds[name].append(took)
                if name == "kv_events":
                    events_per_round.append(num_events)
        log(f"round {r}: " + ", ".join(f"{name} {s[-1] * 1e3:.0f} ms" for name, s in seconds.items() if s))
    publisher.close()
    p50 = {name: statistics.median(s) for name, s in seconds.items()}
    residency = engines["kv_cache_metrics"].block_manager.prefix_cache.residency
    figures = {
        "round_p50_ms": {name: round(s * 1e3, 1) for name, s in p50.items()},
        "kv_events_throughput_ratio": round(p50["plain"] / p50["kv_events"], 3),
        "kv_cache_metrics_throughput_ratio": round(p50["plain"] / p50["kv_cache_metrics"], 3),
        "kv_events_per_round": statistics.median(events_per_round),
        "evicted_blocks_measured": residency.lifetime.cumulative_buckets()[-1][1],
        "kv_events_dropped": publisher.num_dropped,
    }
    print(f"plain {p50['plain'] * 1e3:.0f} ms a round; with KV events {p50['kv_events'] * 1e3:.0f} ms "
          f"(x{figures['kv_events_throughput_ratio']}), with residency metrics on every block "
          f"{p50['kv_cache_metrics'] * 1e3:.0f} ms (x{figures['kv_cache_metrics_throughput_ratio']})")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
