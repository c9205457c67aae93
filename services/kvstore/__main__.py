"""`python -m services.kvstore [--host 127.0.0.1] [--port 0] [--capacity-bytes SIZE] [--redis URL]
[--instance-id ID]`

A kvstore node: the host-memory page tier (servicer.py) behind KVStore. Runs through
services/common/entrypoint.py like every service: prints `kvstore listening on
HOST:PORT`, is SERVING at once (nothing to load). With --redis it heartbeats into the
instance registry (kind "kvstore") and publishes the blocks it stores to the prefix
index, and removes those it evicts, as prefill workers do with their caches
(services/common/index_publisher.py, tier_holdings.py). On SIGTERM or SIGINT it leaves
Redis, stops with a grace period and exits 0. A bad setting or an address that
cannot be bound exits 2 with one line on stderr.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import services.common.grpc_env  # noqa: F401  (first: before anything imports grpc)
from services.common.entrypoint import run_service
from services.kvstore.config import KVStoreNodeConfig

if TYPE_CHECKING:
    from services.kvstore.service import KVStoreNode


def kvstore_service(config: KVStoreNodeConfig) -> KVStoreNode:
    # torch (its pages' tensors) is imported once the flags are read: `--help` or a bad flag answers at once.
    from services.kvstore.service import KVStoreNode

    return KVStoreNode(config)


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("kvstore", KVStoreNodeConfig.from_args, kvstore_service, argv)


if __name__ == "__main__":
    sys.exit(main())
