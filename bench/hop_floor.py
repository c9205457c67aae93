"""The floor under bench/mesh_overhead.py: what the mesh's hops cost with none of Baton's service code on them.

    .venv/bin/python bench/hop_floor.py [--model DIR] [--prompt-tokens 512] [--requests 50]

The same path as a request through the mesh by the gRPC API, with nothing on it but the
hops and the engine: a client calls a relay (as the gateway), which asks a worker (as a
prefill worker); the worker hands the request to a thread that owns an `LLMEngine` (as
services/common/engine_loop.py does), which prefills a new prompt of --prompt-tokens token
ids and samples its first token; the worker sends back one message, which the relay
forwards to the client. No tokenizing, routing, validation, ledger or metrics. Each
process builds its server and channels as Baton's services do
(services/common/grpc_server.py, channel.py; uvloop; gRPC's I/O path as grpc_env.py sets it),
and every sample follows the same pause as mesh_overhead's.

Two ways for the relay to reach the worker are measured, alternating request by request:
- `call`: a new server-streaming call per request, as the gateway calls PrefillStream;
- `stream`: a message on one bidirectional stream the relay keeps open to the worker,
  replies matched to requests by number (a multiplexed session). A request's leg is
  then what it is on a call the gateway opened ahead of it (PrefillPreopened), as it
  sends most prompts.

Each figure is the p50 over requests of (time to the reply − the engine's time for that
request, add_request to the first token), in ms and in units of an empty gRPC round trip
(a health Check on the relay after the same pause: mesh_overhead's unit). mesh_overhead's
overhead less hops_stream is what Baton's own code on the path costs (less hops_call
with the gateway's `--prefill-calls new`). The last line of output is one JSON object
with every figure.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import queue
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

# Sets GRPC_EXPERIMENTS for the relay and worker processes this starts (this process's gRPC read it
# on `import grpc`, above): the floor's hops take the I/O path the services' take.
import services.common.grpc_env  # noqa: E402, F401
from bench.mesh_overhead import KV_BLOCKS, client_channel, random_prompts  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.demo_model import ensure_demo_model  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from services.common.channel import make_channel  # noqa: E402
from services.common.grpc_server import make_server  # noqa: E402

SETTLE_S = 0.3  # as bench/mesh_overhead.py
SERVICE = "baton.bench.Hops"
REPLY = struct.Struct("<Qd")  # request number, the worker's engine seconds


class EngineThread:
    """One thread that owns an engine and prefills a new random prompt per job, its time to the
    first token handed back to the event loop by call_soon_threadsafe: the shape of
    services/common/engine_loop.py."""

    def __init__(self, model_dir: str, prompt_tokens: int, device: str = "cpu"):
        self.engine = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=KV_BLOCKS, device=device))
        self.prompts = random_prompts(10_000, prompt_tokens, self.engine.model_config.vocab_size, seed=2)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True).start()

    def submit(self, loop: asyncio.AbstractEventLoop, done) -> None:
        self.jobs.put((loop, done))

    def _run(self) -> None:
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        for number, prompt in enumerate(self.prompts):
            loop, done = self.jobs.get()
            start = time.perf_counter()
            self.engine.add_request(f"hop-{number}", prompt, params)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            loop.call_soon_threadsafe(done, time.perf_counter() - start)


async def serve_worker(model_dir: str, prompt_tokens: int, device: str) -> None:
    engine_thread = EngineThread(model_dir, prompt_tokens, device)

    async def prefilled(number: int) -> bytes:
        loop = asyncio.get_running_loop()
        seconds = loop.create_future()
        engine_thread.submit(loop, seconds.set_result)
        return REPLY.pack(number, await seconds)

    async def per_call(request: bytes, context):
        yield await prefilled(REPLY.unpack(request)[0])

    async def session(requests, context):
        replies: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            async for request in requests:
                task = asyncio.ensure_future(prefilled(REPLY.unpack(request)[0]))
                task.add_done_callback(lambda t: replies.put_nowait(t.result()))
        reader = asyncio.ensure_future(read())
        try:
            while True:
                yield await replies.get()
        finally:
            reader.cancel()

    await _serve({"PerCall": grpc.unary_stream_rpc_method_handler(per_call),
                  "Session": grpc.stream_stream_rpc_method_handler(session)})


async def serve_relay(worker_address: str) -> None:
    channel = make_channel(worker_address)
    per_call = channel.unary_stream(f"/{SERVICE}/PerCall")
    outgoing: asyncio.Queue = asyncio.Queue()
    waiting: dict[int, asyncio.Future] = {}

    async def requests():
        while True:
            yield await outgoing.get()
    session = channel.stream_stream(f"/{SERVICE}/Session")(requests())

    async def route_replies() -> None:
        async for reply in session:
            waiting.pop(REPLY.unpack(reply)[0]).set_result(reply)
    replies = asyncio.ensure_future(route_replies())

    async def by_call(request: bytes, context):
        async for reply in per_call(request):
            yield reply

    async def by_stream(request: bytes, context):
        reply = asyncio.get_running_loop().create_future()
        waiting[REPLY.unpack(request)[0]] = reply
        outgoing.put_nowait(request)
        yield await reply

    try:
        await _serve({"ByCall": grpc.unary_stream_rpc_method_handler(by_call),
                      "ByStream": grpc.unary_stream_rpc_method_handler(by_stream)})
    finally:
        replies.cancel()


async def _serve(handlers: dict) -> None:
    server, port = await make_server([], [SERVICE])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    await server.start()
    print(f"127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def start(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, __file__, *args], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


@contextmanager
def running(model_dir: Path, prompt_tokens: int, device: str = "cpu") -> Iterator[str]:
    """A worker (its engine on `device`) and a relay in front of it, each its own process; yields the
    relay's address and stops both."""
    procs = []
    try:
        worker, worker_address = start("--role", "worker", "--model", str(model_dir),
                                       "--prompt-tokens", str(prompt_tokens), "--device", device)
        procs.append(worker)
        relay, relay_address = start("--role", "relay", "--worker", worker_address)
        procs.append(relay)
        yield relay_address
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(10)


