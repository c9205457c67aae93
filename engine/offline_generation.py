"""Offline generation: a list of prompts added to an engine at once and their outputs streamed
until every one is finished (vLLM's `LLM.generate`), with no service around the engine."""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def generate(
    engine: LLMEngine, prompts: list[list[int]], sampling_params: SamplingParams | list[SamplingParams],
    request_counter: Iterator[int],
) -> Iterator[RequestOutput]:
    """Adds every prompt to `engine`, as request "gen-N" for the next N of `request_counter`, and streams
    outputs until all are finished."""
    params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
    ids = [f"gen-{next(request_counter)}" for _ in prompts]
    for request_id, prompt, p in zip(ids, prompts, params):
        engine.add_request(request_id, prompt, p)
    pending = set(ids)
    while pending:
        for out in engine.step():
            if out.request_id in pending:
                if out.finished:
                    pending.discard(out.request_id)
                yield out
