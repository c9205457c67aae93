"""A call's error that one worker hands on from another it called, marked as that other's (in its trailing
metadata): a prefill worker's call ending UNAVAILABLE because its decode worker went away, while it reserved
or wrote the pages, is not the prefill worker going away, and the gateway moves the request accordingly."""
from __future__ import annotations

import grpc

RELAYED_FROM_KEY = "baton-relayed-from"


def relayed_from(kind: str) -> tuple[tuple[str, str], ...]:
    """The trailing metadata of an error handed on from a worker of `kind` ("decode")."""
    return ((RELAYED_FROM_KEY, kind),)


def is_relayed_from(error: grpc.aio.AioRpcError, kind: str) -> bool:
    return any(key == RELAYED_FROM_KEY and value == kind for key, value in error.trailing_metadata() or ())
