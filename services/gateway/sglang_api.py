"""SGLang's native API, for clients written against an SGLang server: `POST /generate` (what
`sglang.bench_serving --backend sglang` and RL rollout loops call), `GET /get_model_info` and
`GET /health_generate`.

`/generate` takes `text` or `input_ids` (one prompt, or a batch of them), SGLang's `sampling_params`
and `stream`, and answers as SGLang does: `{"text", "output_ids", "meta_info"}` for one prompt and
one sample, a list of them otherwise; streamed, each SSE event carries the text so far (not a delta)
and its `index`, and the stream ends with `data: [DONE]`. `meta_info` has the request id, prompt,
completion and cached token counts, the end-to-end latency and `finish_reason` (`{"type": "stop",
"matched": the stop token id or string}`, `{"type": "length", "length": max_new_tokens}`), and with
`return_logprob` the output tokens' `[logprob, token_id, text]` (and their top `top_logprobs_num`, and
those of the ids `token_ids_logprob` names),
and from `logprob_start_len` on the prompt's (`max_new_tokens` 0: the prompt's alone, which is how
SGLang's clients score a text). The sampling fields are checked as the OpenAI API
checks them (services/gateway/sglang_protocol.py), their errors named as SGLang names the fields.
`POST /abort_request` (`rid`, or `abort_all`) ends a sample wherever it is, as RL rollout loops end
the ones they no longer need: its answer so far comes back with `{"type": "abort"}` as its finish.
Other APIs' running requests end the same way (running_requests.py), as SGLang's do: by `rid` (an
OpenAI request's `x-request-id`), or all of them.
The weight updates those loops make between rounds are weight_updates.py's.
"""
from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from protos import common_pb2
from services.gateway.choices import first_choice, merge_choices
from services.gateway.completion_request import pipeline_prompt
from services.gateway.deltas import Delta, prompt_only
from services.gateway.errors import APIError, to_api_error
from services.gateway.http_body import parsed_body
from services.gateway.http_responses import ClientDisconnected, sse_event, unless_disconnected
from services.gateway.sequence_groups import counted_by_prompt
from services.gateway.sglang_protocol import AbortRequest, GenerateRequest, completion_request, stream_interval
from services.gateway.weight_updates import WeightUpdates

ABORTED = {"type": "abort", "message": "aborted by /abort_request"}


@dataclass
class _Output:
    """One sample's answer so far."""

    rid: str
    aborted: asyncio.Event
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[common_pb2.TopLogprobs] = field(default_factory=list)
    prompt_token_ids: Sequence[int] = ()
    prompt_logprobs: Sequence[common_pb2.TopLogprobs] = ()
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: dict[str, Any] | None = None

    def add(self, delta: Delta, max_new_tokens: int) -> None:
        self.text += delta.text
        self.output_ids += delta.token_ids
        self.output_logprobs += delta.logprobs
        if delta.prompt_token_ids:
            self.prompt_token_ids, self.prompt_logprobs = delta.prompt_token_ids, delta.prompt_logprobs
            self.prompt_tokens = len(delta.prompt_token_ids)
        if delta.usage is not None:
            self.prompt_tokens, self.cached_tokens = delta.usage.prompt_tokens, delta.usage.cached_tokens
        if delta.finish_reason == "length":
            self.finish_reason = {"type": "length", "length": max_new_tokens}
        elif delta.finish_reason == "stop":
            matched = delta.matched_stop if delta.matched_stop is not None else self.output_ids[-1]
            self.finish_reason = {"type": "stop", "matched": matched}
        elif delta.finish_reason == "abort" and self.aborted.is_set():
            self.finish_reason = ABORTED
        elif delta.finish_reason is not None:
            self.finish_reason = {"type": "abort", "message": delta.finish_reason}


