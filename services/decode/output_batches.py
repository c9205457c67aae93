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

    async def next(self) -> RequestOutput | BaseException:
        out = await self._take()
        at_least = 1 if self._is_first else self.stream_interval
        self._is_first = False
        while isinstance(out, RequestOutput) and not out.finished:
            if len(out.new_token_ids) >= at_least and self.outputs.empty():
                break
            following = await self._take()
            if not isinstance(following, RequestOutput):
                self._next = following
                break
            out = merged(out, following)
        return out

    async def _take(self) -> Any:
        if self._next is not None:
            taken, self._next = self._next, None
            return taken
        return await self.outputs.get()


def merged(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output for two consecutive ones of a request: the tokens new in either, the later's
    totals and end, the earlier's first-output facts (prompt logprobs, cached tokens)."""
    return dataclasses.replace(
        later, new_token_ids=earlier.new_token_ids + later.new_token_ids,
        new_logprobs=earlier.new_logprobs + later.new_logprobs,
        prompt_logprobs=earlier.prompt_logprobs if earlier.prompt_logprobs is not None else later.prompt_logprobs,
        num_cached_tokens=earlier.num_cached_tokens or later.num_cached_tokens,
        step_times=earlier.step_times or later.step_times)
