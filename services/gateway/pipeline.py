"""One request's path through the mesh, as the gateway drives it:

    Encode / ApplyChatTemplate (tokenizer), or here for a short prompt, or token ids as given
      → the context check, here (arithmetic on the model's context length)
      → the prefill worker: where the prompt's prefix is cached, against load (router.py)
      → PrefillStream (prefill P: streams the first token, then reserves pages on D,
        writes the KV into them and names the reservation), on a call kept open to P
        ahead of the request where there is one (kept_calls.py)
      → Decode (D, a stream of token ids), on a call kept open to D likewise
      → incremental detokenization and stop strings, here in-process (as vLLM's frontend)

or, for a prompt whose part D does not already hold (the prefix index says, from the
router's copy of it) is at most `local_prefill_max_tokens`, when D has room
(conditional disaggregation, as Dynamo does it): GenerateLocally on D, which prefills it
in its own running batch; no prefill worker and no KV transfer.

and out as a stream of `Delta`s. The HTTP and public gRPC layers sit on top of this.

Pages are never left held: a prompt that does not fit, a prefill that fails or
finishes by itself, a stop string, and a consumer that goes away (cancels the task
or closes the generator, e.g. with `contextlib.aclosing`) all cancel the in-flight
calls and Abort the request on D. Every gRPC call carries a deadline.

Each request is timed from its arrival here (services/common/metrics/requests.py): time
to first token, between tokens and end to end, its tokens, and how it ended (a finish
reason, or an error by reason: `error_reason`). Its ledger (timeline.py) is marked on
the way: where each millisecond went, from the HTTP request's arrival to its last token.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import ExitStack, aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from prometheus_client import Counter

from engine.sampling_params import SamplingParams as EngineSamplingParams
from protos import common_pb2, decode_pb2, prefill_pb2, tokenizer_pb2
from services.common import tracing
from services.common.converters import FINISH_REASON_NAMES
from services.common.metrics import RequestMetrics, RequestTimer, ServiceMetrics
from services.gateway.generation_defaults import GenerationDefaults
from services.gateway.kept_calls import DECODE_CALLS, PREFILL_CALLS, KeptCalls
from services.gateway.request_trace import RequestTrace
from services.gateway.router import NO_LOOKUP, Lookup
from services.gateway.timeline import PhaseClock
from services.gateway.workers import NoHealthyWorkerError, Worker, WorkerPool
from services.tokenizer.chat_template import ChatOptions, ChatTemplateError, check_messages
from services.tokenizer.converters import chat_template_request
from services.tokenizer.incremental_detokenizer import Decoder, IncrementalDetokenizer
from services.tokenizer.stop_strings import StopStringMatcher


class ModelText(Decoder, Protocol):
    """What the pipeline needs of the model's tokenizer in this process (`ModelTokenizer`)."""

    max_model_len: int | None

    def completion_budget(self, num_prompt_tokens: int, max_tokens: int | None) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def id_to_token(self, token_id: int) -> str | None: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, continue_final_message: bool = False,
                            documents: Sequence[Mapping[str, Any]] | None = None, chat_template: str | None = None,
                            add_special_tokens: bool = False, **template_kwargs) -> tuple[str, list[int]]: ...


PREFILL_PLACES = Counter("baton_gateway_prefills_total",
                         "Prompts by where they were prefilled: on a prefill worker, or on the decode worker itself",
                         ["place"])
PREFILLED_ON = {"decode": PREFILL_PLACES.labels("decode"), "prefill": PREFILL_PLACES.labels("prefill")}
PREFILL_RETRIES = Counter("baton_gateway_prefill_retries_total",
                          "Prompts sent to another prefill worker because theirs went away (UNAVAILABLE) before "
                          "their first token")
# A prompt's prefill workers after the first, at most: a worker that stops or dies before the first
# token has sent nothing anyone saw, so the prompt goes to another. Not after any other failure: a
# prompt that made a worker's engine fail may make the next one's fail too.
MAX_PREFILL_RETRIES = 2
DECODE_MIGRATIONS = Counter("baton_gateway_decode_migrations_total",
                            "Requests moved to another decode worker because theirs went away (UNAVAILABLE) "
                            "mid-stream: prompt and output so far prefilled again there")
MAX_DECODE_MIGRATIONS = 2  # a request's decode workers after the first, at most


UNTRUSTED_TEMPLATE = ("chat_template: this server renders conversations by the model's chat template only; a "
                      "request's own is taken where the gateway runs with --trust-request-chat-template")


