"""A request's engine outputs as the decode service sends them: several steps' tokens in one
chunk where that saves messages without holding a token back for nothing.

Each chunk costs a gRPC message here and, at the gateway, a read, a detokenization and an
event to its client, whatever the tokens in it. So outputs queued behind the one at hand
(the call's writes fell behind the engine's steps) go out merged with it, as vLLM's output
collector merges a slow consumer's deltas; and with a stream interval of N (vLLM's and
SGLang's `--stream-interval`) a chunk waits for N new tokens, except one with the request's
first token (time to first token) and the last.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from engine.outputs import RequestOutput


class OutputBatches:
    """`next()` gives a request's outputs from `outputs` (its engine queue), merged as said above;
    an exception queued behind merged outputs comes at the next call, after them.
    `is_first_token_sent`: the request's first token went out before (a prefill worker's, or the
    output a moved request brings): no output here goes out early for it."""

    def __init__(self, outputs: asyncio.Queue, stream_interval: int = 1, is_first_token_sent: bool = False) -> None:
        self.outputs = outputs
        self.stream_interval = max(stream_interval, 1)
        self._is_first = not is_first_token_sent
        self._next: Any = None  # taken from the queue, not merged: what ends the batch before it
        self.on_first_output: Callable[[], None] | None = None  # called as the first output is taken

    async def next(self) -> RequestOutput | BaseException:
        out = await self._take()
        at_least = 1 if self._is_first else self.stream_interval
        self._is_first = False
        if not isinstance(out, RequestOutput):
            return out
        if self.on_first_output is not None:
            self.on_first_output()
            self.on_first_output = None
        first, num_tokens = out, len(out.new_token_ids)
        token_ids: list[int] | None = None  # the batch's new tokens (`logprobs` theirs), once past `first`
        while not out.finished and (num_tokens < at_least or not self.outputs.empty()):
            following = await self._take()
            if not isinstance(following, RequestOutput):
                self._next = following
                break
            if token_ids is None:  # lists of its own: the batch grows in place, not by a copy per step
                token_ids, logprobs = list(first.new_token_ids), list(first.new_logprobs)
            token_ids += following.new_token_ids
            logprobs += following.new_logprobs
            num_tokens += len(following.new_token_ids)
            out = following
        return first if token_ids is None else merged(first, out, token_ids, logprobs)

    async def _take(self) -> Any:
        if self._next is not None:
            taken, self._next = self._next, None
            return taken
        return await self.outputs.get()


def merged(first: RequestOutput, last: RequestOutput, token_ids: list[int],
           logprobs: list[dict[int, float]]) -> RequestOutput:
    """One output for a request's consecutive outputs `first` to `last`, whose new tokens (and their
    logprobs) are `token_ids`: the last's totals and end, the first's first-output facts (prompt
    logprobs, cached tokens, timings)."""
    return dataclasses.replace(
        last, new_token_ids=token_ids, new_logprobs=logprobs,
        prompt_logprobs=first.prompt_logprobs if first.prompt_logprobs is not None else last.prompt_logprobs,
        num_cached_tokens=first.num_cached_tokens or last.num_cached_tokens,
        step_times=first.step_times or last.step_times)
