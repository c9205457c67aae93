"""A request's phases on a worker's engine as spans, recorded once its first output is out.

The engine thread only stamps times (engine/step_times.py); these turn them into children
of the current span (the RPC's server span), so tracing adds nothing to the engine's steps.
They are recorded a little later (`tracing.soon`), after the response in hand has gone on
its way. Each returns at once while tracing is off.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from engine.step_times import StepTimes
from services.common import tracing


def queue_end_ns(times: StepTimes | None) -> int:
    """When the engine first stepped the request; now when it never did (finished outside a step)."""
    if times is None or times.first_step_start_ns is None:
        return time.time_ns()
    return times.first_step_start_ns


def record_queue(name: str, arrival_ns: int, times: StepTimes | None, attributes: Mapping[str, Any]) -> None:
    """`name` from the call's arrival to the engine's first step that included the request."""
    if tracing.is_enabled():
        tracing.soon(tracing.record_span, name, arrival_ns, queue_end_ns(times), attributes)


def record_prefill_chunks(times: StepTimes | None, attributes: Mapping[str, Any], parent=None) -> None:
    """One `prefill.chunk` per forward pass over the prompt, before the first token, and one
    `prefill.encode_images` per encoding of its images."""
    if tracing.is_enabled() and times is not None:
        tracing.soon(_record_prefill_chunks, times, attributes, parent)


def _record_prefill_chunks(times: StepTimes, attributes: Mapping[str, Any], parent) -> None:
    for i, chunk in enumerate(times.prefill_chunks):
        tracing.record_span("prefill.chunk", chunk.start_ns, chunk.end_ns,
                            {**attributes, tracing.BATON_CHUNK_INDEX: i, tracing.BATON_CHUNK_TOKENS: chunk.num_tokens,
                             tracing.BATON_BATCH_SEQS: chunk.num_seqs}, parent=parent)
    for encode in times.image_encodes:  # within the chunk whose step encoded them
        tracing.record_span("prefill.encode_images", encode.start_ns, encode.end_ns,
                            {**attributes, tracing.BATON_IMAGES: encode.num_images,
                             tracing.BATON_IMAGE_TOKENS: encode.num_tokens}, parent=parent)


def record_local_prefill(times: StepTimes | None, attributes: Mapping[str, Any]) -> None:
    """`decode.prefill` over a prompt prefilled on the decode worker, its chunks beneath it."""
    if tracing.is_enabled() and times is not None and times.prefill_chunks:
        tracing.soon(_record_local_prefill, times, attributes)


def _record_local_prefill(times: StepTimes, attributes: Mapping[str, Any]) -> None:
    chunks = times.prefill_chunks
    span = tracing.record_span("decode.prefill", chunks[0].start_ns, chunks[-1].end_ns, attributes)
    _record_prefill_chunks(times, attributes, parent=span)


def record_first_step(name: str, times: StepTimes | None, attributes: Mapping[str, Any]) -> None:
    """`name` over the engine's first step that included the request (its first token there)."""
    if tracing.is_enabled() and times is not None and times.first_step_start_ns is not None:
        tracing.soon(tracing.record_span, name, times.first_step_start_ns, times.first_step_end_ns, attributes)
