"""`python -m services.decode --model DIR [--host 127.0.0.1] [--port 0] [--metrics-port 0] [--kv-blocks N]
[--max-num-seqs N] [--lease-ms MS] [--device auto|cpu|cuda[:N]] [--redis URL] [--instance-id ID]`

Serves Decode, and beside it on the same port KVStore (kv_receiver.py), through which
a prefill worker on another host streams pages into the reservations.

Runs through services/common/entrypoint.py: binds and prints `decode listening on
HOST:PORT` (the line `baton up` reads) and `decode metrics on HOST:PORT` (Prometheus'
/metrics: services/common/metrics/), then, while health reports NOT_SERVING,
loads the engine with its KV pool in a shared-memory segment this process owns
(on a GPU: in device memory, offered by its CUDA IPC handle), and warms it up with
dummy requests through reserve → add_prefilled_request → decode; then SERVING. With
--redis it then heartbeats its load and free pages into the instance registry and
publishes its prefix cache (services/common/index_publisher.py).
SIGTERM or SIGINT: it leaves the registry, health turns NOT_SERVING, in-flight calls get a grace period,
the segment is unlinked, exit code 0. A bad setting, an address that cannot be
bound or an unloadable model exits 2 with one line on stderr.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import services.common.grpc_env  # noqa: F401  (first: before anything imports grpc)
import services.common.openmp_env  # noqa: F401  (first: before torch loads OpenMP)
from services.common.entrypoint import run_service
from services.decode.config import DecodeServiceConfig

if TYPE_CHECKING:
    from services.decode.service import DecodeService


def decode_service(config: DecodeServiceConfig) -> DecodeService:
    # torch and the engine are imported once the flags are read: `--help` or a bad flag answers in a tenth
    # of a second, not two and a half.
    from services.decode.service import DecodeService

    return DecodeService(config)


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("decode", DecodeServiceConfig.from_args, decode_service, argv)


if __name__ == "__main__":
    sys.exit(main())
