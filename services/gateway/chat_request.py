"""POST /v1/chat/completions' body (`ChatCompletionRequest`): the fields completions share
(openai_protocol.py), the messages (chat_messages.py), tools and vLLM's template options."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, model_validator

from services.gateway.chat_messages import ChatMessage
from services.gateway.errors import FieldError, validation_error
from services.gateway.openai_protocol import MAX_LOGPROBS, UINT32_MAX, SamplingFields
from services.gateway.tool_calls import ForcedToolCall, effective_tool_choice, forced_tool_call
from services.tokenizer.chat_template import ChatOptions, check_template_kwargs


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    _forced_tool_call: ForcedToolCall | None = PrivateAttr(default=None)
    # Deprecated by OpenAI, still sent by most clients.
    max_tokens: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # tool_calls.py: "none", "required" or a named function
    # False: a reply's first call only (OpenAI's; vLLM keeps the first); "required"'s list is guided to one
    parallel_tool_calls: bool = True
    # vLLM's: how the messages become the prompt.
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply continues the last message (a prefilled assistant turn)
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. {"enable_thinking": false}
    chat_template: str | None = None  # the request's own Jinja template (--trust-request-chat-template only)
    documents: list[dict[str, Any]] | None = None  # for a retrieval template, e.g. [{"title": ..., "text": ...}]
    add_special_tokens: bool = False  # the tokenizer's special tokens (BOS) added to the template's text too
    include_reasoning: bool = True  # vLLM's: false leaves a reasoning model's thinking out of the reply
    # SGLang's: false leaves the thinking in the content as the model wrote it (its tags too), as without
    # --reasoning-parser; a structured output still waits for the thinking's end.
    separate_reasoning: bool = True
    # OpenAI's: how long a reasoning model thinks, given to the chat template as `reasoning_effort`
    # (gpt-oss's writes it into its system message), as vLLM gives it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    echo: bool = False  # vLLM's: the reply starts with the last message's text when that is the assistant's
    prompt_embeds: Any = None  # refused: a prompt given as embeddings is completions' (completion_request.py)
    # vLLM's: the image processor's settings for this request's images (image_processing.py's with_kwargs), e.g.
    # Qwen-VL's {"max_pixels": N}
    mm_processor_kwargs: dict[str, Any] | None = None
    # vLLM's: how this request's media are read (a video's num_frames, an image's rgba_background_color), over the
    # gateway's --media-io-kwargs
    media_io_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_supported(self):
        if self.prompt_embeds:
            raise FieldError("prompt_embeds", "a prompt given as embeddings is taken by /v1/completions, not by chat")
        self._forced_tool_call = forced_tool_call(self.tools, self.tool_choice, self.parallel_tool_calls)
        if self._forced_tool_call is not None:
            if self._output_guide is not None:
                raise FieldError("tool_choice", "a forced tool call and a structured output cannot both be asked for")
            self._output_guide = self._forced_tool_call.guide
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message",
                             "continue_final_message and add_generation_prompt cannot both be true: the reply "
                             "continues the last message, or starts a new one")
        check_template_kwargs(self.chat_template_kwargs or {})
        self._check_beam_search()
        return self

    @property
    def completion_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def forced_tool_call(self) -> ForcedToolCall | None:
        return self._forced_tool_call

    @property
    def lets_the_model_call_tools(self) -> bool:
        """tool_choice "auto" with tools: the model's own calls are read out of its text."""
        return bool(self.tools) and effective_tool_choice(self.tools, self.tool_choice) == "auto"

    def chat_options(self) -> ChatOptions:
        template_kwargs = self.chat_template_kwargs or {}
        if self.reasoning_effort is not None:
            template_kwargs = {"reasoning_effort": self.reasoning_effort, **template_kwargs}
        return ChatOptions(self.add_generation_prompt, self.continue_final_message, template_kwargs,
                           self.tools or None, self.documents, self.chat_template, self.add_special_tokens)

    def chat_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_input() for m in self.messages]

    @property
    def echoed(self) -> list[str] | None:
        """With `echo`, what the reply starts with: the last message's text when the assistant wrote it
        (a reply that continues it), else nothing; None without `echo`."""
        if not self.echo:
            return None
        last = self.messages[-1]
        return [last.text if last.role == "assistant" else ""]


def chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """`body` as chat's request, for the APIs whose requests become one (Responses, Anthropic's Messages);
    APIError (400) naming the first field chat refuses."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