@dataclass
class _Shape:
    """How the answers are written: SGLang's fields, as this request asked for them."""

    started: float
    max_new_tokens: list[int]  # by sample
    token_text: Callable[[int], str] | None  # with return_text_in_logprobs
    logprobs: bool
    logprob_start_len: int
    is_batch: bool
    has_token_ids_logprobs: bool = False  # token_ids_logprob asked for

    def answer(self, index: int, output: _Output) -> dict[str, Any]:
        meta: dict[str, Any] = {"id": output.rid, "finish_reason": output.finish_reason,
                                "prompt_tokens": output.prompt_tokens, "completion_tokens": len(output.output_ids),
                                "cached_tokens": output.cached_tokens,
                                "e2e_latency": round(time.perf_counter() - self.started, 6)}
        if self.logprobs:
            meta["output_token_logprobs"] = [self._entry(r.sampled) for r in output.output_logprobs]
            meta["output_top_logprobs"] = [[self._entry(t) for t in r.top] for r in output.output_logprobs]
            if self.has_token_ids_logprobs:
                meta["output_token_ids_logprobs"] = [[self._entry(t) for t in r.requested]
                                                     for r in output.output_logprobs]
            start = max(self.logprob_start_len, 0)
            # The first prompt token has no logprob (nothing before it); the records start at the second.
            records = [None, *output.prompt_logprobs] if self.logprob_start_len >= 0 else []
            prompt = list(output.prompt_token_ids)
            meta["input_token_logprobs"] = [
                [None, prompt[p], self._text(prompt[p])] if record is None else self._entry(record.sampled)
                for p, record in enumerate(records) if p >= start]
            meta["input_top_logprobs"] = [None if record is None else [self._entry(t) for t in record.top]
                                          for p, record in enumerate(records) if p >= start]
            if self.has_token_ids_logprobs:
                meta["input_token_ids_logprobs"] = [
                    None if record is None else [self._entry(t) for t in record.requested]
                    for p, record in enumerate(records) if p >= start]
        answer = {"text": output.text, "output_ids": output.output_ids, "meta_info": meta}
        if self.is_batch:
            answer["index"] = index
        return answer

    def _entry(self, logprob: common_pb2.TokenLogprob) -> list[Any]:
        return [logprob.logprob, logprob.token_id, self._text(logprob.token_id)]

    def _text(self, token_id: int) -> str | None:
        return self.token_text(token_id) if self.token_text is not None else None