def measure(relay_address: str, requests: int, warmup: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {"rtt": [], "call": [], "stream": []}
    with client_channel(relay_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        relays = {"call": channel.unary_stream(f"/{SERVICE}/ByCall"),
                  "stream": channel.unary_stream(f"/{SERVICE}/ByStream")}
        number = 0
        for i in range(requests + warmup):
            for name in samples:
                time.sleep(SETTLE_S)
                start = time.perf_counter()
                if name == "rtt":
                    health.Check(health_pb2.HealthCheckRequest())
                    seconds = time.perf_counter() - start
                else:
                    number += 1
                    reply = next(relays[name](REPLY.pack(number, 0.0)))
                    seconds = time.perf_counter() - start - REPLY.unpack(reply)[1]
                if i >= warmup:
                    samples[name].append(seconds)
    return samples


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the demo model)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--device", default="cpu", help="where the worker's engine computes: cpu, cuda or cuda:N")
    parser.add_argument("--role", choices=["worker", "relay"], help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role is not None:
        import uvloop

        uvloop.run(serve_worker(str(args.model), args.prompt_tokens, args.device) if args.role == "worker"
                   else serve_relay(args.worker))
        return 0

    model_dir = args.model or ensure_demo_model()
    with running(model_dir, args.prompt_tokens, args.device) as relay_address:
        samples = measure(relay_address, args.requests, args.warmup)
    p50_ms = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
    rtt_ms = p50_ms.pop("rtt")
    for name, what in (("call", "a new call per request"), ("stream", "a message on an open stream")):
        print(f"client -> relay -> worker -> relay -> client, the relay reaching the worker by {what}: "
              f"{p50_ms[name]:.2f} ms beyond the worker's engine = {p50_ms[name] / rtt_ms:.2f} empty round trips "
              f"of {rtt_ms:.3f} ms")
    figures = {"rtt_ms": round(rtt_ms, 4), "requests": args.requests, "prompt_tokens": args.prompt_tokens}
    for name, ms in p50_ms.items():
        figures[f"hops_{name}_ms"] = round(ms, 3)
        figures[f"hops_{name}_rtt_units"] = round(ms / rtt_ms, 2)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
