"""Protobuf ↔ plain Python for the tokenizer service: its servicer, and its clients building requests."""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from protos import common_pb2, tokenizer_pb2
from services.tokenizer.chat_template import ChatOptions
from services.tokenizer.content_format import joined_parts, split_parts
from services.tokenizer.image_tokens import ImageSize


def chat_messages_from_proto(messages: Sequence[common_pb2.ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the dicts a chat template reads ({"role": ..., "content": ...}, and an assistant's
    `tool_calls`, a tool's `tool_call_id` and a `name` where they are set). ValueError for tool
    calls that are not a JSON list of objects."""
    return [_chat_message(m) for m in messages]


def chat_message_to_proto(message: dict[str, Any]) -> common_pb2.ChatMessage:
    """The converse, for the gateway: a message dict as the tokenizer service takes it."""
    tool_calls = message.get("tool_calls")
    content = message.get("content") or ""
    parts, images, videos = split_parts(content) if isinstance(content, list) else ([], [], [])
    return common_pb2.ChatMessage(role=message["role"], content="" if parts or images or videos else content,
                                  content_parts=parts, image_parts=images, video_parts=videos,
                                  tool_calls_json=json.dumps(tool_calls) if tool_calls else "",
                                  tool_call_id=message.get("tool_call_id") or "", name=message.get("name") or "",
                                  reasoning_content=message.get("reasoning_content") or "")


def chat_template_request(request_id: str, messages: Sequence[dict[str, Any]], options: ChatOptions,
                          image_sizes: Sequence[ImageSize] = ()) -> tokenizer_pb2.ApplyChatTemplateRequest:
    """What asks the tokenizer service to render `messages` as `options` say; `image_sizes`: their images',
    as `ModelTokenizer.apply_chat_template` takes them."""
    kwargs = options.template_kwargs
    return tokenizer_pb2.ApplyChatTemplateRequest(
        request_id=request_id, messages=[chat_message_to_proto(m) for m in messages],
        add_generation_prompt=options.add_generation_prompt, continue_final_message=options.continue_final_message,
        chat_template_kwargs_json=json.dumps(kwargs) if kwargs else "",
        tools_json=json.dumps(list(options.tools)) if options.tools else "",
        chat_template=options.template or "", documents_json=json.dumps(list(options.documents))
        if options.documents is not None else "", add_special_tokens=options.add_special_tokens,
        content_format=options.content_format,
        image_sizes=[tokenizer_pb2.ImageSize(height=size.height, width=size.width, num_crops=size.num_crops,
                                             frames=size.frames, frame_times=size.times, columns=size.columns)
                     for size in image_sizes])


def _chat_message(m: common_pb2.ChatMessage) -> dict[str, Any]:
    content = joined_parts(list(m.content_parts), list(m.image_parts), list(m.video_parts)) \
        if m.content_parts or m.image_parts or m.video_parts else m.content
    message: dict[str, Any] = {"role": m.role, "content": content}
    if m.tool_calls_json:
        message["tool_calls"] = json.loads(m.tool_calls_json)
        if not isinstance(message["tool_calls"], list) or not all(isinstance(c, dict) for c in message["tool_calls"]):
            raise ValueError("tool_calls must be a JSON list of objects")
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.name:
        message["name"] = m.name
    if m.reasoning_content:
        message["reasoning_content"] = m.reasoning_content
    return message
