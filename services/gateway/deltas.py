"""What a request's stream of output is made of: `Delta`s of text and token ids, and the
`TextOutput` that turns generated token ids into them (incremental detokenization, then
stop strings)."""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

from protos import common_pb2, decode_pb2
from services.gateway.request_errors import InvalidRequestError
from services.gateway.request_timing import RequestTiming
from services.tokenizer.incremental_detokenizer import Decoder, IncrementalDetokenizer
from services.tokenizer.stop_strings import Stop, StopRegexTimeout, StopStringMatcher


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from prefill's prefix cache


@dataclass
class Delta:
    """What one step of a request adds: new text (never a partial character, never past
    a stop string) and the new token ids. The last delta has `finish_reason` and `usage`."""

    text: str
    token_ids: list[int]
    logprobs: list[common_pb2.TopLogprobs] = field(default_factory=list)  # one per token when requested
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" on the last delta
    matched_stop: str | None = None   # the stop string that ended the text, when one did
    usage: Usage | None = None
    # The first delta's: the prompt's token ids, and when sampling.prompt_logprobs asks, one record
    # per prompt token after the first.
    prompt_token_ids: Sequence[int] = ()
    prompt_logprobs: Sequence[common_pb2.TopLogprobs] = ()
    timing: RequestTiming | None = None  # the last delta's: the request's, as vLLM's per-request metrics
    spec_decode: decode_pb2.SpecDecodeStats | None = None  # the last delta's, from a worker that keeps them
    arrived: float = 0.0  # when (a `time.perf_counter()`) its tokens reached the gateway


class TextOutput:
    """Generated token ids → text deltas: incremental detokenization, then stop strings. The text
    of the first `min_tokens` tokens goes out as it is, as vLLM's does: stop strings are looked
    for in what follows it. The token that stopped the text (EOS or a stop token id) counts, but
    its text is left out unless `include_stop_str_in_output`, as vLLM leaves it out."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int], stop: Sequence[Stop],
                 include_stop_str_in_output: bool, min_tokens: int = 0, skip_special_tokens: bool = True):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.stops = StopStringMatcher(stop, include_stop_str_in_output)
        self.min_tokens = min_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self._num_untexted = 0  # the stopping token, when its text is left out

    @property
    def num_tokens(self) -> int:
        return len(self.detokenizer.output_token_ids) + self._num_untexted

    def add(self, token_ids: Sequence[int], is_stopped_by_last: bool = False) -> str:
        """The text to send for `token_ids`; `is_stopped_by_last`: the worker stopped the text at the
        last of them."""
        if is_stopped_by_last and token_ids and not self.include_stop_str_in_output:
            text = self._text(token_ids[:-1])
            self._num_untexted = 1
            return text
        return self._text(token_ids)

    def _text(self, token_ids: Sequence[int]) -> str:
        unmatched = min(len(token_ids), self.min_tokens - self.num_tokens)
        if unmatched <= 0:
            return self._unstopped(self.detokenizer.add(token_ids))
        text = self.detokenizer.add(token_ids[:unmatched])
        rest = token_ids[unmatched:]
        return text + self._unstopped(self.detokenizer.add(rest)) if rest else text

    def finish(self) -> str:
        return self._unstopped(self.detokenizer.finish()) + self.stops.finish()

    def _unstopped(self, text: str) -> str:
        try:
            return self.stops.add(text)[0]
        except StopRegexTimeout as e:
            raise InvalidRequestError(str(e), param="stop_regex") from None

    def last_delta(self, text: str, token_ids: list[int], logprobs: list, reason: str | None, usage: Usage) -> Delta:
        """The request's last delta: "stop" where a stop string ended the text, else the worker's `reason`."""
        matched = self.stops.matched_stop
        return Delta(text, token_ids, logprobs, finish_reason="stop" if matched is not None else reason,
                     matched_stop=matched, usage=usage)


async def prompt_only(deltas: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """vLLM's prompt-only completion (echo with max_tokens 0) from a request run for one token: its
    deltas less that token (text, id, logprobs, usage), ending as "length" as vLLM's does (an error or
    an abort ends as it is); the prompt's ids and logprobs as they come."""
    async with aclosing(deltas) as stream:
        async for delta in stream:
            finish_reason = "length" if delta.finish_reason in ("stop", "length") else delta.finish_reason
            usage = dataclasses.replace(delta.usage, completion_tokens=0) if delta.usage is not None else None
            yield dataclasses.replace(delta, text="", token_ids=[], logprobs=[], finish_reason=finish_reason,
                                      matched_stop=None, usage=usage)
