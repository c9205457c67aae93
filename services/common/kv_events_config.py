"""Workers' --kv-events-config, vLLM's: a JSON object that turns on publishing the prefix cache's
changes over ZeroMQ (services/common/kv_event_publisher.py), for a KV-aware router outside Baton
(NVIDIA Dynamo's, llm-d's) that keeps its own copy of what each worker caches. Its keys and defaults
are vLLM's, so a configuration written for vLLM works here unchanged."""
from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace

from services.common.settings import ConfigError, json_object

PUBLISHERS = ("null", "zmq")
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: zmq when enabled, else null (as vLLM settles it)
    endpoint: str = "tcp://*:5557"  # bound where it names no host (*, ::) or is ipc/inproc; else connected to
    replay_endpoint: str | None = None  # a ROUTER socket answering "every batch from sequence number N"
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZeroMQ's high-water mark: batches a slow subscriber may fall behind before losing some
    max_queue_size: int = 100_000  # batches waiting to be sent, after which the engine's are dropped
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ConfigError(f"--kv-events-config: enable_kv_cache_events must be true or false, "
                              f"got {self.enable_kv_cache_events!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise ConfigError(f"--kv-events-config: publisher must be one of {', '.join(PUBLISHERS)}, "
                              f"got {self.publisher!r}")
        if not isinstance(self.topic, str):
            raise ConfigError(f"--kv-events-config: topic must be a string, got {self.topic!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.startswith(ENDPOINT_SCHEMES)):
                raise ConfigError(f"--kv-events-config: {name} must be a ZeroMQ address "
                                  f"({', '.join(ENDPOINT_SCHEMES)}...), got {value!r}")
        for name, least in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"--kv-events-config: {name} must be an integer >= {least}, got {value!r}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, given: str | None, source: str) -> KVEventsConfig | None:
        """The flag's JSON; None when not given; ConfigError naming `source` for a bad one."""
        parsed = json_object(given, source)
        if parsed is None:
            return None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(parsed) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**parsed)


def for_worker(config: KVEventsConfig, index: int) -> KVEventsConfig:
    """The config of the `index`th of several workers on one host given one config (`baton up`'s):
    each publishes on its own endpoints, TCP ports `index` above the given ones, as vLLM offsets
    its data-parallel ranks' (other endpoints take the suffix `-index`)."""
    def offset(endpoint: str | None) -> str | None:
        if endpoint is None or index == 0:
            return endpoint
        if endpoint.startswith("tcp://"):
            address, _, port = endpoint.rpartition(":")
            if port.isdigit():
                return f"{address}:{int(port) + index}"
        return f"{endpoint}-{index}"
    return replace(config, endpoint=offset(config.endpoint), replay_endpoint=offset(config.replay_endpoint))


def as_json(config: KVEventsConfig) -> str:
    return json.dumps(asdict(config))


def add_kv_events_flag(parser: argparse.ArgumentParser, env: Mapping[str, str], *, env_var: str) -> None:
    parser.add_argument("--kv-events-config", metavar="JSON", default=env.get(env_var) or None,
                        help='vLLM\'s: publish the prefix cache\'s changes (blocks stored, removed, all cleared) '
                             'over ZeroMQ for a KV-aware router, e.g. \'{"enable_kv_cache_events": true, '
                             f'"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}}\' (${env_var})')
