"""Tool calls a model chose to make (`tool_choice: "auto"`), read out of its text.

Models write calls in their own syntax; `--tool-call-parser` names the one the served model
uses (each a ToolCallSyntax, read in json_tool_calls.py unless another module is named):
- `hermes` (Qwen2.5 and Qwen3, Hermes, many fine-tunes): each call a JSON object
  `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, after any
  text the model says first;
- `llama3_json` (Llama 3.1 to 3.3): the whole answer is the calls, JSON objects
  `{"name": ..., "parameters": {...}}` separated by `;` (after `<|python_tag|>`, a special
  token the text leaves out);
- `pythonic` (Llama 3.2 and 4, and models tuned to it): the whole answer is a Python list of
  calls with keyword arguments, `[get_weather(city="Paris"), get_time()]`, their values Python
  literals (after `<|python_start|>`, a special token, for Llama 4);
- `qwen3_coder` (Qwen3-Coder, Qwen3-Next, Qwen3.5): XML calls, `<function=NAME>` and a
  `<parameter=NAME>` per argument, typed by the request's tool schemas (xml_tool_calls.py);
- `seed_oss` (Seed-OSS): the same between `<seed:tool_call>` tags; `minimax_m2` (MiniMax-M2):
  `<invoke name="NAME">` and a `<parameter name="KEY">` per argument, typed alike;
- `glm45` (GLM-4.5 to 4.7): `<tool_call>NAME`, `<arg_key>`/`<arg_value>` pairs, typed alike;
- `deepseek_v3`, `deepseek_v31` and `kimi_k2` (DeepSeek-V3 and R1-0528; V3.1 and V3.2; Kimi K2):
  calls between the models' special tokens (special_token_calls.py);
- `mistral` (Mistral's instruct models): the calls after `[TOOL_CALLS]`, a JSON list or each one
  named, with Mistral's 9-character call ids (mistral_tool_calls.py);
- `granite` (Granite 3.x): the whole answer is a JSON list of calls, after `<|tool_call|>` (3.0's
  special token, which the text leaves out) or `<tool_call>` (3.1);
- `phi4_mini_json` (Phi-4-mini): `functools` and a JSON list of calls, after any text;
- `openai` (gpt-oss): harmony messages to `functions.NAME` (harmony.py), read after the
  `openai_gptoss` reasoning parser has taken the reply's channels apart.
A text whose calls are not whole JSON is answered as text, as vLLM's parsers do.

Streaming: text goes out as it comes until a call starts; what could be the start of one is
held back until the next delta says, as stop strings are. From the first call on, `hermes`,
`llama3_json` and `mistral` calls stream as vLLM's do: a call's id and name as soon as its `"name"` is
whole, then its arguments as the model writes them. Their `arguments` are the model's own JSON
text of them (valid JSON, its spacing kept), whole or streamed, so a stream adds up to the whole
reply. A call written otherwise (its arguments before its name, say) goes out whole once it is,
and a `pythonic` call once its `)` is written, parsed whole (its arguments are JSON only then).
A call that turns out broken once streamed stays as far as it got, as vLLM's does; a reply whose
calls are broken before any went out is text.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from services.gateway.call_text import Calls, JsonScan
from services.gateway.errors import APIError
from services.gateway.harmony import HarmonyCalls
from services.gateway.json_tool_calls import Granite, Hermes, Llama3Json, Phi4MiniJson, Pythonic
from services.gateway.mistral_tool_calls import Mistral
from services.gateway.special_token_calls import DeepSeekV3, DeepSeekV31, KimiK2
from services.gateway.tool_calls import new_call_id
from services.gateway.xml_tool_calls import Glm45, MiniMaxM2, Qwen3Coder, SeedOss


class ToolCallSyntax(Protocol):
    reads_special_tokens: bool  # its calls begin at a special token, which the text must keep

    def call_id(self) -> str:
        """A new id for a call it read."""

    def template_call_id(self, call_id: str) -> str:
        """`call_id`, a client's, as its model's chat template takes it back."""

    def parse(self, text: str) -> tuple[str | None, Calls]:
        """(the text before the calls, None when there is none; the calls, OpenAI's shape)."""

    def call_start(self, text: str, at_start: bool) -> int | None:
        """Where in `text` calls begin, if they do; `at_start`: nothing was sent before it."""

    def held_back(self, text: str, at_start: bool) -> int:
        """How many of `text`'s last characters could still turn out to begin a call."""

    def progress(self, text: str, scans: dict[int, JsonScan]) -> list[tuple[str, str]]:
        """The calls `text` (from where calls begin) has begun, in order, as far as each streams:
        (its name, its arguments' text so far); up to the first whose name is not whole yet, or
        that does not stream. `scans`: what earlier calls on the same text, shorter, scanned."""


PARSERS: dict[str, ToolCallSyntax] = {"hermes": Hermes(), "llama3_json": Llama3Json(), "pythonic": Pythonic(),
                                      "mistral": Mistral(), "qwen3_coder": Qwen3Coder(), "glm45": Glm45(),
                                      "deepseek_v3": DeepSeekV3(), "deepseek_v31": DeepSeekV31(), "kimi_k2": KimiK2(),
                                      "granite": Granite(), "phi4_mini_json": Phi4MiniJson(), "openai": HarmonyCalls(),
                                      "seed_oss": SeedOss(), "minimax_m2": MiniMaxM2()}
TYPED_BY_TOOLS = {"qwen3_coder": Qwen3Coder, "glm45": Glm45, "seed_oss": SeedOss, "minimax_m2": MiniMaxM2}
# SGLang's names (its --tool-call-parser) for the syntaxes above, so that its users' flags and
# requests name them unchanged; its others are the same as vLLM's.
SGLANG_NAMES = {"qwen25": "hermes", "qwen": "hermes", "llama3": "llama3_json", "deepseekv3": "deepseek_v3",
                "deepseekv31": "deepseek_v31", "glm": "glm45", "glm47": "glm45", "gpt-oss": "openai",
                "minimax-m2": "minimax_m2"}


# vLLM's names of a model's parser (its --tool-call-parser) whose calls are one of the syntaxes above: Step-3.5's and
# 3.7's are Qwen3-Coder's XML.
VLLM_NAMES = {"step3p5": "qwen3_coder"}


def parser_named(name: str) -> str:
    """The parser `name` names, by vLLM's name or SGLang's (one neither knows, as it is)."""
    return VLLM_NAMES.get(name) or SGLANG_NAMES.get(name, name)


def syntax_for(parser: str, tools: list[dict[str, Any]] | None) -> ToolCallSyntax:
    """The syntax `parser` names, for a request offering `tools`: `qwen3_coder` and `glm45` type their
    calls' arguments by the tools' schemas, the others read them as the model wrote them."""
    return TYPED_BY_TOOLS[parser](tools) if parser in TYPED_BY_TOOLS else PARSERS[parser]


def call_ids(parser: str | None) -> Callable[[], str]:
    """Where a gateway's new tool-call ids come from, forced calls' too: its parser's kind (Mistral's
    templates take back no other), else OpenAI's."""
    return PARSERS[parser].call_id if parser is not None else new_call_id


def with_template_call_ids(messages: list[dict[str, Any]], parser: str | None) -> list[dict[str, Any]]:
    """`messages` (as chat templates read them) with their tool-call ids as the parser's model's
    template takes them (`template_call_id`): the calls of assistant messages, and tool messages'."""
    if parser is None:
        return messages
    to_template = PARSERS[parser].template_call_id
    for message in messages:
        if message.get("tool_calls"):
            message["tool_calls"] = [{**call, "id": to_template(call["id"])} if isinstance(call.get("id"), str)
                                     else call for call in message["tool_calls"]]
        if isinstance(message.get("tool_call_id"), str):
            message["tool_call_id"] = to_template(message["tool_call_id"])
    return messages


def keeps_special_tokens(syntax: ToolCallSyntax | None, reasoning) -> bool:
    """Whether a chat reply's text must keep the tokenizer's special tokens, whatever the request
    asked: its calls begin at one (Mistral's, as vLLM's parser asks), or its channels are marked by
    them (harmony's; `reasoning`: the request's ReasoningReader or None)."""
    return (syntax is not None and syntax.reads_special_tokens) or (reasoning is not None
                                                                    and reasoning.reads_special_tokens)


def needs_a_parser(param: str) -> APIError:
    """The refusal of tool_choice "auto" by a gateway started without a parser, as vLLM refuses it
    without `--enable-auto-tool-choice`."""
    return APIError(400, 'tool_choice "auto" (the default with tools) needs the gateway started with '
                         '--tool-call-parser, to read the model\'s own calls: use "required", a named function '
                         'or "none"', param=param)
