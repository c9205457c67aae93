"""Protobuf ↔ plain Python for the tokenizer service: its servicer, and its clients building requests."""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from protos import common_pb2


def chat_messages_from_proto(messages: Sequence[common_pb2.ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the dicts a chat template reads ({"role": ..., "content": ...}, and an assistant's
    `tool_calls`, a tool's `tool_call_id` and a `name` where they are set). ValueError for tool
    calls that are not a JSON list."""
    return [_chat_message(m) for m in messages]


def chat_message_to_proto(message: dict[str, Any]) -> common_pb2.ChatMessage:
    """The converse, for the gateway: a message dict as the tokenizer service takes it."""
    tool_calls = message.get("tool_calls")
    return common_pb2.ChatMessage(role=message["role"], content=message.get("content") or "",
                                  tool_calls_json=json.dumps(tool_calls) if tool_calls else "",
                                  tool_call_id=message.get("tool_call_id") or "", name=message.get("name") or "",
                                  reasoning_content=message.get("reasoning_content") or "")


def _chat_message(m: common_pb2.ChatMessage) -> dict[str, Any]:
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls_json:
        message["tool_calls"] = json.loads(m.tool_calls_json)
        if not isinstance(message["tool_calls"], list):
            raise ValueError("tool_calls must be a JSON list")
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.name:
        message["name"] = m.name
    if m.reasoning_content:
        message["reasoning_content"] = m.reasoning_content
    return message
