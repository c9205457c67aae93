"""Chat templates rendered exactly as Hugging Face `transformers` renders them.

A model's chat template is untrusted Jinja from its repository. `transformers`
(5.x, `utils/chat_template_utils.py`) fixes the environment every published
template is written against; rendering the same template in any other way
(HTML-escaping `tojson`, no `trim_blocks`, a missing `raise_exception`) silently
changes the prompt, so this module reproduces that environment and those
inputs, and nothing more.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2

from services.tokenizer.content_format import CONTENT_FORMATS, detect_content_format, part_texts, shaped_content
from services.tokenizer.template_sandbox import make_environment

# Older names for a message's reasoning; templates read `reasoning_content`, gpt-oss
# templates read `thinking`. transformers fills both from whichever is present.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Appended to the message to continue, then found in the text and everything from it cut:
# what comes after it is the template's end of that turn. transformers' own marker.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "

# What a template is given by name, and `ChatTemplate.render`'s own parameters: extra variables
# may not take these.
RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                                "special_tokens", "self", "chat_template", "content_format"})


class ChatTemplateError(ValueError):
    """The template refused the conversation (`raise_exception`) or failed to render it."""


@dataclass(frozen=True)
class ChatOptions:
    """How a conversation becomes a prompt beyond its messages: vLLM's chat request extras."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # extra template variables
    tools: Sequence[Mapping[str, Any]] | None = None  # OpenAI's tool list, for templates that show it
    documents: Sequence[Mapping[str, Any]] | None = None  # for retrieval templates: {"title", "text"} each
    # The request's own template (its Jinja source, or the name of one of the model's templates);
    # None: the model's. The gateway takes one only when started trusting them.
    template: str | None = None
    add_special_tokens: bool = False  # special tokens (BOS) added to the rendered text as well, as vLLM's
    content_format: str = "auto"  # how messages' content reaches the template (content_format.py)

    def as_template_inputs(self) -> dict[str, Any]:
        """The keyword arguments of `ModelTokenizer.apply_chat_template` beyond the messages."""
        return {"add_generation_prompt": self.add_generation_prompt, "tools": self.tools,
                "continue_final_message": self.continue_final_message, "documents": self.documents,
                "chat_template": self.template, "add_special_tokens": self.add_special_tokens,
                "content_format": self.content_format, **self.template_kwargs}


