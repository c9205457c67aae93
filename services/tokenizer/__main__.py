"""`python -m services.tokenizer --model DIR [--host 127.0.0.1] [--port 0]`

Binds first and prints `tokenizer listening on HOST:PORT` (the line `baton up`
reads), then loads the tokenizer while health reports NOT_SERVING, then SERVING.
SIGTERM or SIGINT: health turns NOT_SERVING, in-flight calls get a grace period,
exit code 0. A bad setting, an address that cannot be bound or an unloadable
model exits 2 with one line on stderr.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from grpc_health.v1 import health

from protos import tokenizer_pb2_grpc
from services.common.grpc_server import make_server, set_serving, stop_server
from services.tokenizer.config import ConfigError, TokenizerServiceConfig
from services.tokenizer.model_tokenizer import ModelTokenizer
from services.tokenizer.servicer import SERVICE_NAME, TokenizerServicer

log = logging.getLogger("baton.tokenizer")


async def serve(config: TokenizerServiceConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    servicer = TokenizerServicer()
    health_servicer = health.aio.HealthServicer()
    try:
        server, port = await make_server([(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, servicer)],
                                         [SERVICE_NAME], address=config.address,
                                         max_message_bytes=config.max_message_bytes,
                                         health_servicer=health_servicer, is_serving=False)
    except RuntimeError as e:  # the address is taken or cannot be bound
        print(f"tokenizer: {e}", file=sys.stderr, flush=True)
        return 2
    await server.start()
    print(f"tokenizer listening on {config.host}:{port}", flush=True)
    try:
        load = asyncio.create_task(asyncio.to_thread(
            ModelTokenizer.from_dir, config.model_dir, max_model_len=config.max_model_len))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait([load, stopping], return_when=asyncio.FIRST_COMPLETED)
        if load.done():
            try:
                servicer.tokenizer = load.result()
            except (OSError, ValueError) as e:
                print(f"tokenizer: cannot load {config.model_dir}: {e}", file=sys.stderr, flush=True)
                return 2
            await set_serving(health_servicer, [SERVICE_NAME], True)
            log.info("serving %s (context %s tokens)", config.model_dir, servicer.tokenizer.max_model_len)
            await stopping
        return 0
    finally:
        await stop_server(server, health_servicer, grace_s=config.grace_s)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = TokenizerServiceConfig.from_args(argv)
    except ConfigError as e:
        print(f"tokenizer: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop  # optional: faster event loop where installed
    except ImportError:
        return asyncio.run(serve(config))
    return uvloop.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
