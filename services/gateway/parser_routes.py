"""SGLang's parsers as endpoints, for clients that generate raw text (`/generate`, a completion) and
read it as the chat API would: `POST /parse_function_call` (`text`, `tools`, `tool_call_parser`) answers
the text before the calls and the calls, `{"normal_text", "calls": [{"tool_index", "name",
"parameters"}]}` (each call's index among them, its arguments' JSON text); `POST /separate_reasoning`
(`text`, `reasoning_parser`) answers `{"reasoning_text", "text"}`. The parsers are the chat API's own
(tool_parsers.py, reasoning_parsers.py), named as vLLM or SGLang names them; a request naming none
uses the gateway's (`--tool-call-parser`, `--reasoning-parser`), and where there is none either it is
a 400. gpt-oss's calls (`openai`) are read out of its final channel, as the chat API reads them.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

from services.gateway import reasoning_parsers, tool_parsers
from services.gateway.errors import APIError
from services.gateway.http_body import parsed_body


class ParseFunctionCallRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: str
    tools: list[dict[str, Any]] = []
    tool_call_parser: str | None = None


class SeparateReasoningRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: str
    reasoning_parser: str | None = None


def named_parser(name: str | None, default: str | None, known, param: str) -> str:
    """The parser a request names (vLLM's name or SGLang's), else the gateway's; a 400 for none or an
    unknown one."""
    if name is None:
        if default is None:
            raise APIError(400, f"name a {param}: this gateway was started without one", param=param)
        return default
    parser = known.parser_named(name)
    if parser not in known.PARSERS:
        raise APIError(400, f"{param} must be one of {', '.join(known.PARSERS)} (or SGLang's names: "
                            f"{', '.join(known.SGLANG_NAMES)}), got {name!r}", param=param)
    return parser


def function_calls(body: ParseFunctionCallRequest, default_parser: str | None) -> dict[str, Any]:
    parser = named_parser(body.tool_call_parser, default_parser, tool_parsers, "tool_call_parser")
    for i, tool in enumerate(body.tools):
        if not isinstance((tool.get("function") or {}).get("name"), str):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           param="tools")
    text = body.text
    if parser == "openai":  # harmony's calls go on with its final channel: read them out of it
        _, text = reasoning_parsers.separated(reasoning_parsers.HARMONY, text)
    content, calls = tool_parsers.syntax_for(parser, body.tools).parse(text)
    return {"normal_text": content or "",
            "calls": [{"tool_index": index, "name": call["function"]["name"],
                       "parameters": call["function"]["arguments"]} for index, call in enumerate(calls)]}


def add_parser_routes(app: FastAPI, tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """The routes; `tool_call_parser`, `reasoning_parser`: the gateway's (None: requests name theirs)."""

    @app.post("/parse_function_call")
    async def parse_function_call(request: Request) -> dict[str, Any]:
        return function_calls(await parsed_body(request, ParseFunctionCallRequest), tool_call_parser)

    @app.post("/separate_reasoning")
    async def separate_reasoning(request: Request) -> dict[str, str]:
        body = await parsed_body(request, SeparateReasoningRequest)
        parser = named_parser(body.reasoning_parser, reasoning_parser, reasoning_parsers, "reasoning_parser")
        thought, answer = reasoning_parsers.separated(parser, body.text)
        return {"reasoning_text": thought, "text": answer}
