"""Beam search (vLLM's `use_beam_search`), run here over the mesh's ordinary requests, as vLLM's
OpenAI server runs it over its engine.

Each step asks the workers for one token after each live beam (the prompt and the beam's tokens
so far, a request of its own), with the logprobs of its 2 × width likeliest next tokens under the
raw logits. Of all (beam, token) pairs, ranked by summed logprob, an end-of-sequence token
among the first `width` ends its beam ("stop"), and the first `width` others are the next step's
beams; at max_tokens the first `width` end ("length"). The `width` best ended beams, scored as
transformers scores them (summed logprob / generated length ** length_penalty, the end token
counted), are the request's choices, best first. The search stops as soon as no live beam can
beat the worst of `width` ended ones (transformers' `early_stopping="never"`): the same beams as
running every step. A step's request reuses its prefill worker's prefix cache (the router sends
it where the beam's earlier tokens are), so it computes little more than the last page.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from protos import common_pb2
from services.gateway.deltas import Delta, TextOutput, Usage
from services.gateway.timeline import ResponseTimeline
from services.tokenizer.chat_template import ChatOptions

T = TypeVar("T")
MAX_BEAM_WIDTH = 10  # a step asks for 2 × width candidates; the engine lists at most 20


@dataclass(frozen=True)
class Beam:
    token_ids: tuple[int, ...] = ()
    logprob: float = 0.0  # summed over token_ids
    logprobs: tuple[common_pb2.TopLogprobs, ...] = ()  # each token's own, and the candidates beside it
    finish_reason: str | None = None

    def score(self, length_penalty: float) -> float:
        return self.logprob / len(self.token_ids) ** length_penalty

    def extended(self, chosen: common_pb2.TokenLogprob, candidates: common_pb2.TopLogprobs,
                 finish_reason: str | None = None) -> Beam:
        entry = common_pb2.TopLogprobs(sampled=chosen, top=candidates.top)
        return Beam((*self.token_ids, chosen.token_id), self.logprob + chosen.logprob, (*self.logprobs, entry),
                    finish_reason)


@dataclass(frozen=True)
class BeamSearch:
    width: int
    max_tokens: int
    length_penalty: float = 1.0
    end_token_ids: frozenset[int] = frozenset()  # EOS and stop_token_ids; none with ignore_eos

    def could_improve(self, live: Sequence[Beam], ended: Sequence[Beam]) -> bool:
        """Whether a live beam may still end better than the worst of `width` ended ones: its tokens to
        come add logprobs ≤ 0, so its best is its sum now over the length that divides it least
        (the longest for a positive length penalty, the present one otherwise)."""
        if len(ended) < self.width:
            return True
        length = self.max_tokens if self.length_penalty > 0 else len(live[0].token_ids)
        best = max(beam.logprob for beam in live) / length ** self.length_penalty
        return best > min(beam.score(self.length_penalty) for beam in ended)


Step = Callable[[Sequence[int], int], Awaitable[common_pb2.TopLogprobs]]


async def search(step: Step, prompt: Sequence[int], spec: BeamSearch) -> list[Beam]:
    """The best `spec.width` beams after `prompt`, best first. `step(token_ids, i)`: the candidates
    after `token_ids` (the i-th of a step's concurrent calls), at least 2 × width of them."""
    live, ended = [Beam()], []
    for length in range(1, spec.max_tokens + 1):
        steps = await all_of([step([*prompt, *beam.token_ids], i) for i, beam in enumerate(live)])
        candidates = sorted(((beam.logprob + entry.logprob, entry, beam, top)
                             for beam, top in zip(live, steps) for entry in top.top),
                            key=lambda c: c[0], reverse=True)
        live = []
        for rank, (_, entry, beam, top) in enumerate(candidates):
            if entry.token_id in spec.end_token_ids:
                if rank < spec.width:
                    ended.append(beam.extended(entry, top, "stop"))
            elif length == spec.max_tokens:
                if rank < spec.width:
                    ended.append(beam.extended(entry, top, "length"))
            elif len(live) < spec.width:
                live.append(beam.extended(entry, top))
        ended = sorted(ended, key=lambda b: b.score(spec.length_penalty), reverse=True)[:spec.width]
        if not live or not spec.could_improve(live, ended):
            break
    return ended


def beam_deltas(beams: Sequence[Beam], tokenizer, prompt: Sequence[int], num_logprobs: int | None,
                include_stop_str_in_output: bool, skip_special_tokens: bool, num_cached_tokens: int,
                prompt_logprobs: Sequence[common_pb2.TopLogprobs]) -> list[Delta]:
    """Each beam as a whole choice: one delta, its text detokenized after the prompt (the end token's
    left out unless `include_stop_str_in_output`, as a sampled reply's), its logprobs with
    `num_logprobs` candidates each (None: none)."""
    deltas = []
    for beam in beams:
        output = TextOutput(tokenizer, prompt, (), include_stop_str_in_output, 0, skip_special_tokens)
        text = output.add(beam.token_ids, is_stopped_by_last=beam.finish_reason == "stop") + output.finish()
        logprobs = [] if num_logprobs is None else [
            common_pb2.TopLogprobs(sampled=entry.sampled, top=entry.top[:num_logprobs]) for entry in beam.logprobs]
        deltas.append(Delta(text, list(beam.token_ids), logprobs, beam.finish_reason,
                            usage=Usage(len(prompt), len(beam.token_ids), num_cached_tokens),
                            prompt_token_ids=prompt, prompt_logprobs=prompt_logprobs))
    return deltas


async def beam_search(pipeline, request_id: str, params: common_pb2.SamplingParams, width: int,
                      length_penalty: float = 1.0, *,
                      prompt_text: str | None = None, prompt_token_ids: Sequence[int] | None = None,
                      messages: Sequence[Mapping[str, Any]] | None = None, chat_options: ChatOptions = ChatOptions(),
                      add_special_tokens: bool = True, truncate_prompt_tokens: int | None = None,
                      num_logprobs: int | None = None, include_stop_str_in_output: bool = False,
                      skip_special_tokens: bool = True, timeline: ResponseTimeline | None = None,
                      on_dispatch: Callable[[], None] | None = None) -> list[Delta]:
    """One prompt's beams as whole choices, through `pipeline` (a RequestPipeline). `params`: the
    request's: its max_tokens (without one, what the context leaves), stop_token_ids and ignore_eos
    (which leaves the model's end-of-sequence tokens to run on), priority, LoRA adapter, cache salt
    and prompt logprobs. Each step's request is `request_id~beamK.I` (the I-th beam's after K
    tokens), on `timeline` when given."""
    prompt = await pipeline.prompts.encode(request_id, prompt_text, prompt_token_ids, messages, chat_options,
                                           add_special_tokens)
    if truncate_prompt_tokens is not None:
        prompt = pipeline.prompts.truncated(prompt, truncate_prompt_tokens)
    checked = common_pb2.SamplingParams(max_tokens=params.max_tokens) if params.HasField("max_tokens") else \
        common_pb2.SamplingParams()
    pipeline.prompts.check_context(prompt, checked)  # fills in what the context leaves, without one
    ends = {*params.stop_token_ids, *(() if params.ignore_eos else pipeline.tokenizer.eos_token_ids)}
    spec = BeamSearch(width, checked.max_tokens, length_penalty, frozenset(ends))
    step_params = common_pb2.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, priority=params.priority,
                                            logprobs=max(2 * spec.width, num_logprobs or 0))
    if params.HasField("lora_name"):
        step_params.lora_name = params.lora_name
    if params.HasField("cache_salt"):
        step_params.cache_salt = params.cache_salt
    first_params = common_pb2.SamplingParams()
    first_params.CopyFrom(step_params)
    if params.HasField("prompt_logprobs"):
        first_params.prompt_logprobs = params.prompt_logprobs
    first: list[Delta] = []

    async def step(token_ids: Sequence[int], index: int) -> common_pb2.TopLogprobs:
        num_generated = len(token_ids) - len(prompt)
        step_id = f"{request_id}~beam{num_generated}.{index}"
        delta = await collect(pipeline.generate(
            step_id, prompt_token_ids=token_ids, sampling=step_params if num_generated else first_params,
            clock=timeline.clock(step_id) if timeline is not None else None,
            on_dispatch=None if num_generated else on_dispatch))
        if not num_generated:
            first.append(delta)
        return delta.logprobs[0]

    beams = await search(step, prompt, spec)
    return beam_deltas(beams, pipeline.tokenizer, prompt, num_logprobs, include_stop_str_in_output,
                       skip_special_tokens, first[0].usage.cached_tokens, first[0].prompt_logprobs)


async def beam_choices(searches: Sequence[Awaitable[list[Delta]]]) -> AsyncIterator[tuple[int, Delta]]:
    """The choices of several prompts' searches (`width` each, in order), once all are done."""
    index = 0
    for deltas in await all_of(searches):
        for delta in deltas:
            yield index, delta
            index += 1


async def all_of(calls: Sequence[Awaitable[T]]) -> list[T]:
    """Their results; the first to fail cancels the others and is raised as it is (the API maps it)."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(call) for call in calls]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]


async def collect(deltas: AsyncIterator[Delta]) -> Delta:
    """A one-token request's only delta."""
    last = None
    async with aclosing(deltas) as stream:
        async for delta in stream:
            last = delta
    if last is None:
        raise RuntimeError("a beam search step ended without output")
    return last