class InvalidRequestError(ValueError):
    """The request itself is bad (HTTP 400); the message is safe to show the client. `param`: the
    field at fault, where it is not the prompt itself."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """The prompt plus the completion budget exceeds the model's context (HTTP 400)."""


class OverloadedError(RuntimeError):
    """No decode worker has the pages for this request now, or the gateway holds as many
    requests as it takes (HTTP 429; retry later)."""


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


@dataclass(frozen=True)
class Deadlines:
    """Seconds each call may take before it fails with DEADLINE_EXCEEDED."""

    tokenizer_s: float = 10.0
    reserve_s: float = 10.0
    prefill_s: float = 120.0
    decode_s: float = 3600.0  # the whole stream
    abort_s: float = 5.0


class _TextOutput:
    """Generated token ids → text deltas: incremental detokenization, then stop strings. The text
    of the first `min_tokens` tokens goes out as it is, as vLLM's does: stop strings are looked
    for in what follows it. The token that stopped the text (EOS or a stop token id) counts, but
    its text is left out unless `include_stop_str_in_output`, as vLLM leaves it out."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int], stop: Sequence[str],
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
            return self.stops.add(self.detokenizer.add(token_ids))[0]
        text = self.detokenizer.add(token_ids[:unmatched])
        rest = token_ids[unmatched:]
        return text + self.stops.add(self.detokenizer.add(rest))[0] if rest else text

    def finish(self) -> str:
        return self.stops.add(self.detokenizer.finish())[0] + self.stops.finish()


class RequestPipeline:
    """Drives requests through a tokenizer, N prefill and M decode workers.

    `tokenizer` is the model's tokenizer loaded in this process (`ModelTokenizer`), used
    to check the context and detokenize the output. A prompt (or chat messages' content)
    of at most `local_tokenize_max_chars` characters is encoded with it too, inline: the
    same tokenizer and template give the same ids, and a short prompt encodes in less time
    than a call to the tokenizer service takes. Longer ones go to the tokenizer service,
    which encodes them off its event loop (0: every one does), as do conversations with a
    template of their own, which only `trust_request_chat_template` lets in. `preopen_prefill_calls`: a
    prompt goes to its prefill worker on a call opened ahead of it where one is kept
    (kept_calls.py), else on a new call; a handed-off prompt goes to its decode worker so
    either way. `metrics`: the gateway's (its registry is served on `/metrics`); by
    default a registry of its own, unlabelled.
    """

    def __init__(self, tokenizer_stub, tokenizer: ModelText, prefill: WorkerPool | None, decode: WorkerPool,
                 deadlines: Deadlines = Deadlines(),
                 kv_transport: common_pb2.KVTransport = common_pb2.KV_TRANSPORT_UNSPECIFIED,
                 prefill_router=None, local_prefill_max_tokens: int = 0, local_tokenize_max_chars: int = 0,
                 preopen_prefill_calls: bool = True, metrics: ServiceMetrics | None = None,
                 max_num_requests: int = 0, trust_request_chat_template: bool = False,
                 generation_defaults: GenerationDefaults = GenerationDefaults()):
        self.tokenizer_stub = tokenizer_stub
        self.tokenizer = tokenizer
        self.prefill = prefill  # None: colocated, every prompt prefilled on its decode worker
        self.decode = decode
        self.deadlines = deadlines
        self.kv_transport = kv_transport  # UNSPECIFIED: prefill picks by where the decode worker is
        self.prefill_router = prefill_router  # a PrefixRouter; None: the least loaded prefill worker
        self.local_prefill_max_tokens = local_prefill_max_tokens  # 0: every prompt goes to a prefill worker
        self.local_tokenize_max_chars = local_tokenize_max_chars  # 0: the tokenizer service encodes every prompt
        self.metrics = metrics or ServiceMetrics("gateway")
        self.requests = RequestMetrics(self.metrics)
        self.max_num_requests = max_num_requests  # 0: no limit
        self.trust_request_chat_template = trust_request_chat_template
        # The APIs fill a request's sampling from them; its max_tokens, when it gives none, here.
        self.generation_defaults = generation_defaults
        self.num_requests = 0  # being generated now (each choice of a request counts)
        self.metrics.gauge("baton_gateway_requests_in_progress",
                           "Requests the gateway holds now, each choice of n counting (what --max-num-requests "
                           "limits)").labels(**self.metrics.labels).set_function(lambda: self.num_requests)
        self.prefill_calls = KeptCalls("PrefillStream", "PrefillPreopened", PREFILL_CALLS, deadlines.prefill_s,
                                       preopen=preopen_prefill_calls)
        self.decode_calls = KeptCalls("Decode", "DecodePreopened", DECODE_CALLS, deadlines.decode_s)
        if prefill is not None:
            prefill.on_removed(self.prefill_calls.forget)
        decode.on_removed(self.decode_calls.forget)
        self._background: set[asyncio.Task] = set()

    async def aclose(self) -> None:
        """End the calls kept open to the workers, and wait for the Aborts and stream reads still in
        flight (call before closing the channels)."""
        self.prefill_calls.close()
        self.decode_calls.close()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    async def generate(
        self,
        request_id: str,
        *,
        prompt_text: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        chat_options: ChatOptions = ChatOptions(),
        add_special_tokens: bool = True,
        sampling: common_pb2.SamplingParams | None = None,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        truncate_prompt_tokens: int | None = None,
        clock: PhaseClock | None = None,
        on_dispatch: Callable[[], None] | None = None,
        guide_after: Callable[[Sequence[int]], int | None] | None = None,
    ) -> AsyncIterator[Delta]:
        """Exactly one of `prompt_text`, `prompt_token_ids`, `messages` (rendered as `chat_options` say). Raises
        `InvalidRequestError` (incl. `ContextLengthError`) for bad input, `OverloadedError`
        when no pages are free, `grpc.aio.AioRpcError` for a worker that failed. `add_special_tokens`: a
        `prompt_text` is encoded with the tokenizer's (its BOS); False for a text that has them already,
        such as a chat template rendered by the client. `clock`:
        the request's ledger, started at its arrival (by default, now). `skip_special_tokens`: the
        text leaves the tokenizer's special tokens out (vLLM's default). `truncate_prompt_tokens`: only
        the prompt's last that many tokens are given to the model (-1: as many as its context holds). `on_dispatch` is
        called once the prompt is on its way to the worker that computes its first token
        (at least a forward pass before the first delta). `guide_after`: given the prompt, the token a
        guided reply's guide waits for (a reasoning model's end of thinking), None for none."""
        timer = self.requests.start()
        clock = clock or PhaseClock(request_id, timer.arrival)
        clock.mark("ingress")
        params = common_pb2.SamplingParams()
        if sampling is not None:
            params.CopyFrom(sampling)
        spans = RequestTrace.start(request_id, "chat" if messages is not None else "text_completion", params)
        is_admitted = False
        try:
            # Admission control, before any worker hears of it: past the limit a request would only
            # queue behind the others on the workers, its time to first token growing with the queue.
            if self.max_num_requests and self.num_requests >= self.max_num_requests:
                raise OverloadedError(f"{self.num_requests} requests in progress, the gateway's limit "
                                      f"(--max-num-requests)")
            self.num_requests += 1
            is_admitted = True
            if sum(x is not None for x in (prompt_text, prompt_token_ids, messages)) != 1:
                raise InvalidRequestError("exactly one of prompt_text, prompt_token_ids and messages is required")
            if any(not s for s in stop):
                raise InvalidRequestError("stop strings must be non-empty")
            with spans.phase("tokenize"):
                prompt = await self._encode(request_id, prompt_text, prompt_token_ids, messages, chat_options,
                                            add_special_tokens)
                if truncate_prompt_tokens is not None:
                    prompt = self._truncated(prompt, truncate_prompt_tokens)
            if guide_after is not None and params.HasField("guided_regex"):
                token_id = guide_after(prompt)
                if token_id is not None:
                    params.guide_after_token_id = token_id
            clock.mark("tokenize")
            timer.num_prompt_tokens = len(prompt)
            with self.decode.hold() as decode_worker:
                async for delta in self._run(request_id, prompt, params, decode_worker, stop,
                                             include_stop_str_in_output, skip_special_tokens, timer, clock, spans,
                                             on_dispatch):
                    yield delta
        except grpc.aio.AioRpcError as e:
            mapped = _from_rpc_error(e)
            clock.end(error_reason(mapped))
            timer.fail(error_reason(mapped))
            if mapped is e:
                raise
            raise mapped from e
        except BaseException as e:  # GeneratorExit and CancelledError too: the consumer went away
            # Closed after its last delta, it had finished (the timer is done only by then).
            clock.end("finished" if timer.is_done else error_reason(e))
            timer.fail(error_reason(e))
            raise
        finally:
            if is_admitted:
                self.num_requests -= 1
            spans.end(clock.status, timer.num_prompt_tokens, timer.num_generated)

    async def _encode(self, request_id, prompt_text, prompt_token_ids, messages,
                      chat_options: ChatOptions, add_special_tokens: bool = True) -> Sequence[int]:
        timeout = self.deadlines.tokenizer_s
        if prompt_token_ids is not None:
            # As given, not copied: nothing changes a prompt. One from a gRPC request stays the
            # request's repeated field, which a worker's request is built from in 1 us; from a list
            # of 512 ids it takes 17, and making the list 20 more.
            # Nor scanned (~0.1 ms of a 512-id prompt, run cold): the worker refuses an id outside the
            # vocabulary, and where the gateway reads the ids first (hashing a block, decoding the
            # tail) a negative one is refused there. The OpenAI API's ids are bounded by its schema.
            prompt = prompt_token_ids
        elif prompt_text is not None:
            if len(prompt_text) <= self.local_tokenize_max_chars:
                prompt = self.tokenizer.encode(prompt_text, add_special_tokens=add_special_tokens)
            else:
                prompt = (await self.tokenizer_stub.Encode(tokenizer_pb2.EncodeRequest(
                    request_id=request_id, text=prompt_text, add_special_tokens=add_special_tokens),
                    timeout=timeout)).token_ids
        else:
            # As the tokenizer service reads them (services/tokenizer/converters.py).
            chat = [{**m, "content": m.get("content") or ""} for m in messages]
            if chat_options.template is not None and not self.trust_request_chat_template:
                raise InvalidRequestError(UNTRUSTED_TEMPLATE, param="chat_template")
            # A request's own template is rendered by the tokenizer service: nothing bounds its time,
            # which here would stall every other request's tokens.
            if chat_options.template is None and sum(len(m["content"]) for m in chat) <= self.local_tokenize_max_chars:
                try:
                    check_messages(chat)
                    prompt = self.tokenizer.apply_chat_template(chat, **chat_options.as_template_inputs())[1]
                except ChatTemplateError as e:  # what the tokenizer service refuses as INVALID_ARGUMENT
                    raise InvalidRequestError(str(e)) from None
            else:
                prompt = (await self.tokenizer_stub.ApplyChatTemplate(
                    chat_template_request(request_id, chat, chat_options), timeout=timeout)).token_ids
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        return prompt

    def _truncated(self, prompt: Sequence[int], keep: int) -> Sequence[int]:
        """The prompt's last `keep` tokens (-1: the context's worth; unknown context, all of them)."""
        if keep == -1:
            keep = self.tokenizer.max_model_len or len(prompt)
        if keep < 1:
            raise InvalidRequestError(f"truncate_prompt_tokens must be -1 or at least 1, got {keep}")
        return prompt[-keep:] if len(prompt) > keep else prompt

    def _check_context(self, prompt: Sequence[int], params: common_pb2.SamplingParams) -> None:
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
                                      f"({max_tokens})")

    def _prefills_locally(self, prompt: Sequence[int], decode_worker: Worker, num_cached: int) -> bool:
        """Conditional disaggregation: a prompt whose part the decode worker does not hold
        (`num_cached` tokens it does, per the prefix index) is this short is cheaper to prefill
        in the decode worker's running batch than on a prefill worker plus a KV transfer, as
        long as the decode worker is not already prefilling that much (its decode steps would
        stall)."""
        if self.prefill is None:
            return True
        limit = self.local_prefill_max_tokens
        uncached = len(prompt) - num_cached
        return uncached <= limit and decode_worker.queued_tokens + uncached <= limit

    async def _run(self, request_id: str, prompt: Sequence[int], params: common_pb2.SamplingParams,
                   decode_worker: Worker, stop: Sequence[str], include_stop_str_in_output: bool,
                   skip_special_tokens: bool,
                   timer: RequestTimer, clock: PhaseClock, spans: RequestTrace,
                   on_dispatch: Callable[[], None] | None) -> AsyncIterator[Delta]:
        self._check_context(prompt, params)
        output: _TextOutput | None = None  # made once the prompt is on its way: not on its critical path

        def dispatched() -> None:
            nonlocal output
            try:
                output = _TextOutput(self.tokenizer, prompt, stop, include_stop_str_in_output, params.min_tokens,
                                     skip_special_tokens)
            except ValueError as e:  # the prompt's tail holds a negative id
                raise InvalidRequestError(f"prompt {e}") from None
            PREFILLED_ON[clock.prefilled_on].inc()
            if on_dispatch is not None:
                on_dispatch()

        progress = _Progress()
        lookup = NO_LOOKUP
        with spans.phase("route"):
            # A prompt whose logprobs are asked for is computed whole: no cached prefix or host-tier
            # block is worth anything to it, so it is placed by load alone.
            if self.prefill_router is not None and self.prefill is not None and not params.HasField("prompt_logprobs"):
                # One round trip for both questions: where the prefix is among the prefill workers,
                # and how much of it this decode worker holds (asked only when it may prefill).
                try:
                    lookup = await self.prefill_router.lookup(
                        prompt, decode_worker.address if self.local_prefill_max_tokens > 0 else None)
                except ValueError as e:  # a negative id in a block it hashed
                    raise InvalidRequestError(f"prompt {e}") from None
        is_local = self._prefills_locally(prompt, decode_worker, lookup.decode_cached_tokens)
        clock.prefilled_on = "decode" if is_local else "prefill"
        steps = (self._local_steps if is_local else self._disaggregated_steps)(
            request_id, prompt, params, decode_worker, progress, clock, spans, lookup, dispatched)
        is_past_first = False
        first_id = request_id  # a moved request's later parts are `first_id~1`, `~2` on the workers
        gone: list[Worker] = []  # decode workers that went away mid-stream
        held = ExitStack()  # the decode worker a request moved to, counted busy until it ends
        try:
            while True:  # a request whose decode worker goes away mid-stream moves to another
                try:
                    async with aclosing(steps):
                        async for step in steps:
                            arrived = time.perf_counter()
                            text = output.add(step.token_ids, is_stopped_by_last=step.finish_reason == "stop")
                            if output.stops.is_stopped or step.finish_reason is not None:
                                timer.add_tokens(len(step.token_ids), arrived)
                                if not output.stops.is_stopped:
                                    text += output.finish()
                                progress.is_stopped_here = step.finish_reason is None
                                usage = Usage(len(prompt), output.num_tokens, progress.num_cached_tokens)
                                final = _final(text, step.token_ids, step.logprobs, step.finish_reason, output, usage)
                                if not is_past_first:
                                    final.prompt_token_ids, final.prompt_logprobs = prompt, step.prompt_logprobs
                                timer.finish(final.finish_reason)
                                spans.finish_reason(final.finish_reason, progress.num_cached_tokens)
                                # Before the last yield: a consumer may close the stream there.
                                step.settle(clock, arrived)
                                if not is_past_first:
                                    clock.handing_out = "first_token"
                                yield final
                                clock.end("finished")
                                return
                            if is_past_first:
                                yield Delta(text, step.token_ids, step.logprobs)
                            else:
                                spans.first_token()
                                yield Delta(text, step.token_ids, step.logprobs, prompt_token_ids=prompt,
                                            prompt_logprobs=step.prompt_logprobs)
                            # Counted and marked once handed out, as they arrived: the histograms and the
                            # worker's figures are not on their way.
                            step.settle(clock, arrived)
                            timer.add_tokens(len(step.token_ids), arrived)
                            clock.mark("detokenize_egress" if is_past_first else "first_token")
                            is_past_first = True
                    raise RuntimeError(f"decode worker {decode_worker.address} ended the stream of {request_id!r} "
                                       "without a finish reason")
                except grpc.aio.AioRpcError as e:
                    if not is_past_first:  # before the first token a prefill worker's error stands (or was retried)
                        raise
                    generated = list(output.detokenizer.output_token_ids)
                    moved_to = self._next_decode_worker(e, params, len(generated), [*gone, decode_worker])
                    if moved_to is None:
                        raise
                    gone.append(decode_worker)
                    decode_worker = held.enter_context(self.decode.hold(moved_to))
                    request_id = f"{first_id}~{len(gone)}"
                    steps = self._moved_steps(request_id, prompt, generated, params, moved_to, progress, clock,
                                              spans)
        finally:
            if not progress.is_released:
                self._abort_soon(decode_worker, request_id, common_pb2.FINISH_REASON_STOP if progress.is_stopped_here
                                 else common_pb2.FINISH_REASON_UNSPECIFIED)
            held.close()

    def _moved_steps(self, request_id: str, prompt: list[int], output: list[int], params: common_pb2.SamplingParams,
                     decode_worker: Worker, progress: _Progress, clock: PhaseClock,
                     spans: RequestTrace) -> AsyncIterator[_Step]:
        """The rest of a request moved to `decode_worker`: its prompt and its output so far prefilled
        again for it (their prefix mostly cached where the prompt was computed), the next token its first
        step. The workers take the output as the request's own, made elsewhere: its penalties, guide and
        seeded draws go on from it, as in a request that never moved."""
        continued = common_pb2.SamplingParams()
        continued.CopyFrom(params)
        continued.ClearField("prompt_logprobs")
        DECODE_MIGRATIONS.inc()
        steps = self._disaggregated_steps if self.prefill is not None else self._local_steps
        return steps(request_id, prompt, continued, decode_worker, progress, clock, spans, NO_LOOKUP,
                     lambda: None, output)

    def _next_decode_worker(self, error: grpc.aio.AioRpcError, params: common_pb2.SamplingParams,
                            num_generated: int, gone: list[Worker]) -> Worker | None:
        """Where a request goes after `error` from its decode worker, past its first token: another
        serving decode worker, when the worker went away, tokens are left to make and it has moved fewer
        than MAX_DECODE_MIGRATIONS times; else None."""
        if not (_went_away(error) and len(gone) <= MAX_DECODE_MIGRATIONS and num_generated < params.max_tokens):
            return None
        return self.decode.pick_other(gone)

    def _next_prefill_worker(self, error: BaseException, gone: list[Worker]) -> Worker | None:
        """Where a prompt goes after `error` from its prefill worker, before its first token: another
        serving prefill worker, when the worker went away and it has gone elsewhere fewer than
        MAX_PREFILL_RETRIES times; else None (the error stands)."""
        if not (_went_away(error) and len(gone) <= MAX_PREFILL_RETRIES):
            return None
        return self.prefill.pick_other(gone)

    async def _disaggregated_steps(self, request_id: str, prompt: Sequence[int], params: common_pb2.SamplingParams,
                                   decode_worker: Worker, progress: _Progress, clock: PhaseClock,
                                   spans: RequestTrace, lookup: Lookup, on_dispatch: Callable[[], None],
                                   output: Sequence[int] = ()) -> AsyncIterator[_Step]:
        """The first token from a prefill worker, which then writes the KV into pages it reserved
        on the decode worker; then the rest from the decode worker, once the pages are there.
        `output`: a moved request's so far (`_moved_steps`)."""
        # The worker counts as busy with what it has to compute: its cached prefix costs it little.
        route = self.prefill_router.choose(prompt, lookup) if self.prefill_router is not None else None
        chosen, num_cached = (route.worker, route.num_cached_tokens) if route is not None else (None, 0)
        host_tier = (prefill_pb2.HostTierSource(address=route.host_tier_address, num_blocks=route.host_tier_blocks)
                     if route is not None and route.host_tier_blocks else None)
        gone: list[Worker] = []  # prefill workers that went away before the first token
        while True:
            with self.prefill.hold(chosen, len(prompt) + len(output) - num_cached) as prefill_worker:
                clock.mark("route")
                prefill_call = None
                try:  # from here on, whatever fails stops the prefill worker's work too
                    with spans.calls():
                        prefill_call = await self.prefill_calls.start(prefill_worker, prefill_pb2.PrefillRequest(
                            request_id=request_id, token_ids=prompt, sampling=params, host_tier=host_tier,
                            target={"decode_address": decode_worker.address, "transport": self.kv_transport},
                            output_token_ids=output))
                    if not gone:
                        on_dispatch()
                        if route is not None:
                            try:
                                self.prefill_router.record(route, lookup)
                            except ValueError as e:  # a negative id in a block it hashed
                                raise InvalidRequestError(f"prompt {e}") from None
                    response = (await _next_event(prefill_call, "first_token")).first_token
                    break
                except BaseException as e:
                    if prefill_call is not None:
                        prefill_call.cancel()
                    self.prefill_calls.replenish(prefill_worker, ended_on=e)
                    chosen = self._next_prefill_worker(e, [*gone, prefill_worker])
                    if chosen is None:
                        raise
                    gone.append(prefill_worker)
                    num_cached, host_tier = 0, None  # what the router knew was of the worker that went
                    PREFILL_RETRIES.inc()
        try:
            progress.num_cached_tokens = response.num_cached_tokens
            timings = response.timings
            first = _Step([response.first_token_id], [response.logprobs] if response.HasField("logprobs") else [],
                          FINISH_REASON_NAMES.get(response.finish_reason), timings, response.prompt_logprobs)
            if first.finish_reason is not None:  # ended at prefill: whatever it reserved is aborted by `_run`
                _observe_prefill(self.requests, timings)
                yield first
                self.prefill_calls.replenish(prefill_worker)
                return
            yield first
            # The prefill worker writes the pages while the first token goes out.
            handoff = (await _next_event(prefill_call, "handoff")).handoff
        except BaseException as e:  # cut short (an error, or the consumer went away): prefill stops too
            prefill_call.cancel()
            self.prefill_calls.replenish(prefill_worker, ended_on=e)
            raise
        clock.mark("kv_transfer")
        _observe_prefill(self.requests, handoff.timings)
        with spans.calls():
            call = await self.decode_calls.start(decode_worker, decode_pb2.DecodeRequest(
                request_id=request_id, reservation_id=handoff.reservation_id, prompt_token_ids=prompt,
                first_token_id=response.first_token_id, sampling=params, output_token_ids=output))
        # Once this request is done with the prefill worker: the next request's call is opened
        # off both this one's first token and its handoff.
        self.prefill_calls.replenish(prefill_worker)
        # A call for a next request, once this one's first tokens are out (or it ended sooner): one per request.
        is_replenished = False
        try:
            # Its status follows the handoff: read, the call ends as a success on both sides.
            await prefill_call.code()
            async for chunk in _decode_steps(call, progress, self._mark_decode_chunks(clock, is_local=False)):
                yield chunk
                if not is_replenished:
                    self.decode_calls.replenish(decode_worker)
                    is_replenished = True
        except BaseException as e:
            if not is_replenished:
                self.decode_calls.replenish(decode_worker, ended_on=e)
            raise
        finally:
            self._close_soon(call, progress)

    async def _local_steps(self, request_id: str, prompt: Sequence[int], params: common_pb2.SamplingParams,
                           decode_worker: Worker, progress: _Progress, clock: PhaseClock,
                           spans: RequestTrace, lookup: Lookup, on_dispatch: Callable[[], None],
                           output: Sequence[int] = ()) -> AsyncIterator[_Step]:
        """Every token from the decode worker, which prefills the prompt itself: no prefill
        worker, no transfer. The part it does not hold counts against its room until the first token.
        `output`: a moved request's so far (`_moved_steps`)."""
        uncached = len(prompt) + len(output) - lookup.decode_cached_tokens
        decode_worker.queued_tokens += uncached
        is_counted = True
        clock.mark("route")
        with spans.calls():
            call = decode_worker.stub.GenerateLocally(decode_pb2.GenerateLocallyRequest(
                request_id=request_id, prompt_token_ids=prompt, sampling=params, output_token_ids=output),
                timeout=self.deadlines.decode_s)
        try:
            on_dispatch()
            async for step in _decode_steps(call, progress, self._mark_decode_chunks(clock, is_local=True)):
                if is_counted:
                    decode_worker.queued_tokens -= uncached
                    is_counted = False
                yield step
        finally:
            if is_counted:
                decode_worker.queued_tokens -= uncached
            self._close_soon(call, progress)

    def _mark_decode_chunks(self, clock: PhaseClock, is_local: bool) -> Callable[[decode_pb2.DecodeChunk], None]:
        """What each chunk from the decode worker marks on the ledger as it arrives. The first
        carries the worker's queue time (and a local prefill's compute); with a local prefill
        it brings the first token, so the rest of its wait is the call's (`rpc`)."""
        is_first = True

        def mark(chunk: decode_pb2.DecodeChunk) -> None:
            nonlocal is_first
            if not is_first:
                clock.mark("decode_steps")
                return
            is_first = False
            timings = chunk.timings
            if is_local:
                self.requests.queue.observe(timings.queue_seconds)
                clock.mark_split([("decode_queue", timings.queue_seconds),
                                  ("prefill_compute", timings.prefill_seconds)], rest="rpc")
            else:
                clock.mark_split([("decode_queue", timings.queue_seconds)], rest="decode_steps")
        return mark

    def _close_soon(self, call, progress: _Progress) -> None:
        """Cancel a decode stream cut short. One that ended, or that a stop string ended here (the
        Abort naming the stop ends it on the decode worker, which counts it as finished, not
        cancelled), is read to its end in the background: when tracing, its client span ends
        only there (the pipeline stops at the last chunk)."""
        if progress.is_stopped_here and not progress.is_released:
            self._in_background(_read_to_end(call, within_s=self.deadlines.abort_s))
        elif not progress.is_released:
            call.cancel()
        elif tracing.is_enabled():
            self._in_background(_read_to_end(call))

    def _in_background(self, work) -> None:
        """Run `work` to its end even when the caller is cancelled; `aclose` waits for it."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(_forget(self._background))

    def _abort_soon(self, worker: Worker, request_id: str, finish_reason: int) -> None:
        """Abort on decode in the background: it must run even when the caller was
        cancelled, and the consumer need not wait for it. `finish_reason`: why the request
        ended here when it finished (a stop string), UNSPECIFIED when it was cut short."""
        self._in_background(worker.stub.Abort(decode_pb2.AbortRequest(request_id=request_id,
                                                                      finish_reason=finish_reason),
                                              timeout=self.deadlines.abort_s))


def _forget(tasks: set[asyncio.Task]):
    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a failed Abort is logged by the lease expiry, not here
    return done


@dataclass
class _Progress:
    """What a request's steps learned on the way, for its usage and its clean-up."""
    num_cached_tokens: int = 0
    is_released: bool = False  # the decode worker finished the request and freed its pages itself
    is_stopped_here: bool = False  # a stop string ended it before the decode worker did


