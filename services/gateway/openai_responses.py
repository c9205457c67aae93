"""OpenAI response bodies built from pipeline `Delta`s: completions and chat, whole or as stream
chunks, with usage and logprobs (openai_logprobs.py) in the shapes the `openai` client parses.

A completion with `echo` starts with its prompt (the text as given, or the ids decoded), and
with `logprobs` its prompt's tokens come first in them. vLLM's `prompt_logprobs` go in each
completion choice (a chat's at the top of its response), as vLLM's `return_token_ids` puts the
prompt's token ids (each choice's `token_ids` are its own; streamed, each chunk's, the prompt's in
a choice's first). A chat choice's thinking is split from its answer (choice_state.py), and its
tool calls read as the request asked (choice_calls.py)."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from services.gateway.choice_calls import ChoiceCalls
from services.gateway.choice_state import ChoiceState
from services.gateway.deltas import Delta, Usage
from services.gateway.openai_logprobs import (
    TokenText,
    chat_logprobs,
    completion_logprobs,
    echoed_logprobs,
    joined_logprobs,
    vllm_prompt_logprobs,
)
from services.gateway.reasoning_parsers import ReasoningReader
from services.gateway.reply_options import ReplyOptions
from services.gateway.request_timing import UNKNOWN
from services.gateway.spec_decode_metrics import speculative_decoding
from services.gateway.tool_calls import ForcedToolCall, new_call_id
from services.gateway.tool_parsers import ToolCallSyntax

NO_METRICS = ReplyOptions()  # replies carry no `metrics`


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


class ResponseBuilder:
    """Bodies for one request's response: chunks while streaming, or the whole object."""

    def __init__(self, *, kind: str, response_id: str, model: str, num_choices: int, prompt_of_choice: Sequence[int],
                 token_text: TokenText, want_logprobs: bool, num_logprobs: int = 0,
                 echo_of_prompt: Sequence[str] | None = None, num_prompt_logprobs: int | None = None,
                 forced_tool_call: ForcedToolCall | None = None, tool_call_syntax: ToolCallSyntax | None = None,
                 call_id: Callable[[], str] = new_call_id, reasoning: ReasoningReader | None = None,
                 include_reasoning: bool = True, parallel_tool_calls: bool = True, return_token_ids: bool = False,
                 best_of_kept: int | None = None, role: str = "assistant", reply_options: ReplyOptions = NO_METRICS):
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
        self.return_token_ids = return_token_ids  # vLLM's: the prompt's and each choice's token ids too
        # With best_of: how many of each prompt's candidates the whole response keeps (whole() ranks them)
        self.best_of_kept = best_of_kept
        self.role = role  # of a chat reply's message
        self.reply_options = reply_options  # whether the whole body and the usage chunk carry `metrics` (vLLM's flags)
        self._sent_role = [False] * num_choices
        # chat: each choice's tool calls, as tool_choice asks for them (choice_calls.py)
        self.calls = ChoiceCalls(num_choices, forced_tool_call, tool_call_syntax, call_id, parallel_tool_calls)
        # chat with --reasoning-parser: each choice's thinking read out of its text (reasoning_parsers.py)
        self.reasoning = reasoning
        self.include_reasoning = include_reasoning

    @property
    def usage(self) -> dict[str, Any]:
        usages = [c.usage or Usage(0, len(c.token_ids), 0) for c in self.choices]
        return usage_body(usages, self.prompt_of_choice, self.reasoning_tokens)

    @property
    def has_metrics(self) -> bool:
        return self.reply_options.has_metrics

    @property
    def metrics(self) -> dict[str, Any] | None:
        """The request's timing (request_timing.py) and speculative steps (spec_decode_metrics.py), as the
        gateway's flags ask; None for a reply of several sequences (n > 1, best_of, several prompts),
        whose figures are no one request's."""
        if len(self.choices) != 1:
            return None
        state, options = self.choices[0], self.reply_options
        made = (state.timing or UNKNOWN).to_json() if options.has_timing else {}
        if options.output_token_metrics and self.kind == "chat":
            made["output_token_metrics"] = None if state.thinking is None else state.kinds.to_json(
                state.timing.scheduled_at if state.timing is not None else None, state.undecided_tokens)
        if options.spec_decode_metrics != "none":
            made["speculative_decoding"] = None if state.spec_decode is None else speculative_decoding(
                state.spec_decode, options.spec_decode_metrics == "detailed")
        return made

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
                    logprobs = joined_logprobs(self._echoed_logprobs(state), logprobs)
            choice = {"index": index, "text": echoed + delta.text, "logprobs": logprobs,
                      "finish_reason": delta.finish_reason, "stop_reason": state.stop_reason}
            if is_first and self.num_prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._prompt_logprobs(state)
            if self.return_token_ids:
                if is_first:
                    choice["prompt_token_ids"] = list(state.prompt_token_ids)
                choice["token_ids"] = list(delta.token_ids)
            body = self._head("text_completion")
        else:
            if self.want_logprobs:
                logprobs = chat_logprobs(delta.logprobs, self.token_text)
            thought, text = state.split(delta, self.reasoning) if self.reasoning is not None else ("", delta.text)
            message, calls = self.calls.delta(index, delta, text, not self._sent_role[index])
            if thought:
                if self.include_reasoning:
                    message.update(reasoning=thought, reasoning_content=thought)
                if not message.get("content"):
                    message.pop("content", None)
            if not self._sent_role[index]:
                if self.echo_of_prompt is not None:
                    message["content"] = echoed + (message.get("content") or "")
                message["role"] = self.role
                self._sent_role[index] = True
            finish_reason = self.calls.finish_reason(state.finish_reason, calls) if delta.finish_reason else None
            choice = {"index": index, "delta": message, "logprobs": logprobs, "finish_reason": finish_reason,
                      "stop_reason": state.stop_reason}
            if self.return_token_ids:
                choice["token_ids"] = list(delta.token_ids)
            body = self._head("chat.completion.chunk")
            if is_first and self.num_prompt_logprobs is not None:
                body["prompt_logprobs"] = self._prompt_logprobs(state)
            if is_first and self.return_token_ids:
                body["prompt_token_ids"] = list(state.prompt_token_ids)
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
        body = self._chunk_without_choices("usage", self.usage)
        if self.has_metrics:
            body["metrics"] = self.metrics
        return body

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
            state.split(delta, self.reasoning)

    def whole(self) -> dict[str, Any]:
        choices = []
        for new_index, index in enumerate(self._kept()):
            state = self.choices[index]
            if self.kind == "completion":
                echoed = "" if self.echo_of_prompt is None else self.echo_of_prompt[self.prompt_of_choice[index]]
                logprobs = None
                if self.want_logprobs:
                    logprobs = completion_logprobs(state.logprobs, self.token_text, len(echoed))
                    if self.echo_of_prompt is not None:
                        logprobs = joined_logprobs(self._echoed_logprobs(state), logprobs)
                choice = {"index": new_index, "text": echoed + state.text, "logprobs": logprobs,
                          "finish_reason": state.finish_reason, "stop_reason": state.stop_reason}
                if self.num_prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs(state)
                if self.return_token_ids:
                    choice.update(prompt_token_ids=list(state.prompt_token_ids), token_ids=state.token_ids)
                choices.append(choice)
            else:
                logprobs = chat_logprobs(state.logprobs, self.token_text) if self.want_logprobs else None
                reasoning, content, calls = self._answer(index, state)
                if self.echo_of_prompt is not None:
                    content = self.echo_of_prompt[self.prompt_of_choice[index]] + (content or "")
                message = {"role": self.role, "content": content, "refusal": None, "tool_calls": calls or []}
                if reasoning is not None and self.include_reasoning:
                    message.update(reasoning=reasoning, reasoning_content=reasoning)
                choices.append({"index": new_index, "message": message, "logprobs": logprobs,
                                "finish_reason": self.calls.finish_reason(state.finish_reason, calls),
                                "stop_reason": state.stop_reason})
                if self.return_token_ids:
                    choices[-1]["token_ids"] = state.token_ids
        body = self._head("text_completion" if self.kind == "completion" else "chat.completion")
        body["choices"] = choices
        if self.kind == "chat" and self.num_prompt_logprobs is not None:  # every choice has the same prompt
            body["prompt_logprobs"] = self._prompt_logprobs(self.choices[0])
        if self.kind == "chat" and self.return_token_ids:
            body["prompt_token_ids"] = list(self.choices[0].prompt_token_ids)
        body["usage"] = self.usage
        if self.has_metrics:
            body["metrics"] = self.metrics
        return body

    def _kept(self) -> list[int]:
        """The choices a whole response gives: all, or with best_of each prompt's `best_of_kept` whose
        tokens have the highest mean logprob (OpenAI's "highest log probability per token"), best first.
        Every candidate still counts in the usage: each was generated."""
        if self.best_of_kept is None:
            return list(range(len(self.choices)))
        by_prompt: dict[int, list[int]] = {}
        for index, prompt in enumerate(self.prompt_of_choice):
            by_prompt.setdefault(prompt, []).append(index)

        def mean_logprob(index: int) -> float:
            entries = self.choices[index].logprobs
            return sum(entry.sampled.logprob for entry in entries) / len(entries) if entries else float("-inf")

        return [index for candidates in by_prompt.values()
                for index in sorted(candidates, key=mean_logprob, reverse=True)[:self.best_of_kept]]

    def _answer(self, index: int, state: ChoiceState
                ) -> tuple[str | None, str | None, list[dict[str, Any]] | None]:
        """A whole chat choice's reasoning, content and tool calls, its text read once. A forced call's
        text is read whole; the calls a model chose are read from the answer after its thinking."""
        if self.calls.is_named:
            content, calls = self.calls.named_call(index, state.text)
            return None, content, calls
        reasoning, text = None, state.text
        if self.reasoning is not None and state.thinking is not None:
            # A reply that thought has no content without an answer; one that did not, no reasoning.
            reasoning = state.thought if state.thinking.has_thought else None
            text = state.answer if reasoning is None else state.answer or None
        if text is None:
            return reasoning, None, None
        content, calls = self.calls.parsed(text)
        return reasoning, content, calls

    def _echoed_logprobs(self, state: ChoiceState) -> dict[str, Any]:
        return echoed_logprobs(state.prompt_token_ids, state.prompt_logprobs, self.num_logprobs, self.token_text)

    def _prompt_logprobs(self, state: ChoiceState) -> list[dict[str, Any] | None]:
        return vllm_prompt_logprobs(state.prompt_logprobs, self.num_prompt_logprobs, self.token_text)
