"""`python -m services.prefill --model DIR [--host 127.0.0.1] [--port 0] [--kv-blocks N]
[--max-num-batched-tokens N] [--max-num-seqs N]`

Binds first and prints `prefill listening on HOST:PORT` (the line `baton up` reads),
then, while health reports NOT_SERVING, loads the engine (its own private KV pool:
the prompts in flight and the local prefix cache) and warms it up with dummy
prefill-only requests of several lengths, whose held pages are then released;
then SERVING. SIGTERM or SIGINT: health turns NOT_SERVING, in-flight calls get a
grace period, the decode pools it attached are unmapped, exit code 0. A bad
setting, an address that cannot be bound or an unloadable model exits 2 with one
line on stderr.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from grpc_health.v1 import health

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from protos import prefill_pb2_grpc
from services.common.engine_loop import EngineLoop
from services.common.grpc_server import make_server, set_serving, stop_server
from services.kvstore.layout import PageLayout
from services.prefill.config import ConfigError, PrefillServiceConfig
from services.prefill.servicer import SERVICE_NAME, PrefillServicer

log = logging.getLogger("baton.prefill")

# The sampler paths a first token can take: greedy, and seeded sampling with filters,
# penalties and logprobs.
WARMUP_PARAMS = (
    SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=2, temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, repetition_penalty=1.1,
                   presence_penalty=0.1, frequency_penalty=0.1, seed=0, ignore_eos=True, logprobs=2),
)


def load_engine(config: PrefillServiceConfig) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(config.model_dir), num_kv_blocks=config.num_kv_blocks,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len))


def warmup_lengths(engine: LLMEngine) -> list[int]:
    """One token, one block and a bit, and a prompt longer than one step's budget (chunked), where they fit."""
    limit = min(engine.max_model_len - 3, (engine.num_kv_blocks - 1) * engine.config.block_size)
    lengths = [1, engine.config.block_size + 1, engine.config.max_num_batched_tokens + 1]
    return sorted({n for n in lengths if n <= limit} | {1})


async def warm_up(engine_loop: EngineLoop, lengths: list[int]) -> None:
    """Dummy prefill-only requests of several lengths, batched together, their pages released."""
    for i, n in enumerate(lengths):
        streams = []
        for j, params in enumerate(WARMUP_PARAMS):
            request_id = f"warmup-{i}-{j}"
            prompt = [(7 * k + j) % 97 + 1 for k in range(n)]
            streams.append((request_id, await engine_loop.add_request(request_id, prompt, params, prefill_only=True)))
        for request_id, outputs in streams:
            while not (await outputs.get()).finished:
                pass
            await engine_loop.release(request_id)


async def serve(config: PrefillServiceConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    servicer = PrefillServicer()
    health_servicer = health.aio.HealthServicer()
    try:
        server, port = await make_server([(prefill_pb2_grpc.add_PrefillServicer_to_server, servicer)],
                                         [SERVICE_NAME], address=config.address,
                                         max_message_bytes=config.max_message_bytes,
                                         health_servicer=health_servicer, is_serving=False)
    except RuntimeError as e:  # the address is taken or cannot be bound
        print(f"prefill: {e}", file=sys.stderr, flush=True)
        return 2
    await server.start()
    print(f"prefill listening on {config.host}:{port}", flush=True)
    engine_loop: EngineLoop | None = None
    try:
        load = asyncio.create_task(asyncio.to_thread(load_engine, config))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait([load, stopping], return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            load.cancel()  # the thread finishes loading on its own; nothing it makes outlives the process
            return 0
        try:
            engine = await load
        except (OSError, ValueError) as e:
            print(f"prefill: cannot load {config.model_dir}: {e}", file=sys.stderr, flush=True)
            return 2
        pool_tensor = engine.runner.kv_pool.tensor
        layout = PageLayout.of_tensor(pool_tensor, engine.fingerprint)
        lengths = warmup_lengths(engine)
        servicer.attach(EngineLoop(engine), pool_tensor, layout, engine.model_config.vocab_size)
        engine_loop = servicer.engine_loop
        del engine
        engine_loop.start()
        await warm_up(engine_loop, lengths)
        await set_serving(health_servicer, [SERVICE_NAME], True)
        log.info("serving %s: %d local KV blocks; warmed up on prompts of %s tokens",
                 config.model_dir, layout.num_blocks, lengths)
        await stopping
        return 0
    finally:
        await stop_server(server, health_servicer, grace_s=config.grace_s)
        if engine_loop is not None:
            await asyncio.to_thread(engine_loop.stop)
        servicer.close()


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = PrefillServiceConfig.from_args(argv)
    except ConfigError as e:
        print(f"prefill: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop  # optional: faster event loop where installed
    except ImportError:
        return asyncio.run(serve(config))
    return uvloop.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
