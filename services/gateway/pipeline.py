"""One request's path through the mesh, as the gateway drives it:

    Encode / ApplyChatTemplate (tokenizer), or here for a short prompt, or token ids as given
      → the context check, here (arithmetic on the model's context length)
      → the prefill worker: where the prompt's prefix is cached, against load (router.py)
      → PrefillStream (prefill P: streams the first token, then reserves pages on D,
        writes the KV into them and names the reservation), on a call kept open to P
        ahead of the request where there is one (kept_calls.py)
      → Decode (D, a stream of token ids in chunks of the request's stream interval; a reply
        not streamed and without stop strings in one), on a call kept open to D likewise
      → incremental detokenization and stop strings, here in-process (as vLLM's frontend)

or, for a prompt whose part D does not already hold (the prefix index says, from the
router's copy of it) is at most `local_prefill_max_tokens`, when D has room
(conditional disaggregation, as Dynamo does it): GenerateLocally on D, which prefills it
in its own running batch; no prefill worker and no KV transfer.

and out as a stream of `Delta`s. The HTTP and public gRPC layers sit on top of this. This
module decides a request's path and turns its steps into deltas; step_sources.py makes the
workers' calls that give the steps. Its base, Admission (admission.py), lets a request in;
request_prompt.py makes its prompt's token ids and sampling parameters; prefill_places.py says
where its prompt is prefilled; decode_moves.py moves its stream to another decode worker when
its own goes away.

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
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import grpc

from engine.config import DEFAULT_MAX_LOGPROBS
from protos import common_pb2
from services.common.metrics import RequestMetrics, RequestTimer, ServiceMetrics
from services.gateway.admission import Admission
from services.gateway.decode_moves import DecodeMoves
from services.gateway.deltas import Delta, TextOutput
from services.gateway.generation_defaults import GenerationDefaults
from services.gateway.given_embeddings import GivenImages
from services.gateway.kv_capacity import fit_kv_pool, kv_tokens_needed
from services.gateway.pooling_metrics import PoolingMetrics
from services.gateway.prefill_places import PREFILLED_ON, prefills_locally
from services.gateway.prefill_route import prompt_lookup
from services.gateway.prompt_encoder import ModelText, PromptEncoder
from services.gateway.reasoning_config import ThinkingMarkers
from services.gateway.request_bytes import BulkInputs
from services.gateway.request_deltas import RequestDeltas
from services.gateway.request_errors import InvalidRequestError, error_reason, from_rpc_error
from services.gateway.request_log import RequestLog
from services.gateway.request_prompt import PromptChecks, RequestPrompt, prepared_prompt
from services.gateway.request_trace import RequestTrace
from services.gateway.running_requests import RunningRequest, RunningRequests
from services.gateway.step_sources import Deadlines, StepSources
from services.gateway.timeline import PhaseClock
from services.gateway.worker_steps import Progress, Step
from services.gateway.workers import Worker, WorkerPool
from services.tokenizer.chat_template import ChatOptions
from services.tokenizer.stop_strings import Stop

WHOLE_REPLY = 2**32 - 1  # a stream interval no reply reaches: its tokens come with its last


class RequestPipeline(Admission):
    """Drives requests through a tokenizer, N prefill and M decode workers.

    `tokenizer` is the model's tokenizer loaded in this process (`ModelTokenizer`), used
    to detokenize the output; it, `tokenizers`, `local_tokenize_max_chars`,
    `trust_request_chat_template` and `generation_defaults` make the prompts
    (prompt_encoder.py). `preopen_prefill_calls`: a
    prompt goes to its prefill worker on a call opened ahead of it where one is kept
    (kept_calls.py), else on a new call; a handed-off prompt goes to its decode worker so
    either way. `metrics`: the gateway's (its registry is served on `/metrics`); by
    default a registry of its own, unlabelled.
    """

    def __init__(self, tokenizers: WorkerPool, tokenizer: ModelText, prefill: WorkerPool | None, decode: WorkerPool,
                 deadlines: Deadlines = Deadlines(),
                 kv_transport: common_pb2.KVTransport = common_pb2.KV_TRANSPORT_UNSPECIFIED,
                 prefill_router=None, local_prefill_max_tokens: int = 0, local_tokenize_max_chars: int = 0,
                 preopen_prefill_calls: bool = True, metrics: ServiceMetrics | None = None,
                 max_num_requests: int = 0, stream_interval: int = 1, trust_request_chat_template: bool = False,
                 generation_defaults: GenerationDefaults = GenerationDefaults(), request_log: RequestLog | None = None,
                 default_chat_template_kwargs: Mapping[str, Any] | None = None, chat_content_format: str = "auto",
                 thinking_markers: ThinkingMarkers | None = None, max_logprobs: int = DEFAULT_MAX_LOGPROBS):
        self.tokenizers = tokenizers  # the tokenizer services
        self.tokenizer = tokenizer
        self.prefill = prefill  # None: colocated, every prompt prefilled on its decode worker
        self.decode = decode
        self.deadlines = deadlines
        self.local_prefill_max_tokens = local_prefill_max_tokens  # 0: every prompt goes to a prefill worker
        self.metrics = metrics or ServiceMetrics("gateway")
        self.requests = RequestMetrics(self.metrics)
        super().__init__(self.metrics, max_num_requests)
        self.stream_interval = stream_interval  # a request's unless its sampling parameters name their own
        # Its trust_request_chat_template, template defaults and generation_defaults are the APIs' too
        # (/tokenize, sampling).
        self.prompts = PromptEncoder(tokenizer, tokenizers, deadlines.tokenizer_s, deadlines.tokenizer_hedge_s,
                                     local_tokenize_max_chars, trust_request_chat_template, generation_defaults,
                                     default_chat_template_kwargs, chat_content_format)
        self.steps = StepSources(prefill, decode, deadlines, kv_transport, prefill_router, self.requests,
                                 preopen_prefill_calls)
        self.pooling = PoolingMetrics(self.metrics)  # embeddings_api.py's requests, by either API
        self.running = RunningRequests(lambda worker, request_id: self.steps.abort_soon(
            worker, request_id, common_pb2.FINISH_REASON_UNSPECIFIED))
        self.request_log = request_log or RequestLog()  # off unless asked (its level may change while serving)
        self.checks = PromptChecks(thinking_markers, max_logprobs)

    @property
    def prefill_router(self):
        return self.steps.prefill_router

    async def aclose(self) -> None:
        """End the calls kept open to the workers, and wait for the Aborts and stream reads still in
        flight (call before closing the channels)."""
        await self.steps.aclose()

    async def generate(
        self,
        request_id: str,
        *,
        prompt_text: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        prompt_embeds: common_pb2.PromptEmbeds | None = None,
        images: GivenImages | None = None,
        chat_options: ChatOptions = ChatOptions(),
        add_special_tokens: bool = True,
        sampling: common_pb2.SamplingParams | None = None,
        stop: Sequence[Stop] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        truncate_prompt_tokens: int | None = None,
        clock: PhaseClock | None = None,
        on_dispatch: Callable[[], None] | None = None,
        guide_after: Callable[[Sequence[int]], Sequence[int] | None] | None = None,
        is_streamed: bool = True,
    ) -> AsyncIterator[Delta]:
        """Exactly one of `prompt_text`, `prompt_token_ids`, `messages` (rendered as `chat_options` say) and
        `prompt_embeds` (a prompt given as embeddings: placeholder tokens, one per row); `images`: the
        pixels of the messages' images, in order. Raises
        `InvalidRequestError` (incl. `ContextLengthError`) for bad input, `OverloadedError`
        when no pages are free, `grpc.aio.AioRpcError` for a worker that failed. `add_special_tokens`: a
        `prompt_text` is encoded with the tokenizer's (its BOS); False for a text that has them already,
        such as a chat template rendered by the client. `clock`:
        the request's ledger, started at its arrival (by default, now). `skip_special_tokens`: the
        text leaves the tokenizer's special tokens out (vLLM's default). `truncate_prompt_tokens`: only
        the prompt's last that many tokens are given to the model (-1: as many as its context holds). `on_dispatch` is
        called once the prompt is on its way to the worker that computes its first token
        (at least a forward pass before the first delta). `guide_after`: given the prompt, the tokens a
        guided reply's guide waits for (a reasoning model's end of thinking), None for none. `is_streamed`:
        False for a reply its client gets whole, whose tokens then come in as few deltas as the stream
        interval and its stop strings allow."""
        timer = self.requests.start()
        clock = clock or PhaseClock(request_id, timer.arrival)
        clock.mark("ingress")
        params = common_pb2.SamplingParams()
        if sampling is not None:
            params.CopyFrom(sampling)
        if not params.stream_interval:
            # A reply handed out whole wants no token before its last from the decode worker, unless
            # its stop strings are looked for as the text comes.
            params.stream_interval = self.stream_interval if is_streamed or stop else WHOLE_REPLY
        spans = RequestTrace.start(request_id, "chat" if messages is not None else "text_completion", params)
        is_admitted = False
        request_log = self.request_log if self.request_log.is_on else None  # as it is at the request's arrival
        logs_texts = request_log is not None and request_log.logs_texts
        last: Delta | None = None
        output: list[str] = []  # its texts, when they are logged
        try:
            # Among the running requests from its arrival, where an operator's abort finds it.
            # The workers know it by an id of its own, as vLLM's engine does a client's: one client id may run
            # twice at once (an x-request-id reused, or retried through another gateway of the same workers
            # while the first try still runs), and a prefill worker holds a request's id until its handoff.
            worker_id = f"{request_id}~{os.urandom(4).hex()}"
            with self.running.running(request_id) as running:
                await self._pause_passed(running)
                self.admit()
                is_admitted = True
                prompt, bulk = await prepared_prompt(self.prompts, request_id, RequestPrompt(
                    prompt_text, prompt_token_ids, messages, prompt_embeds, images, chat_options, add_special_tokens,
                    truncate_prompt_tokens), params, stop, self.checks, guide_after, spans)
                clock.mark("tokenize")
                timer.num_prompt_tokens = len(prompt)
                if request_log is not None:
                    # As the request asked (not the gateway's stream interval for it).
                    request_log.received(request_id, prompt, sampling or params, prompt_text)
                is_max_tokens_given = params.HasField("max_tokens")
                self.prompts.check_context(prompt, params)
                with self.decode.hold(self.decode.pick(
                        len(prompt), kv_tokens_needed(prompt, params, is_max_tokens_given))) as decode_worker:
                    fit_kv_pool(decode_worker, prompt, params, is_max_tokens_given)
                    async for delta in self._run(worker_id, prompt, params, decode_worker, stop,
                                                 include_stop_str_in_output, skip_special_tokens, timer, clock, spans,
                                                 running, on_dispatch, bulk):
                        last = delta
                        if logs_texts:
                            output.append(delta.text)
                        yield delta
        except grpc.aio.AioRpcError as e:
            mapped = from_rpc_error(e)
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
                self.release()
            spans.end(clock.status, timer.num_prompt_tokens, timer.num_generated)
            if request_log is not None:
                request_log.finished(request_id, clock, timer, last, output)

    async def _run(self, request_id: str, prompt: Sequence[int], params: common_pb2.SamplingParams,
                   decode_worker: Worker, stop: Sequence[Stop], include_stop_str_in_output: bool,
                   skip_special_tokens: bool,
                   timer: RequestTimer, clock: PhaseClock, spans: RequestTrace, running: RunningRequest,
                   on_dispatch: Callable[[], None] | None, bulk: BulkInputs | None) -> AsyncIterator[Delta]:
        """The request's deltas from its workers (its context checked); `bulk`: the bytes of the inputs `params`
        carry."""
        def make_output() -> TextOutput:
            try:
                # Placeholders are no text to detokenize after: embeddings' output starts from none.
                context = () if params.HasField("prompt_embeds") else prompt
                return TextOutput(self.tokenizer, context, stop, include_stop_str_in_output, params.min_tokens,
                                  skip_special_tokens)
            except ValueError as e:  # the prompt's tail holds a negative id
                raise InvalidRequestError(f"prompt {e}") from None

        progress = Progress()
        deltas = RequestDeltas(make_output, prompt, params, timer, clock, spans, progress)

        def dispatched(call: grpc.aio.Call) -> None:
            running.waits_on(call)
            if not deltas.start():  # on another prefill worker, after the first went away
                return
            PREFILLED_ON[clock.prefilled_on].inc()
            if on_dispatch is not None:
                on_dispatch()

        with spans.phase("route"):
            # How much of it this decode worker holds is asked only when it may prefill.
            lookup = await prompt_lookup(self.prefill_router if self.prefill is not None else None, prompt, params,
                                         decode_worker.address if self.local_prefill_max_tokens > 0 else None)
        is_local = prefills_locally(prompt, decode_worker, lookup.decode_cached_tokens, self.prefill,
                                    self.local_prefill_max_tokens)
        clock.prefilled_on = "decode" if is_local else "prefill"
        if running.is_aborted:  # while it waited at a pause, was tokenized or routed: no worker has heard of it
            deltas.start()
            steps = _ended_by_abort()
            progress.is_released = True
        else:
            steps = (self.steps.local if is_local else self.steps.disaggregated)(
                request_id, prompt, params, decode_worker, progress, clock, spans, lookup, dispatched, bulk=bulk)
        moves: DecodeMoves | None = None  # made at its first move to another decode worker
        try:
            while True:  # a request whose decode worker goes away mid-stream moves to another
                try:
                    async with aclosing(steps):
                        async for step in steps:
                            arrived = time.perf_counter()
                            if running.request_id != request_id:  # its stream from this worker has begun
                                running.streams_from(decode_worker, request_id)
                            delta = deltas.of(step, arrived)
                            yield delta
                            if delta.finish_reason is not None:
                                clock.end("finished")
                                return
                            deltas.handed_out(step, arrived)
                    raise RuntimeError(f"decode worker {decode_worker.address} ended the stream of {request_id!r} "
                                       "without a finish reason")
                except asyncio.CancelledError:
                    if not running.was_aborted_while_waiting():
                        raise
                    # Its end is handed out as any other: the Abort `streams_from` then sends the decode
                    # worker frees whatever a prefill worker cancelled mid-handoff had reserved there.
                    progress.is_released = True
                    steps = _ended_by_abort()
                except grpc.aio.AioRpcError as e:
                    # Before the first token a prefill worker's error stands (one that went away was left for
                    # another already); a decode worker that was prefilling the prompt itself and went away is
                    # left as one that goes away mid-stream is.
                    if not deltas.is_past_first and not is_local:
                        raise
                    if moves is None:
                        moves = DecodeMoves(self.steps, self.decode, request_id)
                    moved = moves.move(e, decode_worker, prompt, deltas.output, params, progress, clock, spans, bulk)
                    if moved is None:
                        raise
                    decode_worker, request_id, steps = moved
                    is_local = moves.prefills_on_decode
        finally:
            if not progress.is_released:
                ended = common_pb2.FINISH_REASON_STOP if progress.is_stopped_here else \
                    common_pb2.FINISH_REASON_UNSPECIFIED
                self.steps.abort_soon(decode_worker, request_id, ended)
            if moves is not None:
                moves.close()


async def _ended_by_abort() -> AsyncIterator[Step]:
    """The last step of a request aborted before its first token: no tokens."""
    yield Step([], [], "abort")
