"""`DecodeMoves`: a request's moves to other decode workers, each after the one it streamed from went
away mid-stream (past its first token), or ended it for want of its images' pixels or prompt rows (to
the least loaded, that one too, which prefills it again itself): the workers that went away, the one
it moved to (counted busy until the request ends) and its id there. step_sources.py says whether and
where it may go (`next_decode_worker`) and makes the new worker's calls (`moved`). pipeline.py makes
one at a request's first move, so a request that never moves pays nothing for it on its path."""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import ExitStack

import grpc

from protos import common_pb2
from services.gateway.deltas import TextOutput
from services.gateway.request_bytes import BulkInputs
from services.gateway.request_trace import RequestTrace
from services.gateway.step_sources import StepSources
from services.gateway.timeline import PhaseClock
from services.gateway.worker_steps import Progress, Step, was_withheld
from services.gateway.workers import Worker, WorkerPool


class DecodeMoves:
    """The moves of request `request_id`, whose steps come from `steps` and whose decode workers are
    `decode`'s. `close` once the request has ended."""

    def __init__(self, steps: StepSources, decode: WorkerPool, request_id: str) -> None:
        self.steps = steps
        self.decode = decode
        self.first_id = request_id  # a moved request's later parts are `first_id~1`, `~2` on the workers
        self.num_moves = 0
        self.gone: list[Worker] = []  # decode workers that went away mid-stream
        self.held = ExitStack()  # the decode worker a request moved to, counted busy until it ends

    def move(self, error: grpc.aio.AioRpcError, decode_worker: Worker, prompt: Sequence[int], output: TextOutput,
             params: common_pb2.SamplingParams, progress: Progress, clock: PhaseClock,
             spans: RequestTrace, bulk: BulkInputs | None) -> tuple[Worker, str, AsyncIterator[Step]] | None:
        """After `error` from `decode_worker`, the worker the request moved to, its id there and its steps
        from there on; None where it does not move (the error stands). `bulk`: the bytes of the inputs
        `params` carry."""
        generated = list(output.detokenizer.output_token_ids)
        # A request its worker preempted without its images or prompt rows is computed again where it is
        # decoded, as a preempted request is, given them now: queued there while pages are short, where a
        # prefill worker's reservation would be refused.
        is_resumed = was_withheld(error)
        gone = self.gone if is_resumed else [*self.gone, decode_worker]
        moved_to = self.steps.next_decode_worker(error, params, len(generated), gone)
        if moved_to is None:
            return None
        self.gone = gone
        self.num_moves += 1
        decode_worker = self.held.enter_context(self.decode.hold(moved_to))
        request_id = f"{self.first_id}~{self.num_moves}"
        steps = self.steps.moved(request_id, prompt, generated, params, moved_to, progress, clock, spans,
                                 locally=is_resumed, bulk=bulk)
        return decode_worker, request_id, steps

    def close(self) -> None:
        """The request has ended: the worker it moved to is no longer busy with it."""
        self.held.close()
