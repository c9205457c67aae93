"""A Decode or GenerateLocally call's chunks: the request's outputs as DecodeChunks, its timings and
spans (`CallPhases`), its counts by finish reason, and an abort of the request when the call ends
early (the client went away, the server stops), which frees its pages."""
from __future__ import annotations

import dataclasses

import grpc

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from protos import common_pb2, decode_pb2
from services.common import request_spans, tracing
from services.common.converters import finish_reason_name
from services.common.engine_errors import EngineDeadError
from services.common.engine_loop import EngineLoop
from services.common.grpc_server import EarlyHeaders
from services.common.metrics import ServiceMetrics
from services.common.request_outputs import RequestRefusedError
from services.decode.converters import chunk_from_output
from services.decode.output_batches import OutputBatches

# How a Decode call ends whose request the engine finished "withheld" (protos/decode.proto's DecodeRequest).
WITHHELD = ("preempted, and the prefix cache no longer holds the tokens of its images or prompt embeddings, whose "
            "pixels or rows were not sent: resume it, giving them (GenerateLocally with the output so far)")


class CallPhases:
    """A call's timings and spans: the first output's go on the first chunk, the last's usage on the span."""

    def __init__(self, request_id: str, arrival_ns: int, num_prompt_tokens: int, max_tokens: int,
                 is_local: bool) -> None:
        self.arrival_ns = arrival_ns
        self.is_local = is_local  # GenerateLocally: the prompt is prefilled here
        self.finished_by_caller = common_pb2.FINISH_REASON_UNSPECIFIED  # set by an Abort that names a reason
        self.attrs = tracing.request_attributes(request_id) if tracing.is_enabled() else {}
        tracing.set_current_attributes({**self.attrs, tracing.GEN_AI_REQUEST_MAX_TOKENS: max_tokens,
                                        tracing.GEN_AI_USAGE_INPUT_TOKENS: num_prompt_tokens})

    def first(self, out: RequestOutput) -> decode_pb2.DecodeTimings:
        times = out.step_times
        queue_seconds = (request_spans.queue_end_ns(times) - self.arrival_ns) / 1e9
        request_spans.record_queue("decode.queue", self.arrival_ns, times, self.attrs)
        if self.is_local:
            request_spans.record_local_prefill(times, self.attrs)
        else:
            request_spans.record_first_step("decode.first_step", times, self.attrs)
        tracing.set_current_attributes({tracing.BATON_CACHED_TOKENS: out.num_cached_tokens})
        return decode_pb2.DecodeTimings(queue_seconds=max(queue_seconds, 0.0),
                                        prefill_seconds=times.prefill_seconds if times is not None else 0.0)

    def last(self, out: RequestOutput) -> None:
        tracing.set_current_attributes({tracing.GEN_AI_USAGE_OUTPUT_TOKENS: len(out.token_ids),
                                        tracing.GEN_AI_RESPONSE_FINISH_REASONS: [out.finish_reason or ""]})


async def decode_chunks(engine_loop: EngineLoop, request_id: str, outputs: OutputBatches, params: SamplingParams,
                  context, metrics: ServiceMetrics, phases: CallPhases, streaming: dict[str, CallPhases],
                  are_headers_sent: bool = False):
    """The DecodeChunks of a request just given to the engine (`outputs`: its outputs, batched);
    ValueError when the engine refuses it. A call that ends early (the client went away,
    the server stops) aborts the request, which frees its pages; the abort is queued
    behind the add, so it finds the request even when the add is still in flight. Once it
    has an output, the call is in `streaming`, where an Abort finds it."""
    is_finished = is_counted = False
    headers = EarlyHeaders(context)
    # Once the engine has taken it (a refused duplicate id is never here), even while its first chunk
    # waits for more tokens: an Abort naming a finish reason finds it then.
    outputs.on_first_output = lambda: streaming.__setitem__(request_id, phases)
    if not are_headers_sent:
        headers.send_soon()  # at the next await: the request is with the engine by then
    try:
        first = True
        while not is_finished:
            out = await outputs.next()
            if isinstance(out, RequestRefusedError):
                raise out
            if isinstance(out, EngineDeadError):  # queued behind the step that failed: it never ran
                is_finished = True  # nothing to abort
                await headers.sent()
                raise out
            if isinstance(out, Exception):
                metrics.count_error("engine_failed")
                is_counted = True
                await headers.sent()
                await context.abort(grpc.StatusCode.INTERNAL, f"the decode engine failed: {out}")
            if out.finish_reason == "withheld":  # its pages are freed: nothing to abort
                is_finished = is_counted = True
                metrics.count_error("withheld")
                if out.new_token_ids:  # batched behind the stream interval: the caller resumes after them
                    yield chunk_from_output(dataclasses.replace(out, finished=False, finish_reason=None), params)
                await headers.sent()
                await context.abort(grpc.StatusCode.ABORTED, WITHHELD)
            is_finished = out.finished
            chunk = chunk_from_output(out, params)
            if is_finished:
                phases.last(out)
                if out.finish_reason != "abort":
                    metrics.count_success(out.finish_reason)
                elif phases.finished_by_caller != common_pb2.FINISH_REASON_UNSPECIFIED:
                    chunk.finish_reason = phases.finished_by_caller
                    metrics.count_success(finish_reason_name(phases.finished_by_caller))
                else:
                    metrics.count_error("aborted")
            if first:
                chunk.num_cached_tokens = out.num_cached_tokens
                chunk.timings.CopyFrom(phases.first(out))
                first = False
                await headers.sent()  # once: sent, they stay sent
            yield chunk
    except RequestRefusedError:
        is_finished = True  # nothing was added
        await headers.sent()  # the caller aborts the call, which would send them too
        raise
    finally:
        if streaming.get(request_id) is phases:
            del streaming[request_id]
        if not is_finished:
            if phases.finished_by_caller != common_pb2.FINISH_REASON_UNSPECIFIED:
                metrics.count_success(finish_reason_name(phases.finished_by_caller))
            elif not is_counted:
                metrics.count_error("cancelled")
            engine_loop.abort_soon(request_id)
