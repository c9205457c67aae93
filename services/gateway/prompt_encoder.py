"""A request's prompt as token ids: text encoded, a conversation rendered by the chat template, or
ids as given; then left-truncated as asked and checked against the model's context.

Short prompts are encoded here, with the same tokenizer and template the tokenizer service has
(a round trip off their path); long ones, and conversations with a template of their own, by
the least loaded serving tokenizer service, off the gateway's event loop. Where no tokenizer service
serves, or the one asked went away, a long prompt is encoded here after all, on a thread
(`baton_gateway_tokenizer_fallbacks_total`), as vLLM's and SGLang's front ends encode every prompt: a
tokenizer service down does not take serving down with it. So is one the service has not answered within
`hedge_after_s`, while its call goes on, and the first answer is taken (a hedged request): a service
stalled without closing its connections is otherwise found only by keepalive or the call's deadline
(10-20 s). Not a conversation with a template of its own: nothing bounds its time here.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol, TypeVar

import grpc
from prometheus_client import Counter

from engine.sampling_params import SamplingParams as EngineSamplingParams
from protos import common_pb2, tokenizer_pb2
from services.gateway.generation_defaults import GenerationDefaults
from services.gateway.request_errors import UNTRUSTED_TEMPLATE, ContextLengthError, InvalidRequestError
from services.gateway.workers import NoHealthyWorkerError, WorkerPool
from services.tokenizer.chat_template import ChatOptions, ChatTemplateError, check_messages
from services.tokenizer.content_format import content_chars
from services.tokenizer.converters import chat_template_request
from services.tokenizer.image_tokens import ImageSize
from services.tokenizer.incremental_detokenizer import Decoder

T = TypeVar("T")
TOKENIZER_FALLBACKS = Counter("baton_gateway_tokenizer_fallbacks_total",
                              "Long prompts (and /tokenize's, /detokenize's ids) the gateway encoded itself because no "
                              "tokenizer service was serving, "
                              "or the one asked went away or did not answer in time")
# What a tokenizer service that is gone or stalled answers; any other error is the prompt's.
_SERVICE_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _went_away(error: BaseException) -> bool:
    return isinstance(error, grpc.aio.AioRpcError) and error.code() in _SERVICE_GONE


def as_the_service_reads(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as the tokenizer service reads them (services/tokenizer/converters.py): a missing content is
    empty, as the template is given it here."""
    return [{**m, "content": m.get("content") or ""} for m in messages]


class ModelText(Decoder, Protocol):
    """What the pipeline needs of the model's tokenizer in this process (`ModelTokenizer`)."""

    max_model_len: int | None
    eos_token_ids: tuple[int, ...]
    vocab_size: int

    def completion_budget(self, num_prompt_tokens: int, max_tokens: int | None) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def id_to_token(self, token_id: int) -> str | None: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, continue_final_message: bool = False,
                            documents: Sequence[Mapping[str, Any]] | None = None, chat_template: str | None = None,
                            add_special_tokens: bool = False, **template_kwargs) -> tuple[str, list[int]]: ...


