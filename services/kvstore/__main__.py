"""`python -m services.kvstore [--host 127.0.0.1] [--port 0] [--capacity-bytes N]`

A kvstore node: the host-memory page tier (servicer.py) behind KVStore. Runs through
services/common/entrypoint.py like every service: prints `kvstore listening on
HOST:PORT`, is SERVING at once (nothing to load), and on SIGTERM or SIGINT stops
with a grace period and exits 0. A bad setting or an address that cannot be bound
exits 2 with one line on stderr.
"""
from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from protos import kvstore_pb2_grpc
from services.common.entrypoint import run_service
from services.kvstore.config import KVStoreNodeConfig
from services.kvstore.servicer import SERVICE_NAME, KVStoreNodeServicer


class KVStoreNode:
    service_names = [SERVICE_NAME]

    def __init__(self, config: KVStoreNodeConfig):
        self.config = config
        self.servicer = KVStoreNodeServicer(config.capacity_bytes)
        self.servicers = [(kvstore_pb2_grpc.add_KVStoreServicer_to_server, self.servicer)]

    async def start(self, stop: asyncio.Event) -> str | None:
        return f"serving a host page tier of {self.config.capacity_bytes} bytes"

    async def close(self) -> None:
        """The pages live in this process's memory: they go with it."""


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("kvstore", KVStoreNodeConfig.from_args, KVStoreNode, argv)


if __name__ == "__main__":
    sys.exit(main())
