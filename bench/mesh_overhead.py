"""What the mesh costs: TTFT through `baton up` against the in-process engine, and KV
transfer speed by shared memory and by the gRPC page stream.

    .venv/bin/python bench/mesh_overhead.py [--model DIR] [--prompt-tokens 512] [--requests 50] [--device cuda]

- TTFT: the same kind of 512-token prompt (token ids, each request a different one,
  so no prefix-cache hits anywhere) through a real mesh (gateway, tokenizer, 1
  prefill, 1 decode, each its own process) by its public gRPC API and by its OpenAI
  HTTP API, and through an `LLMEngine` in this process, alternating request by
  request (each round starting one later in the order) so all three see the same
  machine. overhead_ms is the p50, over the gRPC requests, of each one's TTFT minus
  the engine's own time to its first token in the prefill worker
  (`engine_ttft_seconds`: `prefill_admit` + `prefill_compute` in its ledger at the
  gateway's /v1/requests/{id}/timeline, its engine's `add_request` and its steps
  from scheduling to their outputs, as the engine thread stamped them): the in-process
  engine's TTFT, which times the same two calls, for that very prompt at that very
  moment. Why paired: one forward pass of the same prompt takes anywhere
  from 26 to 45 ms on this VM from one second to the next, and the difference of two
  p50s (p50(mesh, gRPC API) − p50(in-process), printed as overhead_unpaired_ms)
  moved by ±4 ms between runs of the same code, more than the overhead itself.
  http_overhead_ms is the same paired figure for the OpenAI HTTP API (streamed
  completions; http_overhead_unpaired_ms against the in-process engine), whose front
  end a colocated server pays as well. Its client is the standard library's, kept
  alive, not httpx: what a client library costs is not the mesh's (httpx added about
  1.3 ms here); the gRPC API's is grpcio's, reading its stream as it reads a unary
  call (`client_channel`). The *_rtt_units figures divide them by the p50 of an
  empty gRPC round trip (a health Check on the gateway's gRPC port) measured in the
  same rounds, after the same pause as each TTFT sample (rtt_ms). Why the pause: a
  round trip into processes that have been idle costs 3-4x one made back to back
  here (the host's and gRPC's poller wake-ups), and every hop of a TTFT sample is
  made into an idle process; the back-to-back figure is printed too
  (rtt_back_to_back_ms, *_back_to_back_rtt_units). ttst_grpc_p50_ms: from the first
  chunk to the second of the same gRPC requests (the KV handoff, the decode worker's
  first step and the hops between), p50.
- The floor under it, in the same rounds: bench/hop_floor.py's client → relay → worker
  (an engine thread) → relay → client, a message on an open stream, with no service
  code on the way (floor_ms: beyond its engine's time, p50; floor_rtt_units). The
  mesh's overhead less the floor of the same round, p50 over rounds
  (beyond_floor_ms, beyond_floor_rtt_units), is what Baton's own code on the path
  costs: on this VM the floor moves with the machine as the overhead does, the
  difference much less.
- KV transfer: --kv-mib of pages (64 MiB: nearly the demo decode pool, over several
  context-long reservations) copied from a private pool into real reservations in
  the mesh decode worker's shared-memory pool, as prefill writes them, against a
  plain memcpy of the same bytes between two buffers of this process
  (shm_vs_memcpy); and the same pages streamed into those reservations over gRPC
  (WritePages, 2 MiB chunks, CRC-32 on). Best of --repeats each, in GB/s; the
  shared-memory copy and the memcpy alternate round by round (the 64 MiB fit this
  host's L3, which neighbours share: taken one after the other, their ratio moved from
  0.47 to 0.89 between runs).

- On a GPU (--device cuda: every worker of the mesh, the in-process engine and the floor's on it),
  the KV pages go from a pool on the device into the decode worker's device pool by CUDA IPC, as a
  prefill worker on the host writes them, against a device-to-device copy of the same bytes in this
  process (cuda_ipc_vs_d2d, in place of the shared-memory figures); the gRPC stream sends them from
  the device.

The last line of output is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import itertools
import json
import random
import statistics
import sys
import time
from contextlib import closing
from pathlib import Path

import grpc
import grpc.experimental
import httpx
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.local_mesh import LocalMesh, log, streamed_ttft_stdlib  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.demo_model import ensure_demo_model  # noqa: E402
from engine.dtypes import TORCH_DTYPES  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from protos import common_pb2, decode_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc  # noqa: E402
from services.common.converters import layout_from_proto  # noqa: E402
from services.kvstore.cuda_ipc import CudaIpcTransport  # noqa: E402
from services.kvstore.grpc_stream import GrpcStreamSender  # noqa: E402
from services.kvstore.page_copy import block_runs, copy_pages  # noqa: E402
from services.kvstore.shared_memory import SharedKVPool  # noqa: E402
from services.kvstore.transport import KVDestination  # noqa: E402

KV_BLOCKS = 1024  # both sides: what the prefill and decode workers default to
SETTLE_S = 0.3
FIRST_TOKEN_PHASES = ("ingress", "tokenize", "route", "prefill_queue", "prefill_admit", "prefill_compute", "rpc",
                      "first_token")  # services/gateway/timeline.py's, up to the first token out


def engine_ttft_seconds(timeline: dict) -> float:
    """The prefill worker's engine time to a request's first token, from the gateway's ledger of
    it: its `add_request` and its steps, the two calls `inprocess_ttft` times."""
    phases = timeline["choices"][0]["phases_ms"]
    return (phases["prefill_admit"] + phases["prefill_compute"]) / 1e3


def p50_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def client_channel(address: str) -> grpc.Channel:
    """The benchmark client's channel to a gRPC API. Its streaming calls read their messages on the
    calling thread, as its unary ones (the empty round trip, the unit) always do: by default grpcio
    has a thread of its own poll a stream and wake the caller for each message, a client-side hand-off
    the unit does not pay (about 0.1 ms of every TTFT sample here, as the first chunk comes in)."""
    return grpc.insecure_channel(address, options=[(grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)])


def measure_rtt(address: str, n: int = 500) -> float:
    """p50 seconds of an empty unary gRPC call (health Check) from this process, back to back."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest()
        for _ in range(50):
            stub.Check(request)
        samples = []
        for _ in range(n):
            start = time.perf_counter()
            stub.Check(request)
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def grpc_ttft(stub: gateway_pb2_grpc.GenerateStub, prompt: list[int], request_id: str) -> tuple[float, float]:
    """The same through the gateway's public gRPC API: seconds to the first chunk, and from it
    to the second (the second token: the decode worker's first)."""
    request = gateway_pb2.GenerateRequest(
        request_id=request_id, token_ids=common_pb2.TokenIds(token_ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
        stream_options=gateway_pb2.StreamOptions(stream=True))
    start = time.perf_counter()
    call = stub.Generate(request, timeout=120)
    next(call)
    first = time.perf_counter()
    next(call)
    second = time.perf_counter()
    for _ in call:
        pass
    return first - start, second - first


def inprocess_ttft(engine: LLMEngine, request_id: str, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    first = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if first is None and any(out.new_token_ids for out in outputs):
            first = time.perf_counter() - start
    return first


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab_size) for _ in range(length)] for _ in range(n)]


