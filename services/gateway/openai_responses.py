"""OpenAI response bodies built from pipeline `Delta`s: completions and chat, whole or
as stream chunks, with usage and logprobs in the shapes the `openai` client parses.

A completion with `echo` starts with its prompt (the text as given, or the ids decoded), and
with `logprobs` its prompt's tokens come first in them, the first with none (nothing predicts
it), as OpenAI's legacy API and vLLM list them: what evaluation harnesses score a text by.
vLLM's `prompt_logprobs` go in each completion choice (a chat's at the top of its response):
None for the first token, then per token its id → `{logprob, rank, decoded_token}` for the
top-n and the prompt's own token (its rank null when it is not among them)."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from protos import common_pb2
from services.gateway.deltas import Delta, Usage
from services.gateway.harmony import HarmonyReasoning
from services.gateway.reasoning_parsers import ReasoningReader, StreamedReasoning
from services.gateway.streamed_calls import StreamedCalls, merged_call_deltas
from services.gateway.tool_calls import ForcedToolCall, new_call_id
from services.gateway.tool_parsers import RequiredCalls, ToolCallSyntax

TokenText = Callable[[int], str]  # a token id as the text it decodes to on its own


def usage_body(usages: Sequence[Usage], prompt_of_choice: Sequence[int],
               reasoning_tokens: int | None = None) -> dict[str, Any]:
    """Usage over every choice: each prompt's tokens once (as OpenAI counts n > 1), every
    choice's completion tokens; `reasoning_tokens` (of those, the thinking's) where a reasoning
    parser read the replies."""
    first_of_prompt: dict[int, Usage] = {}
    for usage, prompt in zip(usages, prompt_of_choice):
        first_of_prompt.setdefault(prompt, usage)
    prompt_tokens = sum(u.prompt_tokens for u in first_of_prompt.values())
    completion_tokens = sum(u.completion_tokens for u in usages)
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in first_of_prompt.values())}}
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def completion_logprobs(entries: Sequence[common_pb2.TopLogprobs], token_text: TokenText,
                        text_offset: int) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, `text_offset` counted from `text_offset`."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        text = token_text(entry.sampled.token_id)
        tokens.append(text)
        token_logprobs.append(entry.sampled.logprob)
        top.append({token_text(t.token_id): t.logprob for t in entry.top})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def echoed_logprobs(prompt_token_ids: Sequence[int], entries: Sequence[common_pb2.TopLogprobs], n: int,
                    token_text: TokenText) -> dict[str, Any]:
    """The prompt's part of an echoed completion's logprobs, `text_offset` counted from 0."""
    texts = [token_text(t) for t in prompt_token_ids]
    offsets = [0]
    for text in texts[:-1]:
        offsets.append(offsets[-1] + len(text))
    return {"tokens": texts, "token_logprobs": [None, *(e.sampled.logprob for e in entries)],
            "top_logprobs": [None, *({token_text(t.token_id): t.logprob for t in e.top[:n]} for e in entries)],
            "text_offset": offsets}


def vllm_prompt_logprobs(entries: Sequence[common_pb2.TopLogprobs], n: int,
                         token_text: TokenText) -> list[dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = [None]
    for entry in entries:
        record = {str(t.token_id): {"logprob": t.logprob, "rank": rank, "decoded_token": token_text(t.token_id)}
                  for rank, t in enumerate(entry.top[:n], start=1)}
        sampled = entry.sampled
        record.setdefault(str(sampled.token_id), {"logprob": sampled.logprob, "rank": None,
                                                  "decoded_token": token_text(sampled.token_id)})
        out.append(record)
    return out


def chat_logprobs(entries: Sequence[common_pb2.TopLogprobs], token_text: TokenText) -> dict[str, Any]:
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**one(e.sampled.token_id, e.sampled.logprob),
                         "top_logprobs": [one(t.token_id, t.logprob) for t in e.top]} for e in entries],
            "refusal": None}


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TopLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    prompt_token_ids: Sequence[int] = ()
    prompt_logprobs: Sequence[common_pb2.TopLogprobs] = ()
    # With a reasoning parser: the text split as it came (thinking, answer), and the tokens
    # generated while thinking (its closing tag's included).
    thinking: StreamedReasoning | HarmonyReasoning | None = None
    thought: str = ""
    answer: str = ""
    reasoning_tokens: int = 0
    undecided_tokens: int = 0  # the first ones, while it is not yet known whether they open a think block

    def add(self, delta: Delta) -> None:
        if delta.prompt_token_ids:
            self.prompt_token_ids, self.prompt_logprobs = delta.prompt_token_ids, delta.prompt_logprobs
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.matched_stop
            self.usage = delta.usage


class ResponseBuilder:
    """Bodies for one request's response: chunks while streaming, or the whole object."""

    def __init__(self, *, kind: str, response_id: str, model: str, num_choices: int, prompt_of_choice: Sequence[int],
                 token_text: TokenText, want_logprobs: bool, num_logprobs: int = 0,
                 echo_of_prompt: Sequence[str] | None = None, num_prompt_logprobs: int | None = None,
                 forced_tool_call: ForcedToolCall | None = None, tool_call_syntax: ToolCallSyntax | None = None,
                 call_id: Callable[[], str] = new_call_id, reasoning: ReasoningReader | None = None,
                 include_reasoning: bool = True, parallel_tool_calls: bool = True):
        self.kind = kind  # "completion" or "chat"
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.choices = [ChoiceState() for _ in range(num_choices)]
        self.prompt_of_choice = list(prompt_of_choice)
        self.token_text = token_text
        self.want_logprobs = want_logprobs
        self.num_logprobs = num_logprobs  # candidates per echoed prompt token
        # `echo`: each prompt's text (chat's one: its last message's, vLLM's chat `echo`)
        self.echo_of_prompt = echo_of_prompt
        self.num_prompt_logprobs = num_prompt_logprobs  # vLLM's `prompt_logprobs`, when asked for
        # "required": the text is a list of calls, read as the model's own are (tool_parsers.RequiredCalls)
        if forced_tool_call is not None and forced_tool_call.name is None:
            forced_tool_call, tool_call_syntax = None, RequiredCalls(call_id)
        self.forced_tool_call = forced_tool_call  # chat: the text is a named function's call, sent as `tool_calls`
        self._sent_role = [False] * num_choices
        # A named function's call, per choice; ids of the gateway's parser's kind (a Mistral model's
        # templates take back only theirs).
        self._call_ids = [call_id() for _ in range(num_choices)]
        # tool_choice "auto" (or "required"): each choice's text read for its calls (tool_parsers.py)
        self.tool_call_syntax = tool_call_syntax
        self.parallel_tool_calls = parallel_tool_calls  # False: a reply's first call only, as vLLM filters them
        self._streamed_calls = ([StreamedCalls(tool_call_syntax) for _ in range(num_choices)]
                                if tool_call_syntax is not None else None)
        # chat with --reasoning-parser: each choice's thinking read out of its text (reasoning_parsers.py)
        self.reasoning = reasoning
        self.include_reasoning = include_reasoning

    @property
    def usage(self) -> dict[str, Any]:
        usages = [c.usage or Usage(0, len(c.token_ids), 0) for c in self.choices]
        return usage_body(usages, self.prompt_of_choice, self.reasoning_tokens)

    @property
    def reasoning_tokens(self) -> int | None:
        """The choices' tokens of thinking so far; None without a reasoning parser."""
        return sum(c.reasoning_tokens for c in self.choices) if self.reasoning is not None else None

    def _head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    # ---- streaming -------------------------------------------------------------------

    def chunk(self, index: int, delta: Delta, include_usage: bool, continuous_usage: bool = False) -> dict[str, Any]:
        """The stream chunk for one delta of choice `index` (also recorded for usage). A choice's
        first chunk brings its echoed prompt and its prompt logprobs. With `include_usage` it has
        `usage`: null, or with `continuous_usage` the choice's so far, as vLLM counts it."""
        state = self.choices[index]
        is_first = not state.prompt_token_ids
        echoed = ""
        if is_first and self.echo_of_prompt is not None:
            echoed = self.echo_of_prompt[self.prompt_of_choice[index]]
            state.text = echoed
        text_offset = len(state.text)
        state.add(delta)
        logprobs = None
        if self.kind == "completion":
            if self.want_logprobs:
                logprobs = completion_logprobs(delta.logprobs, self.token_text, text_offset)
                if is_first and self.echo_of_prompt is not None:
                    logprobs = _joined(self._echoed_logprobs(state), logprobs)
            choice = {"index": index, "text": echoed + delta.text, "logprobs": logprobs,
                      "finish_reason": delta.finish_reason, "stop_reason": state.stop_reason}
            if is_first and self.num_prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._prompt_logprobs(state)
            body = self._head("text_completion")
        else:
            if self.want_logprobs:
                logprobs = chat_logprobs(delta.logprobs, self.token_text)
            thought, text = self._split_delta(delta, state) if self.reasoning is not None else ("", delta.text)
            if self.forced_tool_call is not None:
                message, calls = self._tool_call_delta(index, delta)
            elif self._streamed_calls is not None:
                message, calls = self._parsed_delta(index, text, delta.finish_reason is not None)
            else:
                message, calls = {"content": text}, None
            if thought:
                if self.include_reasoning:
                    message.update(reasoning=thought, reasoning_content=thought)
                if not message.get("content"):
                    message.pop("content", None)
            if not self._sent_role[index]:
                if self.echo_of_prompt is not None:
                    message["content"] = echoed + (message.get("content") or "")
                message["role"] = "assistant"
                self._sent_role[index] = True
            choice = {"index": index, "delta": message, "logprobs": logprobs,
                      "finish_reason": self._finish_reason(state, calls) if delta.finish_reason else None,
                      "stop_reason": state.stop_reason}
            body = self._head("chat.completion.chunk")
            if is_first and self.num_prompt_logprobs is not None:
                body["prompt_logprobs"] = self._prompt_logprobs(state)
        body["choices"] = [choice]
        if continuous_usage:
            num_prompt, num_output = len(state.prompt_token_ids), len(state.token_ids)
            body["usage"] = {"prompt_tokens": num_prompt, "completion_tokens": num_output,
                             "total_tokens": num_prompt + num_output}
        elif include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk when `stream_options.include_usage`: no choices, the whole usage."""
        return self._chunk_without_choices("usage", self.usage)

    def timeline_chunk(self, timeline: dict[str, Any]) -> dict[str, Any]:
        """The chunk that carries the request's ledger, when asked for: no choices."""
        return self._chunk_without_choices("timeline", timeline)

    def _chunk_without_choices(self, key: str, value: dict[str, Any]) -> dict[str, Any]:
        body = self._head("text_completion" if self.kind == "completion" else "chat.completion.chunk")
        body["choices"] = []
        body[key] = value
        return body

    # ---- whole -----------------------------------------------------------------------

    def add(self, index: int, delta: Delta) -> None:
        state = self.choices[index]
        state.add(delta)
        if self.reasoning is not None:
            self._split_delta(delta, state)

    def whole(self) -> dict[str, Any]:
        choices = []
        for index, state in enumerate(self.choices):
            if self.kind == "completion":
                echoed = "" if self.echo_of_prompt is None else self.echo_of_prompt[self.prompt_of_choice[index]]
                logprobs = None
                if self.want_logprobs:
                    logprobs = completion_logprobs(state.logprobs, self.token_text, len(echoed))
                    if self.echo_of_prompt is not None:
                        logprobs = _joined(self._echoed_logprobs(state), logprobs)
                choice = {"index": index, "text": echoed + state.text, "logprobs": logprobs,
                          "finish_reason": state.finish_reason, "stop_reason": state.stop_reason}
                if self.num_prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs(state)
                choices.append(choice)
            else:
                logprobs = chat_logprobs(state.logprobs, self.token_text) if self.want_logprobs else None
                reasoning, content, calls = self._answer(index, state)
                if self.echo_of_prompt is not None:
                    content = self.echo_of_prompt[self.prompt_of_choice[index]] + (content or "")
                message = {"role": "assistant", "content": content, "refusal": None, "tool_calls": calls or []}
                if reasoning is not None and self.include_reasoning:
                    message.update(reasoning=reasoning, reasoning_content=reasoning)
                choices.append({"index": index, "message": message, "logprobs": logprobs,
                                "finish_reason": self._finish_reason(state, calls), "stop_reason": state.stop_reason})
        body = self._head("text_completion" if self.kind == "completion" else "chat.completion")
        body["choices"] = choices
        if self.kind == "chat" and self.num_prompt_logprobs is not None:  # every choice has the same prompt
            body["prompt_logprobs"] = self._prompt_logprobs(self.choices[0])
        body["usage"] = self.usage
        return body

    def _answer(self, index: int, state: ChoiceState
                ) -> tuple[str | None, str | None, list[dict[str, Any]] | None]:
        """A whole chat choice's reasoning, content and tool calls, its text read once. A forced call's
        text cut short goes out as content; what a model says before the calls it chose stays its
        content; the calls are read from the answer after its thinking."""
        if self.forced_tool_call is not None:  # the id its stream's first chunk gave it
            call = self.forced_tool_call.named_call(state.text, self._call_ids[index])
            return (None, None, [call]) if call is not None else (None, state.text, None)
        reasoning, text = None, state.text
        if self.reasoning is not None and state.thinking is not None:
            # A reply that thought has no content without an answer; one that did not, no reasoning.
            reasoning = state.thought if state.thinking.has_thought else None
            text = state.answer if reasoning is None else state.answer or None
        if self.tool_call_syntax is not None and text is not None:
            content, calls = self.tool_call_syntax.parse(text)
            if calls:
                return reasoning, content, calls if self.parallel_tool_calls else calls[:1]
        return reasoning, text, None

    def _finish_reason(self, state: ChoiceState, calls: list[dict[str, Any]] | None) -> str | None:
        """"tool_calls" for calls the model chose ("required", "auto"), as vLLM says it; a named
        function's calls end as their text did ("stop"), as OpenAI's forced calls do."""
        is_named = self.forced_tool_call is not None
        return "tool_calls" if state.finish_reason == "stop" and calls and not is_named else state.finish_reason

    def _tool_call_delta(self, index: int, delta: Delta) -> tuple[dict[str, Any], None]:
        """A stream chunk's delta for a named function's forced call: its arguments as they come."""
        call: dict[str, Any] = {"index": 0, "function": {"arguments": delta.text}}
        if not self._sent_role[index]:  # the call's first piece names it
            call.update(id=self._call_ids[index], type="function")
            call["function"]["name"] = self.forced_tool_call.name
        return {"tool_calls": [call]}, None

    def _split_delta(self, delta: Delta, state: ChoiceState) -> tuple[str, str]:
        """A chat delta's (thinking, answer) text, recorded in `state`; the choice's first delta says
        how its reply starts."""
        stream = state.thinking
        if stream is None:
            stream = state.thinking = self.reasoning.stream(state.prompt_token_ids)
        was_thinking = stream.is_thinking is True
        thought, text = stream.add(delta.text)
        if was_thinking or thought or stream.is_thinking:  # the token that ends the thinking is thinking's
            # A delta of several tokens (a chunk, a speculative step) may hold the answer's first ones too.
            num_answer = 0 if stream.is_thinking else self.reasoning.num_answer_tokens(delta.token_ids, text)
            state.reasoning_tokens += len(delta.token_ids) - num_answer + state.undecided_tokens
            state.undecided_tokens = 0
        elif stream.is_thinking is None:  # e.g. "<th" of a "<think>" spelled in pieces, or a harmony header
            state.undecided_tokens += len(delta.token_ids)
        else:
            state.undecided_tokens = 0
        if delta.finish_reason is not None:
            more_thought, more_text = stream.finish()
            thought, text = thought + more_thought, text + more_text
        state.thought += thought
        state.answer += text
        return thought, text

    def _parsed_delta(self, index: int, delta_text: str, is_last: bool
                      ) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
        """A stream chunk's delta under tool_choice "auto", and at the end the calls made: the text before
        any call as it comes, then the calls as they come (tool_parsers.StreamedCalls)."""
        stream = self._streamed_calls[index]
        text, calls = stream.add(delta_text)
        if is_last:
            more_text, more_calls = stream.finish()
            text, calls = text + more_text, merged_call_deltas(calls, more_calls)
        if not self.parallel_tool_calls:
            calls = [call for call in calls if call.get("index", 0) == 0]
        message: dict[str, Any] = {"content": text}
        if calls:
            message["tool_calls"] = calls
        return message, (stream.calls or None) if is_last else None

    def _echoed_logprobs(self, state: ChoiceState) -> dict[str, Any]:
        return echoed_logprobs(state.prompt_token_ids, state.prompt_logprobs, self.num_logprobs, self.token_text)

    def _prompt_logprobs(self, state: ChoiceState) -> list[dict[str, Any] | None]:
        return vllm_prompt_logprobs(state.prompt_logprobs, self.num_prompt_logprobs, self.token_text)


def _joined(first: dict[str, list], then: dict[str, list]) -> dict[str, list]:
    """Two legacy logprobs objects as one: each of their parallel lists, one after the other."""
    return {key: first[key] + then[key] for key in first}
