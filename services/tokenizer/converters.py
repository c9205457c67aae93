"""Protobuf ↔ plain Python for the tokenizer service (only here and in the servicer)."""
from __future__ import annotations

from collections.abc import Sequence

from protos import common_pb2


def chat_messages_from_proto(messages: Sequence[common_pb2.ChatMessage]) -> list[dict[str, str]]:
    """Messages as the dicts a chat template reads ({"role": ..., "content": ...})."""
    return [{"role": m.role, "content": m.content} for m in messages]
