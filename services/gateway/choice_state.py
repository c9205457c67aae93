"""What one choice of a completion or chat response has produced so far (`ChoiceState`): its text,
tokens and logprobs, how it finished, its prompt's, and, with a reasoning parser, its text split
into thinking and answer as it came, with the tokens it thought for counted."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from protos import common_pb2, decode_pb2
from services.gateway.deltas import Delta, Usage
from services.gateway.harmony import HarmonyReasoning
from services.gateway.output_token_metrics import TokenKinds
from services.gateway.reasoning_parsers import ReasoningReader, StreamedReasoning
from services.gateway.request_timing import RequestTiming


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TopLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    timing: RequestTiming | None = None
    spec_decode: decode_pb2.SpecDecodeStats | None = None
    prompt_token_ids: Sequence[int] = ()
    prompt_logprobs: Sequence[common_pb2.TopLogprobs] = ()
    # With a reasoning parser: the text split as it came (thinking, answer), and the tokens
    # generated while thinking (its closing tag's included).
    thinking: StreamedReasoning | HarmonyReasoning | None = None
    thought: str = ""
    answer: str = ""
    reasoning_tokens: int = 0
    undecided_tokens: int = 0  # the first ones, while it is not yet known whether they open a think block
    # Whether the tokens that end the thinking have come, their text yet or not (held back while a character
    # is incomplete): the tokens after them are the answer's.
    closed_by_tokens: bool = False
    kinds: TokenKinds | None = None  # its tokens by kind as they came, once split

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
            self.timing, self.spec_decode = delta.timing, delta.spec_decode

    def split(self, delta: Delta, reasoning: ReasoningReader) -> tuple[str, str]:
        """A chat delta's (thinking, answer) text, as `reasoning` reads it, recorded here; the choice's
        first delta says how its reply starts."""
        stream = self.thinking
        if stream is None:
            stream = self.thinking = reasoning.stream(self.prompt_token_ids)
            self.kinds = TokenKinds()
        was_thinking = stream.is_thinking is True
        reasoning_before, undecided_before = self.reasoning_tokens, self.undecided_tokens
        thought, text = stream.add(delta.text)
        if self.closed_by_tokens:
            pass  # the answer's tokens, whatever text of the close is still held back
        elif was_thinking or thought or stream.is_thinking:  # the token that ends the thinking is thinking's
            # A delta of several tokens (a chunk, a speculative step) may hold the answer's first ones too.
            num_answer = reasoning.tokens_after_close(self.token_ids, len(delta.token_ids))
            self.closed_by_tokens = num_answer is not None
            if num_answer is None:
                num_answer = 0 if stream.is_thinking else reasoning.num_answer_tokens(delta.token_ids, text)
            self.reasoning_tokens += len(delta.token_ids) - num_answer + self.undecided_tokens
            self.undecided_tokens = 0
        elif stream.is_thinking is None:  # e.g. "<th" of a "<think>" spelled in pieces, or a harmony header
            self.undecided_tokens += len(delta.token_ids)
        else:
            self.undecided_tokens = 0
        num_reasoning = self.reasoning_tokens - reasoning_before  # undecided ones it decided included
        self.kinds.add("reasoning", num_reasoning, delta.arrived)
        self.kinds.add("content", len(delta.token_ids) - num_reasoning - (self.undecided_tokens - undecided_before),
                       delta.arrived)
        if delta.finish_reason is not None:
            more_thought, more_text = stream.finish()
            thought, text = thought + more_thought, text + more_text
        self.thought += thought
        self.answer += text
        return thought, text