@dataclass
class _Step:
    token_ids: list[int]
    logprobs: list
    finish_reason: str | None
    prefill_timings: prefill_pb2.PrefillTimings | None = None  # the first token's, from a prefill worker
    prompt_logprobs: Sequence[common_pb2.TopLogprobs] = ()  # the first step's, when asked for

    def settle(self, clock: PhaseClock, arrived: float) -> None:
        """Mark the wait for a prefill worker's first token on the ledger, up to `arrived` (a
        perf_counter()), as the worker's timings cut it up: once the token is out, not on its
        way. (A decode worker's steps are marked as they arrive.)"""
        t = self.prefill_timings
        if t is not None:
            clock.mark_split([("prefill_queue", t.queue_seconds - t.host_tier_read_seconds - t.admit_seconds),
                              ("host_tier_read", t.host_tier_read_seconds),
                              ("prefill_admit", t.admit_seconds),
                              ("prefill_compute", t.prefill_seconds)], rest="rpc", at=arrived)


async def _next_event(call, kind: str) -> prefill_pb2.PrefillEvent:
    """The next event of a PrefillStream call, which must be a `kind` one."""
    event = await call.read()
    if event is grpc.aio.EOF or event.WhichOneof("event") != kind:
        got = "the end of the stream" if event is grpc.aio.EOF else f"a {event.WhichOneof('event')} event"
        raise RuntimeError(f"the prefill worker sent {got} where a {kind} event was due")
    return event