class PromptEncoder:
    """`tokenizer`: the model's, loaded in this process; `tokenizers`: the tokenizer services'.
    Prompts (or conversations' content) of at most `local_tokenize_max_chars` characters are encoded
    with `tokenizer` (0: none are). A request's own chat template only with
    `trust_request_chat_template`. `generation_defaults.max_new_tokens` caps a request with no max_tokens.
    `timeout_s`: the tokenizer service's calls' deadline; `hedge_after_s`: how long one that can be
    answered here waits for the service alone.
    `default_template_kwargs`: chat template variables a request's `chat_template_kwargs` leaves out
    (vLLM's --default-chat-template-kwargs); `content_format`: how messages' content reaches the
    template (vLLM's --chat-template-content-format, content_format.py)."""

    def __init__(self, tokenizer: ModelText, tokenizers: WorkerPool, timeout_s: float, hedge_after_s: float,
                 local_tokenize_max_chars: int, trust_request_chat_template: bool,
                 generation_defaults: GenerationDefaults, default_template_kwargs: Mapping[str, Any] | None = None,
                 content_format: str = "auto") -> None:
        self.tokenizer = tokenizer
        self.tokenizers = tokenizers
        self.timeout_s = timeout_s
        self.hedge_after_s = hedge_after_s
        self.local_tokenize_max_chars = local_tokenize_max_chars
        self.trust_request_chat_template = trust_request_chat_template
        self.generation_defaults = generation_defaults
        self.default_template_kwargs = dict(default_template_kwargs or {})
        self.content_format = content_format

    def chat_options(self, options: ChatOptions) -> ChatOptions:
        """`options` with the gateway's default template variables under the request's own, and its
        content format."""
        if self.content_format != options.content_format:
            options = replace(options, content_format=self.content_format)
        if not self.default_template_kwargs:
            return options
        return replace(options, template_kwargs={**self.default_template_kwargs, **options.template_kwargs})

    async def encode(self, request_id: str, prompt_text: str | None, prompt_token_ids: Sequence[int] | None,
                     messages: Sequence[Mapping[str, Any]] | None, chat_options: ChatOptions,
                     add_special_tokens: bool = True, image_sizes: Sequence[ImageSize] = ()) -> Sequence[int]:
        """The ids of exactly one of `prompt_text`, `prompt_token_ids` and `messages` (`image_sizes`: their
        images' sizes as resized and their crops' counts, which some models' image tokens depend on). Raises
        InvalidRequestError for what cannot be a prompt."""
        timeout = self.timeout_s
        if prompt_token_ids is not None:
            # As given, not copied: nothing changes a prompt. One from a gRPC request stays the
            # request's repeated field, which a worker's request is built from in 1 us; from a list
            # of 512 ids it takes 17, and making the list 20 more.
            # Nor scanned (~0.1 ms of a 512-id prompt, run cold): the worker refuses an id outside the
            # vocabulary, and where the gateway reads the ids first (hashing a block, decoding the
            # tail) a negative one is refused there. The OpenAI API's ids are bounded by its schema.
            prompt = prompt_token_ids
        elif prompt_text is not None:
            def encode_here() -> list[int]:
                return self.tokenizer.encode(prompt_text, add_special_tokens=add_special_tokens)

            if len(prompt_text) <= self.local_tokenize_max_chars:
                prompt = encode_here()
            else:
                async def encode(stub) -> Sequence[int]:
                    return (await stub.Encode(tokenizer_pb2.EncodeRequest(
                        request_id=request_id, text=prompt_text, add_special_tokens=add_special_tokens),
                        timeout=timeout)).token_ids

                prompt = await self.by_service(len(prompt_text), encode, encode_here)
        else:
            chat = as_the_service_reads(messages)
            chat_options = self.chat_options(chat_options)
            if chat_options.template is not None and not self.trust_request_chat_template:
                raise InvalidRequestError(UNTRUSTED_TEMPLATE, param="chat_template")
            # A request's own template is rendered by the tokenizer service: nothing bounds its time,
            # which here would stall every other request's tokens.
            num_chars = sum(content_chars(m["content"]) for m in chat)

            def render_here() -> list[int]:
                return self.rendered(chat, chat_options, image_sizes)

            if chat_options.template is None and num_chars <= self.local_tokenize_max_chars:
                prompt = render_here()
            else:
                async def render(stub) -> Sequence[int]:
                    return (await stub.ApplyChatTemplate(
                        chat_template_request(request_id, chat, chat_options, image_sizes), timeout=timeout)).token_ids

                prompt = await self.by_service(num_chars, render,
                                               render_here if chat_options.template is None else None)
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        return prompt

    def rendered(self, chat: Sequence[Mapping[str, Any]], chat_options: ChatOptions,
                 image_sizes: Sequence[ImageSize] = ()) -> list[int]:
        """The ids of `chat` rendered here by the model's template as `chat_options` say; InvalidRequestError
        for what the tokenizer service refuses as INVALID_ARGUMENT."""
        try:
            check_messages(chat)
            return self.tokenizer.apply_chat_template(chat, image_sizes=image_sizes,
                                                      **chat_options.as_template_inputs())[1]
        except ChatTemplateError as e:
            raise InvalidRequestError(str(e)) from None

    async def by_service(self, num_chars: int, ask: Callable[[Any], Awaitable[T]], here: Callable[[], T] | None) -> T:
        """What `ask(stub)` makes of the least loaded serving tokenizer service's answer (its `num_chars`
        stand in for the tokens in its load: they are not counted yet); `here()`, on a thread, where none
        serves or it went away (`here` None: that error stands), or where it has not answered within
        hedge_after_s and `here()` answers first."""
        try:
            with self.tokenizers.hold(num_tokens=num_chars) as service:
                if here is None:
                    return await ask(service.stub)
                return await self._first_answer(ask(service.stub), here)
        except NoHealthyWorkerError:
            if here is None:
                raise
        except grpc.aio.AioRpcError as e:
            if here is None or not _went_away(e):
                raise
        TOKENIZER_FALLBACKS.inc()
        return await asyncio.to_thread(here)

    async def _first_answer(self, asked: Awaitable[T], here: Callable[[], T]) -> T:
        """`asked`'s answer, or once it has none after hedge_after_s, the first of it and `here()`'s (on a
        thread); `asked`'s error where the service did not go away. The call left is cancelled; a thread
        cannot be, and what it makes is dropped."""
        call = asyncio.ensure_future(asked)
        try:
            done, _ = await asyncio.wait({call}, timeout=self.hedge_after_s)
            if not done:
                local = asyncio.ensure_future(asyncio.to_thread(here))
                local.add_done_callback(lambda f: f.cancelled() or f.exception())  # read here, whoever else does
                done, _ = await asyncio.wait({call, local}, return_when=asyncio.FIRST_COMPLETED)
                if call not in done:
                    TOKENIZER_FALLBACKS.inc()
                    return local.result()
                if call.exception() is not None and _went_away(call.exception()):
                    TOKENIZER_FALLBACKS.inc()
                    return await local
            return call.result()
        finally:
            call.cancel()

    def truncated(self, prompt: Sequence[int], keep: int) -> Sequence[int]:
        """The prompt's last `keep` tokens (-1: the context's worth; unknown context, all of them)."""
        if keep == -1:
            keep = self.tokenizer.max_model_len or len(prompt)
        if keep < 1:
            raise InvalidRequestError(f"truncate_prompt_tokens must be -1 or at least 1, got {keep}",
                                      param="truncate_prompt_tokens")
        return prompt[-keep:] if len(prompt) > keep else prompt

    def check_context(self, prompt: Sequence[int], params: common_pb2.SamplingParams) -> None:
        """Raises ContextLengthError; fills in max_tokens (what fits) when the request gave none, and
        refuses a min_tokens over it.
        Here, not by the tokenizer service: it is arithmetic, and an RPC on every request's path."""
        try:
            budget = self.tokenizer.completion_budget(len(prompt),
                                                      params.max_tokens if params.HasField("max_tokens") else None)
        except ValueError as e:
            raise ContextLengthError(str(e)) from None
        default_max = self.generation_defaults.max_new_tokens
        if not params.HasField("max_tokens") and default_max is not None:
            budget = default_max if budget is None else min(budget, default_max)
        if budget is not None:
            params.max_tokens = budget
        max_tokens = params.max_tokens if params.HasField("max_tokens") else EngineSamplingParams.max_tokens
        if params.min_tokens > max_tokens:
            raise InvalidRequestError(f"min_tokens ({params.min_tokens}) must not be more than max_tokens "
                                      f"({max_tokens})", param="min_tokens")
