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
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Older names for a message's reasoning; templates read `reasoning_content`, gpt-oss
# templates read `thinking`. transformers fills both from whichever is present.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Appended to the message to continue, then found in the text and everything from it cut:
# what comes after it is the template's end of that turn. transformers' own marker.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "

# What a template is given by name, and `ChatTemplate.render`'s own parameters: extra variables
# may not take these.
RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                                "special_tokens", "self", "chat_template"})


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

    def as_template_inputs(self) -> dict[str, Any]:
        """The keyword arguments of `ModelTokenizer.apply_chat_template` beyond the messages."""
        return {"add_generation_prompt": self.add_generation_prompt, "tools": self.tools,
                "continue_final_message": self.continue_final_message, "documents": self.documents,
                "chat_template": self.template, "add_special_tokens": self.add_special_tokens,
                **self.template_kwargs}


class ChatTemplate:
    """One compiled chat template.

    `render` gives the prompt text; the caller encodes it without adding special
    tokens, since the template writes bos and the turn markers itself.
    """

    def __init__(self, source: str):
        self.source = source
        try:
            self._template = _make_environment().from_string(source)
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
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` (dicts with at least "role") into the prompt text.

        `continue_final_message`: the text ends inside the last message, which the reply then
        continues (a prefilled assistant turn), as transformers cuts it. `special_tokens` maps
        names such as "bos_token" to their strings; explicit `template_kwargs` override them,
        as in transformers. Raises `ChatTemplateError` when the template rejects the conversation.
        """
        if not messages:
            raise ChatTemplateError("cannot apply a chat template to an empty conversation")
        chat = _alias_reasoning_fields(normalize_messages(messages))
        final = None
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set: the "
                                        "reply continues the last message, or starts a new one")
            final = chat[-1].get("content")
            if not isinstance(final, str):
                raise ChatTemplateError("continue_final_message is set but the last message has no text to continue")
            chat[-1] = {**chat[-1], "content": final + _CONTINUE_TAG}
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


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes '<', '>', '&' and "'"; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A Jinja namespace that refuses underscore names (a way into CPython internals)."""

    # No named `self`: Jinja's own signature trick, so that `namespace(self=...)` works.
    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (assistant-mask markers) and
    renders the body unchanged; Baton does not compute assistant masks."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _make_environment() -> ImmutableSandboxedEnvironment:
    # The same options, filters and globals as transformers' `_cached_compile_jinja_template`.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env