def empty_round_trip(stub: health_pb2_grpc.HealthStub) -> float:
    start = time.perf_counter()
    stub.Check(health_pb2.HealthCheckRequest())
    return time.perf_counter() - start


def bench_ttft(mesh: LocalMesh, model_dir: Path, args) -> dict:
    """p50 TTFT through the HTTP API, through the gRPC API and in-process, of an empty gRPC
    round trip, and beyond the engine through bench/hop_floor.py's relay and worker (the
    same hops with no service code on them), the five alternating; every prompt is new
    (no prefix-cache hits)."""
    from bench import hop_floor  # here: it imports this module

    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=KV_BLOCKS, device=args.device))
    vocab = engine.model_config.vocab_size
    rounds = args.requests + args.warmup
    samples: dict[str, list[float]] = {"http": [], "grpc": [], "inprocess": [], "rtt": [], "floor": []}
    prompts = iter(random_prompts(len(samples) * rounds, args.prompt_tokens, vocab, seed=1))
    host, port = mesh.http.rsplit(":", 1)
    http_conn = http.client.HTTPConnection(host, int(port), timeout=120)
    with httpx.Client(timeout=120) as client, client_channel(mesh.grpc) as channel, closing(http_conn), \
            hop_floor.running(model_dir, args.prompt_tokens, args.device) as floor_relay_address, \
            client_channel(floor_relay_address) as floor_channel:
        stub = gateway_pb2_grpc.GenerateStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        floor_hops = floor_channel.unary_stream(f"/{hop_floor.SERVICE}/ByStream")
        request_ids: dict[str, list[str]] = {"http": [], "grpc": []}
        ttst: list[float] = []

        floor_numbers = itertools.count()  # the relay matches each reply to its request by number

        def floor_sample() -> float:
            start = time.perf_counter()
            reply = next(floor_hops(hop_floor.REPLY.pack(next(floor_numbers), 0.0)))
            return time.perf_counter() - start - hop_floor.REPLY.unpack(reply)[1]

        def grpc_sample(prompt: list[int]) -> float:
            request_ids["grpc"].append(f"mesh-overhead-{len(request_ids['grpc'])}")
            first, second = grpc_ttft(stub, prompt, request_ids["grpc"][-1])
            if len(request_ids["grpc"]) > args.warmup:
                ttst.append(second)
            return first

        def http_sample(prompt: list[int]) -> float:
            request_ids["http"].append(f"mesh-overhead-http-{len(request_ids['http'])}")
            return streamed_ttft_stdlib(http_conn, mesh, prompt, request_ids["http"][-1])

        measure = {"http": http_sample, "grpc": grpc_sample,
                   "inprocess": lambda p: inprocess_ttft(engine, f"local-{time.perf_counter_ns()}", p),
                   "rtt": lambda _: empty_round_trip(health), "floor": lambda _: floor_sample()}
        names = list(measure)
        for i in range(rounds):
            # Each round starts one later in the order, so no API always follows the same neighbour:
            # with a fixed order, the API sampled first had its prefill 12-20 ms longer in some runs
            # (cause not found), which the unpaired figures carried for that API alone.
            for name in names[i % len(names):] + names[:i % len(names)]:
                # A pause before each: OpenMP threads spin for a while after a parallel region,
                # and one side's spinning threads would steal the cores the other computes on.
                time.sleep(SETTLE_S)
                seconds = measure[name](next(prompts))
                if i >= args.warmup:
                    samples[name].append(seconds)
        # The prefill worker's engine time for each sample, from the gateway's ledger.
        timelines = {api: [client.get(f"http://{mesh.http}/v1/requests/{request_id}/timeline").json()
                           for request_id in ids[args.warmup:]] for api, ids in request_ids.items()}
    engine_s = {api: [engine_ttft_seconds(timeline) for timeline in kept] for api, kept in timelines.items()}
    admit_s = [timeline["choices"][0]["phases_ms"]["prefill_admit"] / 1e3 for timeline in timelines["grpc"]]
    # Where the gateway's own clock put the gRPC API's time to the first token, phase by phase.
    phases_ms = {phase: statistics.median(timeline["choices"][0]["phases_ms"][phase] for timeline in timelines["grpc"])
                 for phase in FIRST_TOKEN_PHASES}
    # The part of `rpc` that was the prompt's way to the prefill worker and the first token's way back.
    legs_ms = {leg: statistics.median(timeline["choices"][0]["rpc_legs_ms"][leg] for timeline in timelines["grpc"])
               for leg in ("to_prefill", "from_prefill")}
    rtt = samples.pop("rtt")
    floor = samples.pop("floor")
    paired = {api: [ttft - engine for ttft, engine in zip(samples[api], engine_s[api], strict=True)]
              for api in request_ids}
    return {"rtt_ms": p50_ms(rtt), "overhead_paired_ms": p50_ms(paired["grpc"]),
            "floor_ms": p50_ms(floor),
            "beyond_floor_ms": p50_ms([mesh - hops for mesh, hops in zip(paired["grpc"], floor, strict=True)]),
            "http_overhead_paired_ms": p50_ms(paired["http"]), "ttft_prefill_engine_p50_ms": p50_ms(engine_s["grpc"]),
            "prefill_admit_p50_ms": p50_ms(admit_s),
            "ttst_grpc_p50_ms": p50_ms(ttst), "first_token_phases_grpc_p50_ms": phases_ms,
            "rpc_legs_grpc_p50_ms": legs_ms,
            **{f"ttft_{name}_p50_ms": p50_ms(values) for name, values in samples.items()}}


