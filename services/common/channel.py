"""Client channels to Baton services, with the same message limits as the servers."""
from __future__ import annotations

from collections.abc import Sequence

import grpc

from services.common.keepalive import keepalive_options
from services.common.limits import DEFAULT_MAX_MESSAGE_BYTES, message_size_options
from services.common.tracing import client_interceptors


def make_channel(
    address: str,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    *,
    options: Sequence[tuple[str, int | str]] = (),
) -> grpc.aio.Channel:
    """An insecure asyncio channel to `address` ("host:port").

    Sends and receives messages up to `max_message_bytes`, matching make_server's
    default; one over it fails with RESOURCE_EXHAUSTED instead of being truncated. Pings
    the server while calls are open (keepalive.py): one that stops answering fails them.
    `options` are extra gRPC channel arguments; one naming a limit overrides it.
    The caller closes the channel (`await channel.close()` or `async with`).
    Insecure on purpose: the mesh runs on a private network; TLS is the
    orchestrator's (or a later option's) job. With tracing on (services/common/tracing.py),
    each call carries the current trace context in its metadata.
    """
    # A dict, so an override replaces the limit rather than relying on which
    # of two duplicate channel arguments gRPC core honours.
    merged = dict(message_size_options(max_message_bytes))
    merged.update(keepalive_options())
    merged.update(options)
    return grpc.aio.insecure_channel(address, options=list(merged.items()),
                                     interceptors=client_interceptors() or None)
