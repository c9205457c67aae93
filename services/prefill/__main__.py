"""`python -m services.prefill --model DIR [--host 127.0.0.1] [--port 0] [--metrics-port 0] [--kv-blocks N]
[--max-num-batched-tokens N] [--max-num-seqs N] [--device auto|cpu|cuda[:N]] [--no-kv-checksum]
[--kvstore HOST:PORT] [--redis URL] [--instance-id ID]`

Runs through services/common/entrypoint.py: binds and prints `prefill listening on
HOST:PORT` (the line `baton up` reads) and `prefill metrics on HOST:PORT` (Prometheus'
/metrics: services/common/metrics/), then, while health reports NOT_SERVING,
loads the engine (its own private KV pool: the prompts in flight and the local
prefix cache) and warms it up with dummy prefill-only requests of several
lengths, whose held pages are then released; then SERVING. With --redis it then
heartbeats into the instance registry and publishes its prefix cache
(services/common/index_publisher.py). With --kvstore it stores the prefixes it reuses
on that kvstore node (services/prefill/host_tier.py). SIGTERM or SIGINT: it leaves the registry and
the index, health turns NOT_SERVING, in-flight calls get a grace period, the decode
pools it attached are unmapped and its KV channels closed, exit code 0. A bad
setting, an address that cannot be bound or an unloadable model exits 2 with one
line on stderr.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import services.common.grpc_env  # noqa: F401  (first: before anything imports grpc)
import services.common.openmp_env  # noqa: F401  (first: before torch loads OpenMP)
from services.common.entrypoint import run_service
from services.prefill.config import PrefillServiceConfig

if TYPE_CHECKING:
    from services.prefill.service import PrefillService


def prefill_service(config: PrefillServiceConfig) -> PrefillService:
    # torch and the engine are imported once the flags are read: `--help` or a bad flag answers in a tenth
    # of a second, not two and a half.
    from services.prefill.service import PrefillService

    return PrefillService(config)


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("prefill", PrefillServiceConfig.from_args, prefill_service, argv)


if __name__ == "__main__":
    sys.exit(main())
