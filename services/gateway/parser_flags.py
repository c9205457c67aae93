"""The gateway's flags for reading a chat reply's tool calls and thinking out of its text, as vLLM
names them: --tool-call-parser (with --enable-auto-tool-choice), --reasoning-parser and --reasoning-config."""
from __future__ import annotations

import argparse
from collections.abc import Mapping

from services.common.settings import ConfigError, json_object
from services.gateway.reasoning_config import ReasoningConfig
from services.gateway.reasoning_parsers import (
    HARMONY,
    PARSERS as REASONING_PARSERS,
    parser_named as reasoning_parser_named,
)
from services.gateway.tool_parsers import parser_named as tool_parser_named

ENV_TOOL_CALL_PARSER = "BATON_GATEWAY_TOOL_CALL_PARSER"
ENV_REASONING_PARSER = "BATON_GATEWAY_REASONING_PARSER"
ENV_REASONING_CONFIG = "BATON_GATEWAY_REASONING_CONFIG"


def add_parser_flags(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    parser.add_argument("--tool-call-parser", default=env.get(ENV_TOOL_CALL_PARSER) or None,
                        help=f"the served model's tool-call syntax, read out of its text for tool_choice "
                             f"\"auto\" (without it, \"auto\" is refused); vLLM's names or SGLang's "
                             f"(${ENV_TOOL_CALL_PARSER})")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="vLLM's: tool_choice \"auto\" served, which --tool-call-parser alone does here "
                             "(taken so that vLLM's command lines start the gateway; it needs --tool-call-parser)")
    parser.add_argument("--reasoning-parser", default=env.get(ENV_REASONING_PARSER) or None,
                        help=f"the served model's way of thinking ({', '.join(REASONING_PARSERS)}): chat "
                             f"replies give its thinking as `reasoning`, apart from the answer; SGLang's names "
                             f"too (${ENV_REASONING_PARSER})")
    parser.add_argument("--reasoning-config", default=env.get(ENV_REASONING_CONFIG, ""),
                        help=f"vLLM's: a JSON object naming the thinking's tags a request's thinking_token_budget "
                             f"is kept by, where --reasoning-parser does not or to override it: "
                             f"reasoning_start_str, reasoning_end_str (written to close the thinking: it may lead "
                             f"into the close with a phrase) (${ENV_REASONING_CONFIG})")


def tool_call_parser(args: argparse.Namespace) -> str | None:
    if args.tool_call_parser is None:
        if args.enable_auto_tool_choice:  # as vLLM refuses it
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser: the model's tool-call syntax, "
                              "which tool_choice \"auto\" reads its calls by")
        return None
    return tool_parser_named(args.tool_call_parser)


def reasoning_config(args: argparse.Namespace) -> ReasoningConfig | None:
    if not args.reasoning_config:
        return None
    return ReasoningConfig.from_json(json_object(args.reasoning_config, "--reasoning-config"))


def reasoning_parser(args: argparse.Namespace) -> str | None:
    """The flag's parser; gpt-oss's tool calls (`--tool-call-parser openai`) bring their reasoning
    parser, as vLLM reads every harmony reply's channels."""
    if args.reasoning_parser is None:
        return HARMONY if tool_call_parser(args) == "openai" else None
    return reasoning_parser_named(args.reasoning_parser)
