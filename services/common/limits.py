"""Message-size limits, set identically on both ends of every Baton channel.

gRPC's default receive limit is 4 MiB, below one prompt's KV pages or a long
prompt's token ids; a limit raised on only one end still fails on the other.
Large payloads (KV pages) are streamed in chunks of at most 2 MiB anyway; the
64 MiB ceiling is headroom for one-shot messages, not a transport for pages.
"""
from __future__ import annotations

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def message_size_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC channel arguments capping one message in each direction at `max_message_bytes`."""
    if max_message_bytes < 1:
        raise ValueError(f"max_message_bytes must be >= 1, got {max_message_bytes}")
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
