"""gRPC keepalive on the mesh's connections, both ends: a peer that stops answering without closing its
connection (a process frozen or swapped out, a host powered off or cut off the network) is found within
two keepalive periods, its calls then failing UNAVAILABLE, as a worker that died fails them.

Without it such a peer is found only by a call's deadline: a decode worker frozen mid-stream held its
requests for the whole of it (an hour), kept taking new ones (its health Watch stream never broke, so
routing never learned), and a gateway gone that way left a decode worker's streams, and their pages,
to run to their end. With it, the gateway's Watch of the worker breaks (out of routing), its streams
move to another decode worker (decode_moves.py) and a prompt not yet answered to another prefill worker;
a worker sees its calls from a gateway gone cancelled, and frees their pages.

Pings go only on connections with calls open (the gateway always has one to each worker: its health
Watch), every BATON_GRPC_KEEPALIVE_S seconds (10; at least 1), and one unanswered for as long closes the
connection. Every server takes a client's pings as often as every half second, so a client set to a
shorter period than its server is never refused as pinging too often (gRPC's GOAWAY "too_many_pings",
which would close the connection instead).
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from services.common.settings import ConfigError, env_float

ENV_KEEPALIVE_S = "BATON_GRPC_KEEPALIVE_S"
DEFAULT_KEEPALIVE_S = 10.0
MIN_KEEPALIVE_S = 1.0
_PINGS_TAKEN_EVERY_MS = 500  # below MIN_KEEPALIVE_S: a client's timer firing early is no strike


def keepalive_seconds(env: Mapping[str, str] = os.environ) -> float:
    """The keepalive period; ConfigError where BATON_GRPC_KEEPALIVE_S is not a number of at least 1."""
    seconds = env_float(env, ENV_KEEPALIVE_S, DEFAULT_KEEPALIVE_S)
    if not seconds >= MIN_KEEPALIVE_S:
        raise ConfigError(f"{ENV_KEEPALIVE_S} must be at least {MIN_KEEPALIVE_S:g} (seconds), got {seconds:g}")
    return seconds


def keepalive_options(env: Mapping[str, str] = os.environ) -> list[tuple[str, int]]:
    """Channel arguments for either end: ping every period while calls are open, give up on an
    answer after another, and keep pinging however long no data comes (a Reserve waiting for pages,
    a Watch stream)."""
    period_ms = round(keepalive_seconds(env) * 1000)
    return [
        ("grpc.keepalive_time_ms", period_ms),
        ("grpc.keepalive_timeout_ms", period_ms),
        # gRPC core waits this long for any ping's answer (60 s by default), keepalive's included.
        ("grpc.http2.ping_timeout_ms", period_ms),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_keepalive_options(env: Mapping[str, str] = os.environ) -> list[tuple[str, int]]:
    """`keepalive_options`, and clients' pings taken as often as every half second (gRPC's default
    refuses any more often than every five minutes while no data flows)."""
    return [*keepalive_options(env), ("grpc.http2.min_ping_interval_without_data_ms", _PINGS_TAKEN_EVERY_MS)]
