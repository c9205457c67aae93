"""`DecodeMoves`: a request's moves, after a call for it ended past its first token (or before it, when its
decode worker was prefilling the prompt itself), its prompt and output so far prefilled again for the worker
it goes on with:

- the worker went away (UNAVAILABLE): the request goes to another serving decode worker, its prompt and its
  output so far prefilled again for it (their prefix mostly cached where the prompt was computed), at most
  MAX_DECODE_MIGRATIONS times;
- the worker preempted it and could not compute it again without its images' pixels or prompt rows, which it
  is not sent (ABORTED; protos/decode.proto's DecodeRequest): the least loaded serving decode worker, that one
  too, prefills it again itself, given them, as a preempted request is computed again where it is decoded
  (queued there while pages are short, where a prefill worker's reservation would be refused). Each such
  resume makes a token at its prefill: no bound is needed;
- its prefill worker went away after its first token, while it reserved or wrote the pages (UNAVAILABLE, not
  the decode worker's handed on): the same decode worker, another prefill worker computing it again, at most
  MAX_PREFILL_RETRIES times;
- its Decode call found its pages freed, their reservation's lease out before the call came (NOT_FOUND: a
  gateway stalled as long, frozen or starved): prefilled again, for another serving decode worker or, where
  there is none, the same one, at most MAX_LOST_HANDOFFS times;
- its decode worker had too few free pages for it within the prefill worker's wait (RESOURCE_EXHAUSTED,
  after the first token): prefilled again for another serving decode worker it has not tried, whose pages
  are reserved only if free now (it waited once already), as long as there is one; where none is left the
  refusal stands (429). Routing counts a worker's requests, not its pages: one decode worker may be full
  of long contexts while another has room.

The workers take the output as the request's own, made elsewhere: its penalties, guide and seeded draws go on
from it, as in a request that never moved. pipeline.py makes one `DecodeMoves` at a request's first move, so a
request that never moves pays nothing for it on its path.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import ExitStack

import grpc
from prometheus_client import Counter

from protos import common_pb2
from services.gateway.deltas import TextOutput
from services.gateway.prefill_route import NO_LOOKUP
from services.gateway.request_bytes import BulkInputs
from services.gateway.request_trace import RequestTrace
from services.gateway.step_sources import MAX_PREFILL_RETRIES, PREFILL_RETRIES, StepSources
from services.gateway.timeline import PhaseClock
from services.gateway.worker_steps import (
    Progress,
    Step,
    found_no_pages,
    lost_its_pages,
    prefill_went_away,
    was_withheld,
    went_away,
)
from services.gateway.workers import Worker, WorkerPool

DECODE_MIGRATIONS = Counter("baton_gateway_decode_migrations_total",
                            "Requests moved to another decode worker because theirs went away (UNAVAILABLE) "
                            "mid-stream: prompt and output so far prefilled again there")
DECODE_RESUMES = Counter("baton_gateway_decode_resumes_total",
                         "Requests a decode worker preempted and could not compute again without their images' "
                         "pixels or prompt rows, which it is not sent (ABORTED): prompt, images and output so far "
                         "prefilled again by the least loaded decode worker, given them")
LOST_HANDOFFS = Counter("baton_gateway_lost_handoffs_total",
                        "Requests whose KV pages their decode worker had freed before their Decode call came (the "
                        "reservation's lease ran out: NOT_FOUND): prompt and output so far prefilled again")
MAX_DECODE_MIGRATIONS = 2  # moves after a decode worker went away, at most, a request
MAX_LOST_HANDOFFS = 2  # prefilled again after the pages were freed, at most, a request
FULL_DECODE_MOVES = Counter("baton_gateway_full_decode_moves_total",
                            "Requests moved to another decode worker because theirs had too few free pages for "
                            "them within the prefill worker's wait (RESOURCE_EXHAUSTED): prompt and output so far "
                            "prefilled again, reserving there only what is free at once")


class DecodeMoves:
    """The moves of request `request_id`, whose steps come from `steps` and whose decode workers are
    `decode`'s: the workers that went away, the one it moved to (counted busy until the request ends) and
    its id there. `close` once the request has ended."""

    def __init__(self, steps: StepSources, decode: WorkerPool, request_id: str) -> None:
        self.steps = steps
        self.decode = decode
        self.first_id = request_id  # a moved request's later parts are `first_id~1`, `~2` on the workers
        self.num_moves = 0
        self.num_lost = 0  # handoffs whose pages were freed before the Decode call came
        self.num_prefills_gone = 0  # prefill workers that went away after its first token
        self.gone: list[Worker] = []  # decode workers that went away mid-stream
        self.full: list[Worker] = []  # decode workers that had no pages for it
        self.held = ExitStack()  # the decode worker a request moved to, counted busy until it ends
        self.prefills_on_decode = False  # where it moved last, its decode worker prefills it itself

    def move(self, error: grpc.aio.AioRpcError, decode_worker: Worker, prompt: Sequence[int], output: TextOutput,
             params: common_pb2.SamplingParams, progress: Progress, clock: PhaseClock,
             spans: RequestTrace, bulk: BulkInputs | None) -> tuple[Worker, str, AsyncIterator[Step]] | None:
        """After `error` from `decode_worker`, the worker the request moved to, its id there and its steps
        from there on; None where it does not move (the error stands). `bulk`: the bytes of the inputs
        `params` carry."""
        generated = list(output.detokenizer.output_token_ids)
        if len(generated) >= params.max_tokens:
            return None
        is_resumed = was_withheld(error)
        if is_resumed:
            moved_to, counter = self.decode.pick_other(self.gone), DECODE_RESUMES
        elif prefill_went_away(error) and self.num_prefills_gone < MAX_PREFILL_RETRIES:
            self.num_prefills_gone += 1
            # Its decode worker is as good as ever: another prefill worker computes the prompt again for it.
            # The pages the one gone reserved there, if it got that far, are freed now, not when their lease ends.
            self.steps.abort_soon(decode_worker, self._request_id(), common_pb2.FINISH_REASON_UNSPECIFIED)
            moved_to, counter = decode_worker, PREFILL_RETRIES
        elif went_away(error) and len(self.gone) < MAX_DECODE_MIGRATIONS:
            self.gone.append(decode_worker)
            moved_to, counter = self.decode.pick_other(self.gone), DECODE_MIGRATIONS
        elif lost_its_pages(error) and self.num_lost < MAX_LOST_HANDOFFS:
            self.num_lost += 1
            # Another worker first: one whose lease is shorter than the way from prefill to decode (its --lease-ms)
            # frees every request's pages; the same one where there is no other, as it serves still.
            moved_to = self.decode.pick_other([*self.gone, decode_worker]) or \
                (decode_worker if decode_worker.is_serving else None)
            counter = LOST_HANDOFFS
        elif found_no_pages(error):
            self.full.append(decode_worker)
            moved_to = self.decode.pick_other([*self.gone, *self.full], len(prompt) + len(generated))
            counter = FULL_DECODE_MOVES
        else:
            return None
        if moved_to is None:
            return None
        counter.inc()
        self.num_moves += 1
        if moved_to is not decode_worker:  # the same one is held already, for the request
            decode_worker = self.held.enter_context(self.decode.hold(moved_to))
        request_id = self._request_id()
        continued = common_pb2.SamplingParams()
        continued.CopyFrom(params)
        continued.ClearField("prompt_logprobs")
        self.prefills_on_decode = is_resumed or self.steps.prefill is None
        if self.prefills_on_decode:
            steps = self.steps.local(request_id, prompt, continued, moved_to, progress, clock, spans, NO_LOOKUP,
                                     lambda call: None, generated, bulk)
        else:  # once one decode worker's wait was waited out, no other's is
            steps = self.steps.disaggregated(request_id, prompt, continued, moved_to, progress, clock, spans,
                                             NO_LOOKUP, lambda call: None, generated, bulk,
                                             reserve_at_once=bool(self.full))
        return decode_worker, request_id, steps

    def _request_id(self) -> str:
        """Its id on the workers since its last move."""
        return f"{self.first_id}~{self.num_moves}" if self.num_moves else self.first_id

    def close(self) -> None:
        """The request has ended: the worker it moved to is no longer busy with it."""
        self.held.close()