async def _read_to_end(call, within_s: float | None = None) -> None:
    """Read `call` to its end; cancelled if that takes longer than `within_s`."""
    try:
        await asyncio.wait_for(_drain(call), within_s)
    except asyncio.TimeoutError:
        call.cancel()


async def _drain(call) -> None:
    async for _ in call:
        pass


async def _decode_steps(call, progress: _Progress,
                        on_chunk: Callable[[decode_pb2.DecodeChunk], None]) -> AsyncIterator[_Step]:
    first = True
    async for chunk in call:
        on_chunk(chunk)
        if first:
            progress.num_cached_tokens = progress.num_cached_tokens or chunk.num_cached_tokens
            first = False
        reason = FINISH_REASON_NAMES.get(chunk.finish_reason)
        progress.is_released = reason is not None
        yield _Step(list(chunk.token_ids), list(chunk.logprobs), reason, prompt_logprobs=chunk.prompt_logprobs)


def _final(text: str, token_ids: list[int], logprobs: list, reason: str | None, output: _TextOutput,
           usage: Usage) -> Delta:
    matched = output.stops.matched_stop
    return Delta(text, token_ids, logprobs, finish_reason="stop" if matched is not None else reason,
                 matched_stop=matched, usage=usage)


def _observe_prefill(requests: RequestMetrics, timings: prefill_pb2.PrefillTimings) -> None:
    moved = timings.kv_transport != common_pb2.KV_TRANSPORT_UNSPECIFIED
    transport = common_pb2.KVTransport.Name(timings.kv_transport).removeprefix("KV_TRANSPORT_").lower()
    requests.observe_prefill(timings.queue_seconds, transport if moved else None, timings.kv_transfer_seconds,
                             timings.kv_transfer_bytes)


def _went_away(error: BaseException) -> bool:
    """A worker's call ended because the worker is gone or going (it stopped, died, or its engine failed
    on another request): UNAVAILABLE."""
    return isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.UNAVAILABLE


def error_reason(e: BaseException) -> str:
    """The `reason` a failed request is counted under: as the HTTP API's error codes name
    it where they do (`context_length_exceeded`, `overloaded`, `unavailable`), else the
    failed call's gRPC code, `cancelled` when the consumer went away, `internal_error`."""
    if isinstance(e, (GeneratorExit, asyncio.CancelledError)):
        return "cancelled"
    if isinstance(e, ContextLengthError):
        return "context_length_exceeded"
    if isinstance(e, InvalidRequestError):
        return "invalid_request"
    if isinstance(e, OverloadedError):
        return "overloaded"
    if isinstance(e, NoHealthyWorkerError):
        return "unavailable"
    if isinstance(e, grpc.aio.AioRpcError):
        return e.code().name.lower()
    return "internal_error"


def _from_rpc_error(e: grpc.aio.AioRpcError) -> Exception:
    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequestError(e.details())
    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return OverloadedError(e.details())
    return e
