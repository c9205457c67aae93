"""What the gateway's front end costs per streamed token: its CPU time per server-sent event, for
SGLang's `/generate` (each event carries the whole answer so far) and the OpenAI completions API
(each a delta), against the decode worker's CPU time per token in the same streams.

    .venv/bin/python bench/stream_cpu.py [--model DIR] [--streams 4] [--tokens 1500] [--rounds 3] [--interval 8]

`baton up` serves the model (one prefill and one decode worker); each round runs `--streams`
greedy streams of `--tokens` tokens at once through one API, then through the other, and reads
each process's CPU time (user + system) from /proc before and after. The ratio
`gateway_per_decode_*` is the gateway's CPU per event over the decode worker's per token in the
same round: how much of a token's cost the front end adds, whatever the machine's speed.

A third series streams through `/generate` with SGLang's `stream_interval` of `--interval` tokens
(the gateway's `--stream-interval` for every request): `*_interval_vs_1` is the gateway's and the
decode worker's CPU per token there over the same at an interval of 1, in the same round. Two more
send the completions unstreamed: without stop strings (the decode worker sends the reply in one
chunk after its first token) and with one that never matches (one chunk per token, as the text is
looked at as it comes); `*_whole_vs_with_stop` is the first's CPU per token over the second's.
Figures are the median over rounds; the last line is their JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from local_mesh import LocalMesh, log

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.demo_model import ensure_demo_model  # noqa: E402

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
PROMPT = list(range(10, 30))
NEVER_MATCHED = "\u2603\u2603\u2603"  # not in the demo model's greedy text


def descendants(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return [p for child in children for p in (child, *descendants(child))]


def find_process(mesh: LocalMesh, module: str) -> int:
    for pid in descendants(mesh.proc.pid):
        if f"services.{module}" in Path(f"/proc/{pid}/cmdline").read_bytes().decode().replace("\0", " "):
            return pid
    raise RuntimeError(f"no services.{module} process under baton up")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def stream_sglang(mesh: LocalMesh, tokens: int, interval: int = 1) -> int:
    body = {"input_ids": PROMPT, "stream": True, "sampling_params": {
        "max_new_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream_interval": interval}}
    return _count_events(f"http://{mesh.http}/generate", body)


def stream_openai(mesh: LocalMesh, tokens: int) -> int:
    body = {"model": mesh.model_name, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    return _count_events(f"http://{mesh.http}/v1/completions", body)


def whole_openai(mesh: LocalMesh, tokens: int, stop: str | None = None) -> int:
    """A completion not streamed (one answer, counted as one event); with a `stop` string that never
    matches, its tokens come one chunk at a time (the text is looked at as it comes)."""
    body = {"model": mesh.model_name, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            **({"stop": [stop]} if stop is not None else {})}
    answer = httpx.post(f"http://{mesh.http}/v1/completions", json=body, timeout=600)
    answer.raise_for_status()
    assert answer.json()["usage"]["completion_tokens"] == tokens
    return 1


def _count_events(url: str, body: dict) -> int:
    events = 0
    with httpx.stream("POST", url, json=body, timeout=600) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            events += line.startswith("data: {")
    return events


def measure(stream, mesh: LocalMesh, pids: dict[str, int], streams: int, tokens: int) -> dict[str, float]:
    """CPU microseconds per event of the gateway, and per token of the decode worker, for one round."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    with ThreadPoolExecutor(streams) as pool:
        events = sum(pool.map(lambda _: stream(mesh, tokens), range(streams)))
    used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    return {"gateway_us_per_event": used["gateway"] / events * 1e6,
            "gateway_us_per_token": used["gateway"] / (streams * tokens) * 1e6,
            "decode_us_per_token": used["decode"] / (streams * tokens) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the demo model)")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--interval", type=int, default=8, help="the third series' stream_interval")
    args = parser.parse_args()
    chunked = f"sglang_interval_{args.interval}"
    mesh = LocalMesh(args.model or ensure_demo_model(), "--no-kvstore")
    try:
        pids = {"gateway": find_process(mesh, "gateway"), "decode": find_process(mesh, "decode")}
        stream_sglang(mesh, 50)  # warm both paths
        stream_openai(mesh, 50)
        rounds: dict[str, list[dict[str, float]]] = {"sglang": [], "openai": [], chunked: [], "whole": [],
                                                     "whole_with_stop": []}
        for _ in range(args.rounds):
            rounds["sglang"].append(measure(stream_sglang, mesh, pids, args.streams, args.tokens))
            rounds["openai"].append(measure(stream_openai, mesh, pids, args.streams, args.tokens))
            rounds[chunked].append(measure(lambda m, t: stream_sglang(m, t, args.interval), mesh, pids,
                                           args.streams, args.tokens))
            rounds["whole"].append(measure(whole_openai, mesh, pids, args.streams, args.tokens))
            rounds["whole_with_stop"].append(measure(lambda m, t: whole_openai(m, t, NEVER_MATCHED), mesh, pids,
                                                     args.streams, args.tokens))
    finally:
        mesh.stop()
    figures: dict[str, float] = {}
    for api in ("sglang", "openai", chunked):
        measured = rounds[api]
        gateway = statistics.median(m["gateway_us_per_event"] for m in measured)
        decode = statistics.median(m["decode_us_per_token"] for m in measured)
        ratio = statistics.median(m["gateway_us_per_event"] / m["decode_us_per_token"] for m in measured)
        log(f"{api}: gateway {gateway:.0f} us CPU per event, decode worker {decode:.0f} us per token, "
            f"ratio {ratio:.2f} ({args.streams} streams x {args.tokens} tokens, {args.rounds} rounds)")
        figures.update({f"gateway_us_per_event_{api}": round(gateway, 1),
                        f"decode_us_per_token_{api}": round(decode, 1), f"gateway_per_decode_{api}": round(ratio, 3)})
    for process in ("gateway", "decode"):
        for series, baseline, name, said in (
                (chunked, "sglang", "interval_vs_1", f"at stream_interval {args.interval} over that at 1"),
                ("whole", "whole_with_stop", "whole_vs_with_stop",
                 "of a reply not streamed over that of one with a stop string")):
            ratio = statistics.median(r[f"{process}_us_per_token"] / b[f"{process}_us_per_token"]
                                      for r, b in zip(rounds[series], rounds[baseline]))
            log(f"{process}: CPU per token {said}: {ratio:.2f}")
            figures[f"{process}_us_per_token_{name}"] = round(ratio, 3)
    for series in ("whole", "whole_with_stop"):
        figures[f"gateway_us_per_token_{series}"] = round(statistics.median(
            m["gateway_us_per_token"] for m in rounds[series]), 1)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