def best_seconds(fn, repeats: int) -> float:
    return best_seconds_alternating([fn], repeats)[0]


def best_seconds_alternating(fns, repeats: int) -> list[float]:
    """The best time of each of `fns` over `repeats` rounds that run them one after another,
    so that each sees the same machine: 64 MiB fits this host's 300 MiB L3, shared with
    other tenants, and a copy's speed depends on how much of it is there at the moment."""
    for fn in fns:
        fn()  # warm: first-touch costs are not bandwidth
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def bench_transfer(mesh: LocalMesh, args) -> dict:
    """Pages into real reservations on the mesh's decode worker: by shared memory (this
    process maps its pool, as prefill does) and by the gRPC page stream. One reservation
    holds at most a context's pages, so --kv-mib spans several, written as one copy."""
    decode_address = mesh.addresses["decode-0"]
    with grpc.insecure_channel(decode_address) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        probe = stub.Reserve(decode_pb2.ReserveRequest(request_id="bench-probe", num_tokens=1), timeout=10)
        stub.Abort(decode_pb2.AbortRequest(request_id="bench-probe"), timeout=10)
        block_bytes = layout_from_proto(probe.layout, num_blocks=1).nbytes
        block_size = probe.layout.block_size
        max_model_len = httpx.get(f"http://{mesh.http}/v1/models").json()["data"][0]["max_model_len"]
        per_reservation = (max_model_len - 1) // block_size
        wanted = max(1, args.kv_mib * 2**20 // block_bytes)
        reservations = []
        try:
            while sum(len(r.block_ids) for r in reservations) < wanted:
                n = min(per_reservation, wanted - sum(len(r.block_ids) for r in reservations))
                try:
                    reservations.append(stub.Reserve(decode_pb2.ReserveRequest(
                        request_id=f"bench-kv-{len(reservations)}", num_tokens=n * block_size), timeout=10))
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or not reservations:
                        raise
                    break  # the pool is full: measure what it holds
            dst_blocks = [b for r in reservations for b in r.block_ids]
            layout = layout_from_proto(probe.layout, num_blocks=len(dst_blocks))
            src = torch.randn(layout.shape).to(TORCH_DTYPES[layout.dtype]).to(args.device)
            src_blocks = list(range(len(dst_blocks)))
            nbytes = src.numel() * src.element_size()
            # The same bytes between two plain buffers of this process, both already touched.
            flat_src = src.view(-1).view(torch.uint8)
            flat_dst = torch.empty_like(flat_src)
            flat_dst.zero_()
            if probe.cuda_ipc_handle:  # a pool on a GPU: written device to device, as prefill on the host does
                transport = CudaIpcTransport(layout)  # opened once, kept, as a prefill worker keeps it
                # One loop for every write, as a prefill worker has: a loop (and its executor's
                # thread) made per write would be timed as well.
                with closing(asyncio.new_event_loop()) as loop:
                    def write_by_ipc() -> None:
                        loop.run_until_complete(cuda_ipc_write(transport, probe, reservations, src, src_blocks))

                    ipc_s, d2d_s = best_seconds_alternating(
                        [write_by_ipc, lambda: (flat_dst.copy_(flat_src), torch.cuda.synchronize(flat_dst.device))],
                        args.repeats)
                copied = {"cuda_ipc_gbps": nbytes / ipc_s / 1e9, "d2d_gbps": nbytes / d2d_s / 1e9,
                          "cuda_ipc_vs_d2d": d2d_s / ipc_s}
            else:
                target = SharedKVPool.attach(probe.shm_name, layout)
                try:
                    shm_s, memcpy_s = best_seconds_alternating(
                        [lambda: copy_pages(src, src_blocks, target.tensor, dst_blocks),
                         lambda: flat_dst.copy_(flat_src)], args.repeats)
                finally:
                    target.close()
                copied = {"shm_gbps": nbytes / shm_s / 1e9, "memcpy_gbps": nbytes / memcpy_s / 1e9,
                          "shm_vs_memcpy": memcpy_s / shm_s}

            async def stream_all() -> None:
                sender = GrpcStreamSender(layout, checksum=True)
                try:
                    start = 0
                    for i, r in enumerate(reservations):
                        n = len(r.block_ids)
                        await sender.write(decode_address, src, src_blocks[start:start + n], request_id=f"bench-kv-{i}",
                                           reservation_id=r.reservation_id, dst_blocks=list(r.block_ids))
                        start += n
                finally:
                    await sender.close()
            stream_s = best_seconds(lambda: asyncio.run(stream_all()), max(1, args.repeats // 4))
        finally:
            for i in range(len(reservations)):
                stub.Abort(decode_pb2.AbortRequest(request_id=f"bench-kv-{i}"), timeout=10)
    # Runs of block ids consecutive on both ends: one slice copy per (layer, K/V, head) row each.
    return {"kv_bytes": nbytes, "kv_runs": len(block_runs(src_blocks, dst_blocks)), **copied,
            "grpc_stream_gbps": nbytes / stream_s / 1e9}


async def cuda_ipc_write(transport: CudaIpcTransport, probe, reservations, src: torch.Tensor,
                         src_blocks: list[int]) -> None:
    """`src_blocks` into the reservations' pages of the decode worker's GPU pool, by its CUDA IPC handle."""
    start = 0
    for r in reservations:
        dest = KVDestination(reservation_id=r.reservation_id, block_ids=tuple(r.block_ids),
                             cuda_ipc_handle=probe.cuda_ipc_handle)
        transport.open(dest)
        n = len(r.block_ids)
        await transport.write(r.reservation_id, src, src_blocks[start:start + n], dest, list(r.block_ids))
        start += n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the demo model)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--kv-mib", type=int, default=64,
                        help="KV bytes per transfer, in MiB (at most one full context's pages)")
    parser.add_argument("--repeats", type=int, default=20, help="transfers timed (the best counts)")
    parser.add_argument("--device", default="cpu",
                        help="where every engine computes and its KV pages live: cpu, cuda or cuda:N")
    args = parser.parse_args(argv)
    model_dir = args.model or ensure_demo_model()
    log(f"model {model_dir}; torch threads {torch.get_num_threads()}")

    mesh = LocalMesh(model_dir, "--device", args.device)
    try:
        log(f"mesh up: HTTP {mesh.http}, gRPC {mesh.grpc}; {mesh.addresses}")
        rtt_back_to_back_ms = measure_rtt(mesh.grpc) * 1e3
        log(f"empty gRPC round trip back to back p50 {rtt_back_to_back_ms:.3f} ms")
        ttft = bench_ttft(mesh, model_dir, args)
        rtt_ms = ttft.pop("rtt_ms")
        overhead_ms = ttft.pop("overhead_paired_ms")
        floor_ms, beyond_floor_ms = ttft.pop("floor_ms"), ttft.pop("beyond_floor_ms")
        http_overhead_ms = ttft.pop("http_overhead_paired_ms")
        unpaired_ms = ttft["ttft_grpc_p50_ms"] - ttft["ttft_inprocess_p50_ms"]
        http_unpaired_ms = ttft["ttft_http_p50_ms"] - ttft["ttft_inprocess_p50_ms"]
        log(f"TTFT p50 of {args.requests}, {args.prompt_tokens}-token prompts through the mesh by the gRPC API "
            f"{ttft['ttft_grpc_p50_ms']:.2f} ms, the prefill worker's engine {ttft['ttft_prefill_engine_p50_ms']:.2f} "
            f"ms of it: overhead {overhead_ms:.2f} ms (p50 per request) = {overhead_ms / rtt_ms:.2f} empty round "
            f"trips of {rtt_ms:.3f} ms after the same pause, target <= 2; {overhead_ms / rtt_back_to_back_ms:.2f} "
            f"back-to-back ones. In-process engine {ttft['ttft_inprocess_p50_ms']:.2f} ms: unpaired overhead "
            f"{unpaired_ms:.2f} ms = {unpaired_ms / rtt_ms:.2f} round trips. By the HTTP API "
            f"{ttft['ttft_http_p50_ms']:.2f} ms: overhead {http_overhead_ms:.2f} ms (p50 per request) = "
            f"{http_overhead_ms / rtt_ms:.2f} round trips; unpaired {http_unpaired_ms:.2f} ms). The second token "
            f"{ttft['ttst_grpc_p50_ms']:.2f} ms after the first (gRPC API, p50)")
        phases_ms = ttft.pop("first_token_phases_grpc_p50_ms")
        legs_ms = ttft.pop("rpc_legs_grpc_p50_ms")
        log("The gateway's ledger of those requests to their first token, p50 of each phase: "
            + ", ".join(f"{phase} {ms:.3f} ms" for phase, ms in phases_ms.items())
            + f"; of rpc, the prompt's way to the prefill worker {legs_ms['to_prefill']:.3f} ms and the first "
              f"token's way back {legs_ms['from_prefill']:.3f} ms")
        log(f"The same hops with no service code on them (bench/hop_floor.py, a message on an open stream): "
            f"{floor_ms:.2f} ms beyond their engine = {floor_ms / rtt_ms:.2f} round trips; the mesh's overhead "
            f"beyond them, paired round by round: {beyond_floor_ms:.2f} ms = {beyond_floor_ms / rtt_ms:.2f} "
            f"round trips (what Baton's own code on the path costs)")
        time.sleep(1.0)  # the in-process engine's OpenMP threads stop spinning first
        kv = bench_transfer(mesh, args)
        copied = (f"shared memory {kv['shm_gbps']:.2f} GB/s, plain memcpy {kv['memcpy_gbps']:.2f} GB/s, ratio "
                  f"{kv['shm_vs_memcpy']:.2f} (target >= 0.7" if "shm_gbps" in kv else
                  f"CUDA IPC {kv['cuda_ipc_gbps']:.1f} GB/s, device-to-device copy {kv['d2d_gbps']:.1f} GB/s, "
                  f"ratio {kv['cuda_ipc_vs_d2d']:.2f} (")
        log(f"KV transfer of {kv['kv_bytes'] / 2**20:.1f} MiB into the decode worker's reserved pages: {copied}; "
            f"{kv['kv_runs']} runs of consecutive blocks); gRPC stream (2 MiB chunks, CRC-32) "
            f"{kv['grpc_stream_gbps']:.3f} GB/s")
    finally:
        mesh.stop()
    figures = {"overhead_ms": round(overhead_ms, 3), "overhead_rtt_units": round(overhead_ms / rtt_ms, 2),
               "floor_ms": round(floor_ms, 3), "floor_rtt_units": round(floor_ms / rtt_ms, 2),
               "beyond_floor_ms": round(beyond_floor_ms, 3),
               "beyond_floor_rtt_units": round(beyond_floor_ms / rtt_ms, 2),
               "overhead_unpaired_ms": round(unpaired_ms, 3),
               "overhead_unpaired_rtt_units": round(unpaired_ms / rtt_ms, 2),
               "http_overhead_ms": round(http_overhead_ms, 3),
               "http_overhead_rtt_units": round(http_overhead_ms / rtt_ms, 2),
               "http_overhead_unpaired_ms": round(http_unpaired_ms, 3),
               **{key: round(kv[key], 3) for key in ("shm_vs_memcpy", "cuda_ipc_vs_d2d") if key in kv},
               "grpc_stream_gbps": round(kv["grpc_stream_gbps"], 3),
               **{key: round(kv[key], 2) for key in ("shm_gbps", "memcpy_gbps", "cuda_ipc_gbps", "d2d_gbps")
                  if key in kv},
               "kv_bytes": kv["kv_bytes"], "kv_runs": kv["kv_runs"], "rtt_ms": round(rtt_ms, 4),
               "rtt_back_to_back_ms": round(rtt_back_to_back_ms, 4),
               "overhead_back_to_back_rtt_units": round(overhead_ms / rtt_back_to_back_ms, 2),
               **{k: round(v, 3) for k, v in ttft.items()},
               "first_token_phases_grpc_p50_ms": {phase: round(ms, 3) for phase, ms in phases_ms.items()},
               "rpc_legs_grpc_p50_ms": {leg: round(ms, 3) for leg, ms in legs_ms.items()},
               "prompt_tokens": args.prompt_tokens, "requests": args.requests, "device": args.device}
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