def add_sglang_routes(app: FastAPI, state, check_model: Callable[[str], str | None],
                      weights: WeightUpdates) -> None:
    """`state`: the gateway's (http_app.GatewayState); `check_model`: a name's LoRA adapter, or a 404;
    `weights`: the mesh's weight updates (their version)."""
    pipeline = state.pipeline
    # Each running sample's abort, by its rid; gone with the sample (the last of a reused rid's wins).
    aborts: weakref.WeakValueDictionary[str, asyncio.Event] = weakref.WeakValueDictionary()

    async def generate(request: Request):
        body = await parsed_body(request, GenerateRequest)
        lora = check_model(body.lora_path) if body.lora_path is not None else None
        state.models.check_generates()
        started = time.perf_counter()
        prompts = body.prompts()
        rids = body.rids(len(prompts), "gen")
        streams, outputs, max_new_tokens = [], [], []
        prompt_logprobs = body.top_logprobs_num if body.return_logprob and body.logprob_start_len >= 0 else None
        if body.token_ids_logprob and not body.return_logprob:
            raise APIError(400, "token_ids_logprob: their logprobs come with return_logprob true",
                           param="token_ids_logprob")
        prompt_of_choice = []
        for p, (prompt, sampling, rid, named_ids) in enumerate(zip(
                prompts, body.sampling_per_prompt(len(prompts)), rids, body.token_ids_per_prompt(len(prompts)),
                strict=True)):
            asked = completion_request(prompt, sampling, lora or state.model_name,
                                       body.top_logprobs_num if body.return_logprob else None, prompt_logprobs)
            given = pipeline_prompt(prompt)
            for j in range(asked.n):
                sample_rid = rid if asked.n == 1 else f"{rid}-{j}"
                sampling_params = asked.sampling(asked.max_tokens_run, asked.logprobs, j,
                                                 defaults=pipeline.prompts.generation_defaults)
                if lora is not None:
                    sampling_params.lora_name = lora
                if body.priority is not None:
                    sampling_params.priority = -body.priority
                sampling_params.stream_interval = stream_interval(sampling)
                sampling_params.logprob_token_ids.extend(named_ids)
                aborted = aborts[sample_rid] = asyncio.Event()
                stream = pipeline.generate(
                    sample_rid, **given, sampling=sampling_params, stop=asked.stops,
                    include_stop_str_in_output=asked.include_stop_str_in_output,
                    skip_special_tokens=asked.skip_special_tokens, is_streamed=body.stream)
                streams.append(prompt_only(stream) if asked.max_tokens == 0 else stream)  # scoring the prompt
                outputs.append(_Output(sample_rid, aborted=aborted))
                max_new_tokens.append(asked.max_tokens)
                prompt_of_choice.append(p)
        shape = _Shape(started, max_new_tokens, state.token_text if body.return_text_in_logprobs else None,
                       body.return_logprob, body.logprob_start_len, is_batch=len(outputs) > 1 or body.is_batch,
                       has_token_ids_logprobs=bool(body.token_ids_logprob))
        choices = counted_by_prompt(merge_choices(streams), prompt_of_choice, pipeline.requests)
        prompt_param = "text" if body.text is not None else "input_ids"
        index, delta = await first_choice(choices, prompt_param)  # a bad prompt: its 400 before any event
        outputs[index].add(delta, max_new_tokens[index])
        if body.stream:
            return StreamingResponse(_events(choices, (index, delta), outputs, shape, prompt_param),
                                     media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

        async def collect() -> None:
            async for index, delta in choices:
                outputs[index].add(delta, max_new_tokens[index])
        try:
            await unless_disconnected(request, collect())
        except ClientDisconnected:
            return JSONResponse({}, status_code=499)  # nobody reads it
        except Exception as e:
            raise to_api_error(e, prompt_param) from e
        finally:
            await choices.aclose()
        answers = [shape.answer(i, output) for i, output in enumerate(outputs)]
        return JSONResponse(answers if shape.is_batch else answers[0])

    def mark_aborted(rids: Sequence[str]) -> None:
        for aborted in map(aborts.get, rids):
            if aborted is not None:
                aborted.set()

    async def abort_request(request: Request):
        body = await parsed_body(request, AbortRequest)
        # Their answers say who ended them; not those held at the pause by abort_all: they go on after it.
        mark_aborted(pipeline.running.abort_all() if body.abort_all else pipeline.running.abort(body.rid))
        return JSONResponse({})

    async def get_model_info(request: Request):
        return JSONResponse({"model_path": state.model_name, "tokenizer_path": state.model_name,
                             "is_generation": state.models.generates_text, "weight_version": weights.weight_version})

    async def health_generate(request: Request):
        """SGLang's deep health check: one token generated through the mesh (200), or why not (503)."""
        sampling = common_pb2.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        try:
            async for _ in pipeline.generate(f"health-{uuid.uuid4().hex}", prompt_token_ids=[0], sampling=sampling):
                pass
        except Exception as e:
            raise APIError(503, f"generation failed: {to_api_error(e, 'text').message}", code="unavailable") from e
        return JSONResponse({})

    app.add_route("/generate", generate, methods=["POST", "PUT"])  # SGLang's server takes either
    app.add_route("/abort_request", abort_request, methods=["POST"])
    app.add_route("/get_model_info", get_model_info, methods=["GET"])
    app.add_route("/health_generate", health_generate, methods=["GET"])


async def _events(choices: AsyncIterator[tuple[int, Delta]], first: tuple[int, Delta], outputs: list[_Output],
                  shape: _Shape, prompt_param: str) -> AsyncIterator[bytes]:
    """Each sample's answer so far, one event a delta, then [DONE]; an error after the first event
    travels as an event (the status is out)."""
    try:
        yield sse_event(shape.answer(first[0], outputs[first[0]]))
        try:
            async for index, delta in choices:
                outputs[index].add(delta, shape.max_new_tokens[index])
                yield sse_event(shape.answer(index, outputs[index]))
        except Exception as e:
            yield sse_event(to_api_error(e, prompt_param).body())
    finally:
        await choices.aclose()
    yield b"data: [DONE]\n\n"

