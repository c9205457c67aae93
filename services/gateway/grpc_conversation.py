"""A gRPC Generate request's conversation as the pipeline takes it: its messages and chat options, held
to what the HTTP API accepts, each refusal a 400 naming the field."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from protos import common_pb2, gateway_pb2
from services.common.mm_limits import checked_media_io_kwargs, checked_processor_kwargs
from services.gateway.chat_messages import CHAT_ROLES, with_parsed_arguments
from services.gateway.errors import APIError
from services.tokenizer.chat_template import (
    ChatOptions,
    ChatTemplateError,
    documents_from_json,
    template_kwargs_from_json,
)
from services.tokenizer.converters import chat_messages_from_proto


def chat_messages(chat: common_pb2.ChatMessages) -> list[dict[str, Any]]:
    """The messages as the pipeline takes them, held to what the HTTP API accepts: at least one, each
    with a role OpenAI's API knows (a template fed another may fail, or render what its author did not
    mean); an assistant's tool calls with their arguments as objects, as templates read them."""
    if not chat.messages:
        raise APIError(400, "chat.messages must not be empty", param="chat.messages")
    for i, message in enumerate(chat.messages):
        if message.role not in CHAT_ROLES:
            raise APIError(400, f"chat.messages[{i}].role must be one of {', '.join(sorted(CHAT_ROLES))}, got "
                                f"{message.role!r}", param=f"chat.messages[{i}].role")
    try:
        messages = chat_messages_from_proto(chat.messages)
    except ValueError as e:  # tool_calls_json that is not a JSON list of objects
        raise APIError(400, f"chat.messages: {e}", param="chat.messages") from None
    for message in messages:
        if "tool_calls" in message:
            message["tool_calls"] = [with_parsed_arguments(call) for call in message["tool_calls"]]
    return messages


def mm_processor_kwargs(options: gateway_pb2.ChatOptions) -> dict[str, Any] | None:
    """The image processor's settings the request asks for its images (None for none); APIError (400) for JSON
    that is not an object of settings served here."""
    return _checked_json(options.mm_processor_kwargs_json, "chat_options.mm_processor_kwargs_json",
                         checked_processor_kwargs)


def media_io_kwargs(options: gateway_pb2.ChatOptions) -> dict[str, Any] | None:
    """How the request asks its media read (None for as the gateway reads them); APIError (400) likewise."""
    return _checked_json(options.media_io_kwargs_json, "chat_options.media_io_kwargs_json", checked_media_io_kwargs)


def _checked_json(text: str, param: str, checked: Callable[[dict, str], dict]) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        kwargs = json.loads(text)
        if not isinstance(kwargs, dict):
            raise ValueError(f"{param} must be a JSON object")
        return checked(kwargs, param)
    except ValueError as e:  # JSONDecodeError among them
        raise APIError(400, str(e), param=param) from None


def chat_options(options: gateway_pb2.ChatOptions, tools: list | None) -> ChatOptions:
    add_generation_prompt = options.add_generation_prompt if options.HasField("add_generation_prompt") else True
    if add_generation_prompt and options.continue_final_message:
        raise APIError(400, "chat_options: continue_final_message and add_generation_prompt cannot both be true "
                            "(add_generation_prompt is true unless set false)", param="chat_options")
    try:
        kwargs = template_kwargs_from_json(options.chat_template_kwargs_json)
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="chat_options.chat_template_kwargs_json") from None
    try:
        documents = documents_from_json(options.documents_json)
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="chat_options.documents_json") from None
    return ChatOptions(add_generation_prompt, options.continue_final_message, kwargs, tools, documents,
                       options.chat_template or None, options.add_special_tokens)