class ChatTemplate:
    """One compiled chat template.

    `render` gives the prompt text; the caller encodes it without adding special
    tokens, since the template writes bos and the turn markers itself.
    """

    def __init__(self, source: str):
        self.source = source
        environment = make_environment()
        try:
            self._template = environment.from_string(source)
            self.content_format = detect_content_format(environment.parse(source))  # what "auto" means here
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from e

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        content_format: str = "auto",
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` (dicts with at least "role") into the prompt text.

        `continue_final_message`: the text ends inside the last message, which the reply then
        continues (a prefilled assistant turn), as transformers cuts it. `special_tokens` maps
        names such as "bos_token" to their strings; explicit `template_kwargs` override them,
        as in transformers. `content_format`: messages' content as text ("string"), as text parts
        ("openai"), or as this template reads it ("auto"). Raises `ChatTemplateError` when the
        template rejects the conversation.
        """
        if not messages:
            raise ChatTemplateError("cannot apply a chat template to an empty conversation")
        if content_format not in CONTENT_FORMATS:
            raise ChatTemplateError(f"content format must be one of {', '.join(CONTENT_FORMATS)}, "
                                    f"got {content_format!r}")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set: the "
                                    "reply continues the last message, or starts a new one")
        chat = _alias_reasoning_fields(normalize_messages(messages))
        final = None
        try:
            chat = [shaped_content(m, self.content_format if content_format == "auto" else content_format)
                    for m in chat]
            if continue_final_message:
                final, chat[-1] = _marked_final(chat[-1])
        except ValueError as e:  # a content part that is not text
            raise ChatTemplateError(str(e)) from None
        variables = {**(special_tokens or {}), **_plain_data(template_kwargs)}
        try:
            text = self._template.render(
                messages=chat,
                tools=_plain_data(list(tools)) if tools is not None else None,
                documents=_plain_data(list(documents)) if documents is not None else None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:  # raise_exception, undefined names, sandbox refusals
            raise ChatTemplateError(f"chat template error: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            # A template doing arithmetic or indexing on a malformed message.
            raise ChatTemplateError(f"chat template failed on these messages: {e!r}") from e
        return text if final is None else _cut_at_continuation(text, final)


def _marked_final(message: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The text the reply continues, and the last message with the continuation tag after it (in
    its last part, for content given as parts, where transformers continues too)."""
    content = message.get("content")
    if isinstance(content, list) and content:
        *head, last = content
        final = part_texts([last])[0]
        return final, {**message, "content": [*head, {**last, "text": final + _CONTINUE_TAG}]}
    if not isinstance(content, str):
        raise ChatTemplateError("continue_final_message is set but the last message has no text to continue")
    return content, {**message, "content": content + _CONTINUE_TAG}


def _cut_at_continuation(text: str, final: str) -> str:
    """The rendered text up to the end of the last message's content (marked by `_CONTINUE_TAG`)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError("continue_final_message is set but the chat template does not render the last "
                                "message's text: there is nothing to continue")
    at = text.rindex(tag)
    # A template that strips a message's trailing space also took the tag's: cut that side of it too.
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


def template_kwargs_from_json(text: str) -> dict[str, Any]:
    """Extra template variables sent as a JSON object ("" for none). Raises ChatTemplateError for
    anything else, or for a name the template is given already."""
    if not text:
        return {}
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as e:
        raise ChatTemplateError(f"chat_template_kwargs is not JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise ChatTemplateError("chat_template_kwargs must be a JSON object")
    check_template_kwargs(kwargs)
    return kwargs


def tools_from_json(text: str) -> list[dict[str, Any]] | None:
    """The tools a request lists for the model, sent as OpenAI's JSON list ("" for none)."""
    return _objects_from_json(text, "tools")


def documents_from_json(text: str) -> list[dict[str, Any]] | None:
    """The documents a request gives a retrieval template, a JSON list of objects ("" for none)."""
    return _objects_from_json(text, "documents")


def _objects_from_json(text: str, what: str) -> list[dict[str, Any]] | None:
    if not text:
        return None
    try:
        objects = json.loads(text)
    except json.JSONDecodeError as e:
        raise ChatTemplateError(f"{what} are not JSON: {e}") from None
    if not isinstance(objects, list) or not all(isinstance(o, dict) for o in objects):
        raise ChatTemplateError(f"{what} must be a JSON list of objects")
    return objects


def check_template_kwargs(kwargs: Mapping[str, Any]) -> None:
    taken = sorted(RESERVED_VARIABLES & set(kwargs))
    if taken:
        raise ChatTemplateError(f"chat_template_kwargs cannot set {', '.join(taken)}: the request's own fields do")


def check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    """Raise ChatTemplateError for what no template can render: no messages, or one without a role."""
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    for i, message in enumerate(messages):
        if not message.get("role"):
            raise ChatTemplateError(f"messages[{i}] has no role")


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain-dict copies of `messages` with None-valued keys dropped.

    OpenAI clients send `content=None` or `tool_calls=None`; many templates render
    the literal "None" for those but handle a missing key, so transformers drops them.
    """
    normalized = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"a chat message must be a mapping, got {type(message).__name__}")
        normalized.append({str(k): _plain_data(v) for k, v in message.items() if v is not None})
    return normalized


def _alias_reasoning_fields(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    aliased = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _plain_data(value: Any) -> Any:
    """Rebuild `value` from JSON types only: the sandbox cannot know which methods of
    arbitrary objects are dangerous, so the template never sees any."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # str subclasses (enums) carry extra methods
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain_data(k): _plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain_data(v) for v in value)
    return f"<{type(value).__name__}>"  # an inert placeholder, as transformers writes
