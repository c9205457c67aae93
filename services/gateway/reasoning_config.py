"""vLLM's `--reasoning-config`, and the token ids a request's `thinking_token_budget` is kept by.

A budget (engine/thinking_budget.py) needs the tokens that open and close the model's thinking, and
those the workers write to close it once the budget is spent. `--reasoning-parser` names the first
two (its tags: `<think>` and `</think>`, Seed-OSS's own); `--reasoning-config` names them where no
parser does, or overrides them, as vLLM's does:
`{"reasoning_start_str": "<think>", "reasoning_end_str": "\\n\\nTime to answer.\\n</think>"}`. Its
end string is what is written, and may lead into the close with a phrase: the parser's close (or,
without a parser, the string itself) must end it. gpt-oss's harmony channels have no tags: a
budget needs the config's strings there.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protos import common_pb2
from services.common.settings import ConfigError
from services.gateway.reasoning_parsers import HARMONY, PARSERS, parser_named, tags_of
from services.gateway.request_errors import InvalidRequestError

KEYS = ("reasoning_start_str", "reasoning_end_str", "reasoning_parser")


@dataclass(frozen=True)
class ReasoningConfig:
    reasoning_start_str: str = ""  # "": the parser's opening tag
    reasoning_end_str: str = ""  # written to close the thinking; "": the parser's closing tag
    reasoning_parser: str = ""  # vLLM's key: the parser whose tags are meant; "": --reasoning-parser's

    @classmethod
    def from_json(cls, given: Mapping[str, Any]) -> ReasoningConfig:
        unknown = sorted(set(given) - set(KEYS))
        if unknown:
            raise ConfigError(f"--reasoning-config: unknown keys {unknown}; it takes {', '.join(KEYS)}")
        if any(not isinstance(value, str) for value in given.values()):
            raise ConfigError("--reasoning-config: its values are strings")
        config = cls(**{**given, "reasoning_parser": parser_named(given.get("reasoning_parser", ""))})
        if config.reasoning_parser and config.reasoning_parser not in PARSERS:
            raise ConfigError(f"--reasoning-config: reasoning_parser must be one of {', '.join(PARSERS)}, "
                              f"got {config.reasoning_parser!r}")
        return config

    def tags(self, parser: str | None) -> tuple[str, str, str]:
        """(opening, closing, written to close): what the budget is kept by, "" where nothing names it."""
        if self.reasoning_parser and parser and self.reasoning_parser != parser:
            raise ConfigError(f"--reasoning-config names the parser {self.reasoning_parser!r}, "
                              f"--reasoning-parser {parser!r}")
        parser = self.reasoning_parser or parser
        start = end = ""
        if parser and parser != HARMONY:
            start, end = tags_of(parser).start, tags_of(parser).end
        end = end or self.reasoning_end_str
        return self.reasoning_start_str or start, end, self.reasoning_end_str or end


@dataclass(frozen=True)
class ThinkingMarkers:
    """The token ids a request's thinking budget is kept by."""

    start_token_ids: tuple[int, ...]
    end_token_ids: tuple[int, ...]
    forced_end_token_ids: tuple[int, ...]

    def fill(self, budget: common_pb2.ThinkingBudget) -> None:
        """The ids a request's budget leaves out (the gRPC API's may give its own)."""
        if not budget.start_token_ids:
            budget.start_token_ids[:] = self.start_token_ids
        if not budget.end_token_ids:
            budget.end_token_ids[:] = self.end_token_ids
            budget.forced_end_token_ids[:] = self.forced_end_token_ids


def thinking_markers(config: ReasoningConfig | None, parser: str | None, tokenizer) -> ThinkingMarkers | None:
    """The markers `config` and `parser` name, encoded by the model's `tokenizer`; None where they name
    none (no budget can be kept). ConfigError where the written close does not end with the close."""
    start, end, forced = (config or ReasoningConfig()).tags(parser)
    if not start or not end:
        if config is not None:
            raise ConfigError("--reasoning-config: reasoning_start_str and reasoning_end_str are needed where "
                              "no --reasoning-parser names the model's thinking tags")
        return None
    start_ids, end_ids, forced_ids = (tuple(tokenizer.encode(text, add_special_tokens=False))
                                      for text in (start, end, forced))
    if not start_ids or not end_ids:
        raise ConfigError(f"--reasoning-config: the tokenizer writes {start!r} or {end!r} as no tokens")
    if forced_ids[-len(end_ids):] != end_ids:
        raise ConfigError(f"--reasoning-config: reasoning_end_str {forced!r} must end with {end!r} as the "
                          f"tokenizer writes it, which closes the thinking")
    return ThinkingMarkers(start_ids, end_ids, forced_ids)


def fill_thinking_budget(params: common_pb2.SamplingParams, markers: ThinkingMarkers | None) -> None:
    """A request's budget given its markers; InvalidRequestError where the gateway knows none."""
    if not params.HasField("thinking_budget"):
        return
    budget = params.thinking_budget
    if budget.start_token_ids and budget.end_token_ids:
        return
    if markers is None:
        raise InvalidRequestError("thinking_token_budget needs the model's thinking tags: start the gateway with "
                                  "--reasoning-parser or --reasoning-config", param="thinking_token_budget")
    markers.fill(budget)
