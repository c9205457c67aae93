"""How the chat API answers, with vLLM's flags for it.

--response-role ROLE: the role of the message a chat reply makes ("assistant" by default), where the
prompt ends with the generation prompt; a reply that continues the last message
(add_generation_prompt false) takes that message's role, as vLLM's does.

--exclude-tools-when-tool-choice-none: a request's tools are left out of its prompt when its
tool_choice is "none", so that a template shown them does not lead the model to write calls
nobody will read; by default the template sees them, as it does in vLLM without the flag.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.gateway.chat_request import ChatCompletionRequest


@dataclass(frozen=True)
class ChatServing:
    response_role: str = "assistant"
    exclude_tools_when_tool_choice_none: bool = False

    def role_of_reply(self, body: ChatCompletionRequest) -> str:
        return self.response_role if body.add_generation_prompt else body.messages[-1].role

    def tools_in_prompt(self, tools: list | None, tool_choice: str | dict | None) -> list | None:
        return None if self.exclude_tools_when_tool_choice_none and tool_choice == "none" else tools

    def as_served(self, body: ChatCompletionRequest) -> ChatCompletionRequest:
        """`body` as its prompt is made: without its tools where they are left out."""
        tools = self.tools_in_prompt(body.tools, body.tool_choice)
        return body if tools is body.tools else body.model_copy(update={"tools": tools})

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--response-role", default="assistant",
                            help="the role of a chat reply's message (default assistant)")
        parser.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                            help="leave a chat request's tools out of its prompt when its tool_choice is none")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ChatServing:
        return cls(response_role=args.response_role,
                   exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none)
