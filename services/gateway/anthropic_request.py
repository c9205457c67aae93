"""Anthropic's Messages API request (`POST /v1/messages`, and `/v1/messages/count_tokens`) as the
chat request it means, which the chat path generates (anthropic_api.py shapes its output): what vLLM
and SGLang serve for clients written against Anthropic's API (its SDKs, Claude Code).

In: `system` (a text, or text blocks: the system message), `messages` of `user` and `assistant` turns,
each a text or a list of blocks: `text`; an assistant's `tool_use` (chat's tool calls) and `thinking`
(its `reasoning_content`; `redacted_thinking` is left out); a user's `tool_result` (a tool message
each, ahead of the turn's text). `max_tokens` (required for a message), `stop_sequences`,
`temperature`, `top_p`, `top_k`, `tools` (`name`, `description`, `input_schema`: chat's function
tools), `tool_choice` (`auto`; `any`: chat's "required"; `tool` with its `name`; `none`; with
`disable_parallel_tool_use`), `output_config.format` (a JSON schema: structured output),
`stream`, and chat's sampling extras (`seed`, `min_p`, the penalties, `guided_regex`, ...: CHAT_EXTRAS,
which Anthropic's API has no names for). `thinking` (`enabled` or `adaptive`; `disabled`) becomes the
template variables reasoning models' templates switch thinking by (`enable_thinking`, Qwen3's;
`thinking`, DeepSeek's), under the request's own `chat_template_kwargs`; its `budget_tokens` bounds the
thinking as chat's `thinking_token_budget` does where the gateway knows the model's thinking tags
(reasoning_config.py), and is a hint it cannot keep elsewhere. `metadata` and `service_tier` ask nothing
here.
A user's `image` blocks (base64 or url sources) are chat's image parts, for a model that takes images;
documents and Anthropic's server tools are refused (400).
"""
from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.chat_request import ChatCompletionRequest, chat_request
from services.gateway.errors import APIError

TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and "tool": the one named
THINKING_TYPES = ("enabled", "adaptive", "disabled")
# What a Messages request may also ask, by chat's names (vLLM's and SGLang's extras, OpenAI's seed and
# penalties); checked as chat checks them. Not what would change the answer's shape (n, logprobs, echo).
CHAT_EXTRAS = frozenset({
    "seed", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "ignore_eos",
    "stop_token_ids", "logit_bias", "bad_words", "allowed_token_ids", "include_stop_str_in_output",
    "skip_special_tokens", "truncate_prompt_tokens", "priority", "cache_salt", "stop_regex", "response_format",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "regex", "ebnf",
    "json_schema", "no_stop_trim", "reasoning_effort", "chat_template_kwargs", "documents", "chat_template",
    "thinking_token_budget"})


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # CHAT_EXTRAS pass; the rest is ignored

    model: str
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # None only for count_tokens
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    def as_chat(self, keeps_thinking_budgets: bool = False) -> ChatCompletionRequest:
        """The chat request this one means; APIError (400) for what cannot be served, or what chat refuses.
        `keeps_thinking_budgets`: the gateway can bound the thinking to `thinking.budget_tokens`."""
        chat: dict[str, Any] = {name: value for name, value in (self.model_extra or {}).items() if name in CHAT_EXTRAS}
        chat.update(model=self.model, messages=self._messages(), stream=self.stream)
        for name, value in (("max_tokens", self.max_tokens), ("stop", self.stop_sequences),
                            ("temperature", self.temperature), ("top_p", self.top_p), ("top_k", self.top_k)):
            if value is not None:
                chat[name] = value
        if self.tools:
            chat["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            chat["tool_choice"], chat["parallel_tool_calls"] = _chat_tool_choice(self.tool_choice)
        if self.thinking is not None:
            _switch_thinking(chat, self.thinking)
            if keeps_thinking_budgets:
                _bound_thinking(chat, self.thinking)
        schema = ((self.output_config or {}).get("format") or {}).get("schema")
        if schema is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
        return chat_request(chat)

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.system:
            messages.append({"role": "system", "content": self.system if isinstance(self.system, str)
                             else _texts(self.system, "system")})
        for i, message in enumerate(self.messages):
            role, content = message.get("role"), message.get("content")
            if role not in ("user", "assistant"):
                raise APIError(400, f"messages[{i}].role must be user or assistant", param=f"messages[{i}].role")
            if isinstance(content, str):
                messages.append({"role": role, "content": content})
            elif isinstance(content, list):
                messages += _turn(role, content, f"messages[{i}].content")
            else:
                raise APIError(400, f"messages[{i}].content must be a text or a list of blocks",
                               param=f"messages[{i}].content")
        return messages


def _turn(role: str, blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """One turn's blocks as chat messages: a user's tool results first, each its own tool message."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []  # the texts and images in order, where a user's turn has images
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
            parts.append({"type": "text", "text": texts[-1]})
        elif kind == "image" and role == "user":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), f"{where}[{j}]")}})
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name"), "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "thinking" and role == "assistant":
            thinking.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # opaque; a client sends the turn back as it got it
        elif kind == "tool_result" and role == "user":
            content = block.get("content")
            if not isinstance(content, str | list | None):
                raise APIError(400, f"{where}[{j}].content: a tool result is a text or a list of text blocks",
                               param=f"{where}[{j}].content")
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": content if isinstance(content, str) else _texts(content or [], f"{where}[{j}]")})
        else:
            raise APIError(400, f"{where}[{j}]: blocks of type {kind!r} are not supported in a {role} message "
                                "(text, a user's image, tool_use, tool_result and thinking are)", param=f"{where}[{j}]")
    has_images = len(parts) > len(texts)
    turn: dict[str, Any] = {"role": role, "content": parts if has_images else
                            "\n".join(texts) if texts or not calls else None}
    if calls:
        turn["tool_calls"] = calls
    if thinking:
        turn["reasoning_content"] = "\n".join(thinking)
    return results + [turn] if texts or has_images or calls or thinking or not results else results


def _image_url(source: Any, where: str) -> str:
    """An image block's source as chat's image URL: base64 data as a data: URL, or its url."""
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str):
        return f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise APIError(400, f"{where}.source: an image's source is {{\"type\": \"base64\", \"media_type\", \"data\"}} "
                        "or {\"type\": \"url\", \"url\"}", param=f"{where}.source")


def _switch_thinking(chat: dict[str, Any], thinking: dict[str, Any]) -> None:
    kind = thinking.get("type")
    if kind not in THINKING_TYPES:
        raise APIError(400, f"thinking.type must be one of {', '.join(THINKING_TYPES)}, got {kind!r}",
                       param="thinking.type")
    given = chat.get("chat_template_kwargs")
    if given is not None and not isinstance(given, dict):
        return  # chat refuses it, naming it
    is_on = kind != "disabled"
    chat["chat_template_kwargs"] = {"enable_thinking": is_on, "thinking": is_on, **(given or {})}


def _bound_thinking(chat: dict[str, Any], thinking: dict[str, Any]) -> None:
    budget = thinking.get("budget_tokens")
    if thinking.get("type") != "enabled" or budget is None or "thinking_token_budget" in chat:
        return
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise APIError(400, f"thinking.budget_tokens must be an integer >= 0, got {budget!r}",
                       param="thinking.budget_tokens")
    chat["thinking_token_budget"] = budget


def _texts(blocks: list[Any], where: str) -> str:
    """Text blocks' texts joined (a system prompt, a tool's result)."""
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise APIError(400, f"{where}[{j}]: blocks of type {kind!r} are not supported here (text only)",
                           param=f"{where}[{j}]")
        texts.append(str(block.get("text", "")))
    return "\n".join(texts)


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    """A client tool (name, description, input_schema) as chat's function tool; Anthropic's own server
    tools (web search, code execution, ...) have a `type` and are not served here."""
    if tool.get("type") not in (None, "custom") or "input_schema" not in tool:
        raise APIError(400, f"tools[{index}]: only client tools with an input_schema are supported, "
                            f"got type {tool.get('type')!r}", param=f"tools[{index}]")
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: dict[str, Any]) -> tuple[str | dict[str, Any], bool]:
    """Chat's `tool_choice` and `parallel_tool_calls`."""
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    if kind not in TOOL_CHOICES:
        raise APIError(400, f"tool_choice.type must be auto, any, tool or none, got {kind!r}",
                       param="tool_choice.type")
    return TOOL_CHOICES[kind], parallel
