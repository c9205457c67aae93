"""The kvstore node's settings: one frozen dataclass, built from CLI flags and
`BATON_*` environment variables in one place (`from_args`).

A node loads no model: it stores any model's pages, keyed by its fingerprint.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.common.kv_pool_flags import byte_count
from services.common.limits import DEFAULT_MAX_MESSAGE_BYTES
from services.common.settings import (
    DEFAULT_SHUTDOWN_GRACE_S,
    ENV_MAX_MESSAGE_BYTES,
    ConfigError as ConfigError,
    add_bind_flags,
    add_metrics_flag,
    add_registry_flags,
    add_shutdown_flag,
    add_tracing_flag,
    check_bind,
    check_metrics_port,
    check_positive,
    check_registry,
    env_int,
    new_parser,
)

ENV_HOST = "BATON_KVSTORE_HOST"
ENV_PORT = "BATON_KVSTORE_PORT"
ENV_CAPACITY_BYTES = "BATON_KVSTORE_CAPACITY_BYTES"
ENV_INSTANCE_ID = "BATON_KVSTORE_INSTANCE_ID"
ENV_METRICS_PORT = "BATON_KVSTORE_METRICS_PORT"

DEFAULT_CAPACITY_BYTES = 1 << 30
DEFAULT_DISK_CAPACITY_BYTES = 16 << 30
ENV_DISK_DIR = "BATON_KVSTORE_DISK_DIR"
ENV_DISK_CAPACITY_BYTES = "BATON_KVSTORE_DISK_CAPACITY_BYTES"


@dataclass(frozen=True)
class KVStoreNodeConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (the listening line says which)
    capacity_bytes: int = DEFAULT_CAPACITY_BYTES  # host memory for pages; least recently used go first
    disk_dir: str = ""  # a disk tier's directory (the node's own), where evicted pages go; "": none
    disk_capacity_bytes: int = DEFAULT_DISK_CAPACITY_BYTES  # the disk tier's bound; least recently used go first
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_s: float = DEFAULT_SHUTDOWN_GRACE_S  # after SIGTERM, how long in-flight calls may finish
    otlp_endpoint: str = ""  # OTLP gRPC collector for trace spans; "": as the OTEL_* variables say
    redis_url: str = ""  # "": no Redis; else the stored blocks go into the prefix index
    instance_id: str = ""  # "": kvstore-HOST-PORT once bound
    registry_ttl_s: float = 3.0  # heartbeat every third of it; silent longer: out of routing
    index_ttl_s: float = 30.0  # prefix-index entries, refreshed every third of it while stored
    metrics_port: int = 0  # Prometheus /metrics; 0: any free port (printed), -1: none
    model_dir: None = None  # no model (the entry point's contract)

    def __post_init__(self):
        check_bind(self.host, self.port, ENV_HOST)
        check_positive("--capacity-bytes", self.capacity_bytes)
        check_positive("--disk-capacity-bytes", self.disk_capacity_bytes)
        check_positive("--max-message-bytes", self.max_message_bytes)
        check_registry(self.redis_url, self.registry_ttl_s, self.index_ttl_s)
        check_metrics_port(self.metrics_port)
        if not self.grace_s >= 0:  # NaN too
            raise ConfigError(f"--shutdown-grace-s must be >= 0, got {self.grace_s}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
                  ) -> KVStoreNodeConfig:
        """Parse `argv` (default: sys.argv[1:]) over `env` (default: os.environ).
        Raises ConfigError for an invalid setting; argparse exits on a malformed flag."""
        env = os.environ if env is None else env
        parser = new_parser("kvstore")
        add_bind_flags(parser, env, env_host=ENV_HOST, env_port=ENV_PORT, model_help=None)
        # A size as the workers' --kv-cache-memory-bytes reads one (argparse reads a text default by it too).
        parser.add_argument("--capacity-bytes", type=byte_count, metavar="SIZE",
                            default=env.get(ENV_CAPACITY_BYTES) or DEFAULT_CAPACITY_BYTES,
                            help=f"host memory for pages, e.g. 4294967296, 4G or 4.3g (${ENV_CAPACITY_BYTES})")
        parser.add_argument("--disk-dir", metavar="DIR", default=env.get(ENV_DISK_DIR, ""),
                            help=f"a disk tier under host memory: pages it evicts are written here and read back "
                                 f"when asked for (the directory is the node's own: emptied at start) "
                                 f"(${ENV_DISK_DIR}; default none)")
        parser.add_argument("--disk-capacity-bytes", type=byte_count, metavar="SIZE",
                            default=env.get(ENV_DISK_CAPACITY_BYTES) or DEFAULT_DISK_CAPACITY_BYTES,
                            help=f"the disk tier's size, e.g. 64G (${ENV_DISK_CAPACITY_BYTES}; default 16G)")
        parser.add_argument("--max-message-bytes", type=int,
                            default=env_int(env, ENV_MAX_MESSAGE_BYTES, DEFAULT_MAX_MESSAGE_BYTES),
                            help=f"largest gRPC message sent or received (${ENV_MAX_MESSAGE_BYTES})")
        add_shutdown_flag(parser, env)
        add_registry_flags(parser, env, env_instance_id=ENV_INSTANCE_ID)
        add_metrics_flag(parser, env, env_metrics_port=ENV_METRICS_PORT)
        add_tracing_flag(parser)
        args = parser.parse_args(argv)
        return cls(host=args.host, port=args.port, capacity_bytes=args.capacity_bytes, disk_dir=args.disk_dir,
                   disk_capacity_bytes=args.disk_capacity_bytes,
                   max_message_bytes=args.max_message_bytes, redis_url=args.redis, instance_id=args.instance_id,
                   grace_s=args.shutdown_grace_s,
                   metrics_port=args.metrics_port, otlp_endpoint=args.otlp_endpoint)
