"""The public gRPC API (protos/gateway.proto `Generate`, and `Embed`: /v1/embeddings' answer) over the
same request pipeline as the HTTP API. A failure is the stream's last message (`error`, carrying the
HTTP status it maps to), not a gRPC status, so a client reads one shape for everything a request can
end with. A client that cancels the call cancels the request on the mesh. A chat request's reply is
read as the HTTP API reads it (grpc_chat.py): a reasoning model's thinking in `reasoning`, tool
calls in `tool_calls`. With `n`, each choice is its own request on the mesh, and each chunk and
complete names its choice (`index`), as the HTTP API's choices do. The pipeline counts each request
it is given (services/gateway/pipeline.py); a request refused before it gets there is counted here,
by reason. With `beam_search`, the choices are the n best beams (grpc_beam_search.py). Each
request's ledger goes into the same store as the HTTP API's, so `GET /v1/requests/{request_id}/timeline`
shows where its time went (services/gateway/timeline.py). The response headers go out once the prompt is on its way to a
worker, ahead of the first chunk (services/common/grpc_server.EarlyHeaders). With `--api-key`, a
call without one of the keys in its `authorization` metadata ends UNAUTHENTICATED before its request
is looked at (api_keys.py): refusing the caller, not the request.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from pydantic import ValidationError

from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.converters import FINISH_REASONS
from services.common.grpc_server import EarlyHeaders
from services.gateway.api_keys import ApiKeys, refusal
from services.gateway.chat_images import chat_images
from services.gateway.chat_serving import ChatServing
from services.gateway.choices import choice_request_id, merge_choices
from services.gateway.deltas import Delta
from services.gateway.embeddings_api import EmbeddingRequest, embeddings
from services.gateway.errors import APIError, FieldError, to_api_error
from services.gateway.given_embeddings import GivenImages, checked_embeddings
from services.gateway.grpc_beam_search import beam_search_choices
from services.gateway.grpc_chat import ChatReply, ChatRequestTools
from services.gateway.grpc_conversation import chat_messages, chat_options, media_io_kwargs, mm_processor_kwargs
from services.gateway.openai_protocol import MAX_CHOICES
from services.gateway.pipeline import RequestPipeline
from services.gateway.reasoning_parsers import ReasoningReader
from services.gateway.sequence_groups import counted_by_prompt
from services.gateway.served_models import ServedModels
from services.gateway.stop_regexes import compiled_stop_regexes
from services.gateway.timeline import ResponseTimeline, TimelineStore
from services.gateway.tool_parsers import keeps_special_tokens, with_template_call_ids

if TYPE_CHECKING:  # imported by a gateway whose model takes images: it takes PIL and numpy
    from services.gateway.image_inputs import ChatImages

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Generate"].full_name


class GenerateServicer(gateway_pb2_grpc.GenerateServicer):
    """`pipeline` is attached once the gateway's workers are connected."""

    def __init__(self, models: ServedModels, timelines: TimelineStore | None = None,
                 api_keys: ApiKeys | None = None,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 chat_serving: ChatServing = ChatServing()):
        self.models = models  # what requests may name: the model's names and its LoRA adapters
        self.model_name = models.name
        self.api_keys = api_keys
        self.tool_call_parser = tool_call_parser  # tool_parsers.py: the model's own calls, for "auto"
        self.reasoning_parser = reasoning_parser  # reasoning_parsers.py: a chat reply's thinking apart
        self.chat_serving = chat_serving  # which tools a chat prompt shows
        self.pipeline: RequestPipeline | None = None
        self.takes_prompt_embeds = False  # the gateway's --enable-prompt-embeds
        self.images: ChatImages | None = None  # what reads a chat's images, for a model that takes them
        self.timelines = timelines if timelines is not None else TimelineStore()

    async def _check_caller(self, context) -> None:
        """With --api-key, a call without one of the keys ends UNAUTHENTICATED."""
        if self.api_keys is not None:
            authorization = dict(context.invocation_metadata()).get("authorization")
            if not self.api_keys.admits(authorization):
                if self.pipeline is not None:
                    self.pipeline.metrics.count_error("unauthorized")
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal(authorization).message)

    async def Embed(self, request: gateway_pb2.EmbedRequest, context) -> gateway_pb2.EmbedResponse:
        """/v1/embeddings' answer (embeddings_api.py); a failure is the response's `error`."""
        started = time.perf_counter()
        await self._check_caller(context)
        request_id = request.request_id or f"embd-{uuid.uuid4().hex}"
        try:
            if self.pipeline is None:
                raise APIError(503, "the gateway is starting", code="unavailable")
            lora = self.models.adapter_named(request.model) if request.model else None
            if bool(request.texts) == bool(request.token_ids):
                raise APIError(400, "one of texts and token_ids is required, not both", param="input")
            try:
                body = EmbeddingRequest(
                    model=request.model or self.model_name,
                    input=list(request.texts) or [list(one.token_ids) for one in request.token_ids],
                    dimensions=request.dimensions or None,
                    truncate_prompt_tokens=request.truncate_prompt_tokens or None,
                    normalize=request.normalize if request.HasField("normalize") else True)
            except ValidationError as e:  # a negative token id
                raise APIError(400, f"token_ids: {e.errors()[0]['msg']}", param="token_ids") from None
            replies, num_tokens = await embeddings(self.pipeline, body, lora, request_id, self.models.max_model_len)
        except Exception as e:
            error = to_api_error(e, "input")
            return gateway_pb2.EmbedResponse(request_id=request_id, error=common_pb2.Error(
                code=error.status, message=error.message, type=error.type, param=error.param or ""))
        self.pipeline.pooling.observe("embeddings", len(replies), num_tokens, time.perf_counter() - started)
        return gateway_pb2.EmbedResponse(request_id=request_id, embeddings=gateway_pb2.Embeddings(
            data=[gateway_pb2.Embedding(values=reply.embedding) for reply in replies], prompt_tokens=num_tokens))

    async def Generate(self, request: gateway_pb2.GenerateRequest, context):
        arrival = time.perf_counter()
        await self._check_caller(context)
        request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
        headers = EarlyHeaders(context)
        try:
            try:
                if request.n > MAX_CHOICES:
                    raise APIError(400, f"n must be at most {MAX_CHOICES}, got {request.n}", param="n")
                num_choices = max(request.n, 1)
                chat = tools = None  # a chat request's reply, read as the HTTP API reads it (grpc_chat.py)
                if request.WhichOneof("input") == "chat" and self.pipeline is not None:
                    chat, tools = ChatReply.start(request, request_id, self.model_name, self.pipeline.tokenizer,
                                                  self.tool_call_parser, self.reasoning_parser, num_choices)
                images = await self._chat_images(request)
                choices = counted_by_prompt(self._choices(request, request_id, num_choices, arrival, headers.send_soon,
                                                          tools, chat.reasoning if chat is not None else None, images),
                                            [0] * num_choices, self.pipeline.requests)
            except APIError as e:  # refused before the pipeline saw it
                if self.pipeline is not None:
                    self.pipeline.metrics.count_error(e.code or "invalid_request")
                raise
            stream = request.stream_options.stream
            replies = [_Reply() for _ in range(num_choices)]  # each choice's whole, when not streamed
            num_left = num_choices
            async with aclosing(choices):
                # Here, not in a generator of responses: one layer less on the first token's way out.
                async for index, delta in choices:
                    if stream:
                        chunk = chat.chunk(index, delta) if chat is not None else gateway_pb2.GenerateChunk(
                            text=delta.text, token_ids=delta.token_ids, logprobs=delta.logprobs,
                            prompt_logprobs=delta.prompt_logprobs, index=index)
                        if chunk.text or chunk.reasoning or chunk.tool_calls or chunk.token_ids:
                            await headers.sent()
                            yield gateway_pb2.GenerateResponse(request_id=request_id, chunk=chunk)
                    elif chat is not None:
                        chat.add(index, delta)
                        replies[index].add(delta, with_text=False)
                    else:
                        replies[index].add(delta, with_text=True)
                    if delta.finish_reason is not None:
                        complete = replies[index].complete(delta, index)
                        if chat is not None:
                            if not stream:
                                complete.text, complete.reasoning, calls = chat.whole(index)
                                complete.tool_calls.extend(calls)
                            complete.finish_reason = FINISH_REASONS[chat.finish_reasons[index]]
                            reasoning_tokens = chat.reasoning_tokens(index)
                            if reasoning_tokens is not None and complete.HasField("usage"):
                                complete.usage.reasoning_tokens = reasoning_tokens
                        await headers.sent()
                        yield gateway_pb2.GenerateResponse(request_id=request_id, complete=complete)
                        num_left -= 1
                        if not num_left:
                            return
        except Exception as e:
            error = to_api_error(e, _input_field(request))
            await headers.sent()
            yield gateway_pb2.GenerateResponse(request_id=request_id, error=common_pb2.Error(
                code=error.status, message=error.message, type=error.type, param=error.param or ""))

    async def _chat_images(self, request: gateway_pb2.GenerateRequest) -> GivenImages | None:
        """A chat's images (its messages' image_urls, and image_embeds given as rows) and videos (video_urls), in
        order; APIError (400) where the model takes none, or one cannot be read."""
        if request.WhichOneof("input") != "chat":
            return None
        for i, message in enumerate(request.chat.messages):
            indexes = {embeds.index for embeds in message.image_embeds}
            if len(message.image_urls) + len(message.image_embeds) != len(message.image_parts):
                raise APIError(400, f"chat.messages[{i}] has {len(message.image_parts)} image_parts for "
                                    f"{len(message.image_urls)} image_urls and {len(message.image_embeds)} "
                                    "image_embeds", param=f"chat.messages[{i}].image_urls")
            if len(indexes) != len(message.image_embeds) or any(index >= len(message.image_parts) for index in indexes):
                raise APIError(400, f"chat.messages[{i}].image_embeds' indexes must be distinct, each under its "
                                    f"{len(message.image_parts)} image_parts", param=f"chat.messages[{i}].image_embeds")
            if len(message.video_urls) != len(message.video_parts):
                raise APIError(400, f"chat.messages[{i}] has {len(message.video_parts)} video_parts for "
                                    f"{len(message.video_urls)} video_urls", param=f"chat.messages[{i}].video_urls")
            for kind, urls, uuids in (("image", message.image_urls, message.image_uuids),
                                      ("video", message.video_urls, message.video_uuids)):
                if uuids and len(uuids) != len(urls):
                    raise APIError(400, f"chat.messages[{i}] has {len(uuids)} {kind}_uuids for {len(urls)} "
                                        f"{kind}_urls: one each, or none", param=f"chat.messages[{i}].{kind}_uuids")
                if any(not url and not (uuids and uuids[j]) for j, url in enumerate(urls)):
                    raise APIError(400, f"chat.messages[{i}]'s {kind}_urls: an empty one needs its {kind}_uuids "
                                        f"entry (the {kind} sent before under it)",
                                   param=f"chat.messages[{i}].{kind}_urls")
            parts = [*message.image_parts, *message.video_parts]
            if len(set(parts)) != len(parts) or any(index >= len(parts) + len(message.content_parts)
                                                    for index in parts):
                raise APIError(400, f"chat.messages[{i}]'s image_parts and video_parts must name distinct indexes "
                                    "among its parts", param=f"chat.messages[{i}].video_parts")
        images = await chat_images(self, request.chat.messages, "chat.messages",  # its images and model_name
                                   mm_processor_kwargs(request.chat_options), media_io_kwargs(request.chat_options))
        if images is not None and request.HasField("beam_search"):
            raise APIError(400, "beam search takes text messages, not images", param="beam_search")
        return images

    def _choices(self, request: gateway_pb2.GenerateRequest, request_id: str, num_choices: int, arrival: float,
                 on_dispatch: Callable[[], None], tools: ChatRequestTools | None, reasoning: ReasoningReader | None,
                 images: GivenImages | None):
        """The request's choices on their way: (index, delta) as they come (choices.py)."""
        if self.pipeline is None:
            raise APIError(503, "the gateway is starting", code="unavailable")
        shared = self._shared_arguments(request, tools, reasoning)
        if images is not None:
            shared["images"] = images
        timeline = ResponseTimeline(request_id, arrival, int(time.time()))
        self.timelines.add(timeline)
        if request.HasField("beam_search"):
            return beam_search_choices(self.pipeline, request, request_id, shared, timeline, on_dispatch)
        streams = []
        for j in range(num_choices):
            choice_id = choice_request_id(request_id, j, num_choices)
            sampling = shared["sampling"]
            if j and sampling.HasField("seed"):  # n choices that differ, yet repeat run to run
                sampling = common_pb2.SamplingParams()
                sampling.CopyFrom(shared["sampling"])
                sampling.seed = (sampling.seed + j) % 2**64
            streams.append(self.pipeline.generate(choice_id, **{**shared, "sampling": sampling},
                                                  clock=timeline.clock(choice_id), on_dispatch=on_dispatch))
        return merge_choices(streams)

    def _shared_arguments(self, request: gateway_pb2.GenerateRequest, tools: ChatRequestTools | None,
                          reasoning: ReasoningReader | None) -> dict[str, Any]:
        """The pipeline's `generate` arguments every choice of `request` shares (a choice's `sampling` is
        this one, or a copy with its own seed)."""
        lora = self.models.adapter_named(request.model) if request.model else None
        self.models.check_generates()
        if request.sampling.HasField("lora_name") and not self.models.serves_adapter(request.sampling.lora_name):
            served = ", ".join(self.models.adapters) or "none"
            raise APIError(400, f"sampling.lora_name {request.sampling.lora_name!r} is not served here (served: "
                                f"{served}); name an adapter as the model", param="sampling.lora_name")
        given = request.WhichOneof("input")
        if given is None:
            raise APIError(400, "one of text, chat, token_ids or prompt_embeds is required", param="input")
        if given == "token_ids":
            inputs = {"prompt_token_ids": request.token_ids.token_ids}
        elif given == "prompt_embeds":
            if not self.takes_prompt_embeds:
                raise APIError(400, "prompt_embeds are taken only by a gateway started with --enable-prompt-embeds",
                               param="prompt_embeds")
            if request.HasField("beam_search"):
                raise APIError(400, "beam search takes text, chat or token-id prompts, not embeddings",
                               param="beam_search")
            inputs = {"prompt_embeds": checked_embeddings(request.prompt_embeds)}
        elif given == "text":
            inputs = {"prompt_text": request.text}
        else:
            inputs = {"messages": with_template_call_ids(chat_messages(request.chat), self.tool_call_parser),
                      "chat_options": chat_options(request.chat_options, self.chat_serving.tools_in_prompt(
                          tools.tools, tools.choice) if tools else None)}
        sampling = request.sampling
        forced = tools is not None and tools.forced is not None
        defaults = self.pipeline.prompts.generation_defaults
        if forced or defaults or lora is not None:
            sampling = common_pb2.SamplingParams()
            sampling.CopyFrom(request.sampling)
        if lora is not None:
            sampling.lora_name = lora
        if forced or defaults:
            # top_k and min_p have no presence: 0, their "off", takes the default (-1 turns top_k off for good).
            defaults.fill(sampling, top_k_given=sampling.top_k != 0, min_p_given=sampling.min_p != 0)
        if forced:  # the text is guided to the call
            tools.forced.guide.write_into(sampling)
        skip_special_tokens = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        if keeps_special_tokens(tools.syntax if tools is not None else None, reasoning):
            skip_special_tokens = False
        try:
            stop_regexes = compiled_stop_regexes(list(request.stop_regex))
        except FieldError as e:
            raise APIError(400, str(e), param=e.param) from None
        return dict(**inputs, sampling=sampling, stop=[*request.stop, *stop_regexes],
                    include_stop_str_in_output=request.include_stop_str_in_output,
                    skip_special_tokens=skip_special_tokens,
                    guide_after=reasoning.guide_after if reasoning is not None else None,
                    is_streamed=request.stream_options.stream)


@dataclass
class _Reply:
    """One choice's output so far, for its GenerateComplete when it is not streamed."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)

    def add(self, delta: Delta, with_text: bool) -> None:
        if with_text:  # a chat reply's text is its ChatReply's
            self.text.append(delta.text)
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.prompt_logprobs += delta.prompt_logprobs

    def complete(self, last: Delta, index: int) -> gateway_pb2.GenerateComplete:
        usage = last.usage
        return gateway_pb2.GenerateComplete(
            finish_reason=FINISH_REASONS.get(last.finish_reason, common_pb2.FINISH_REASON_UNSPECIFIED),
            usage=common_pb2.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                                   cached_tokens=usage.cached_tokens) if usage else None,
            matched_stop=last.matched_stop or "", text="".join(self.text), token_ids=self.token_ids,
            logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs, index=index,
            metrics=gateway_pb2.RequestMetrics(**{name: value for name, value in last.timing.to_json().items()
                                                  if value is not None}) if last.timing is not None else None)


def _input_field(request: gateway_pb2.GenerateRequest) -> str:
    return request.WhichOneof("input") or "input"
