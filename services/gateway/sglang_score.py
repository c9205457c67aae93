"""SGLang's score API for a generative model (`/score` and `/v1/score` with `label_token_ids`, beside
vLLM's score API on those paths, told apart by that field): how likely each of `label_token_ids` is to
come next after `query` and each of `items`, as rerankers that answer "yes" or "no" (Qwen3-Reranker's
way) are served by SGLang.

Each item is joined to the query, as texts or as token ids (the item first with `item_first`), and
the model's distribution of the next token read at the labels (SamplingParams.logprob_token_ids):
{"scores": [[one per label] per item], "model", "usage", "object": "scoring"}, each score the label's
probability, or with `apply_softmax` the labels' logprobs softmaxed among themselves.
"""
from __future__ import annotations

import json
import math
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from protos import common_pb2
from services.gateway.choices import merge_choices
from services.gateway.completion_request import pipeline_prompt
from services.gateway.errors import APIError
from services.gateway.openai_protocol import TokenId
from services.gateway.pipeline import RequestPipeline

MAX_LABELS = 64  # each label's logprob is read at every item's next position


class SGLangScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    query: StrictStr | Annotated[list[TokenId], Field(min_length=1)]
    items: StrictStr | Annotated[list[StrictStr], Field(min_length=1)] | \
        Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    label_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_LABELS)]
    apply_softmax: bool = False
    item_first: bool = False

    def prompts(self) -> list[str | list[int]]:
        items = [self.items] if isinstance(self.items, str) else self.items
        if any(isinstance(item, str) != isinstance(self.query, str) for item in items):
            raise APIError(400, "query and items must both be texts or both be token ids", param="items")
        return [item + self.query if self.item_first else self.query + item for item in items]


def asks_for_labels(raw: bytes) -> bool:
    """Whether a score request's body is SGLang's (it names `label_token_ids`) rather than vLLM's."""
    try:
        body = json.loads(raw)
    except ValueError:
        return False  # vLLM's parser says what is wrong with it
    return isinstance(body, dict) and "label_token_ids" in body


async def sglang_score(pipeline: RequestPipeline, body: SGLangScoreRequest, lora: str | None, model: str,
                       request_id: str) -> dict[str, Any]:
    sampling = common_pb2.SamplingParams(max_tokens=1, temperature=0, logprobs=0,
                                         logprob_token_ids=body.label_token_ids)
    if lora is not None:
        sampling.lora_name = lora
    streams = []
    for index, prompt in enumerate(body.prompts()):
        given = pipeline_prompt(prompt)
        streams.append(pipeline.generate(f"{request_id}-{index}", **given, sampling=sampling, is_streamed=False))
    logprobs: list[list[float]] = [[] for _ in streams]
    num_prompt_tokens = 0
    async for index, delta in merge_choices(streams):
        if delta.prompt_token_ids is not None:
            num_prompt_tokens += len(delta.prompt_token_ids)
        if delta.logprobs and not logprobs[index]:  # the next token's distribution: the first position's
            logprobs[index] = [entry.logprob for entry in delta.logprobs[0].requested]
    return {"scores": [_scores(row, body.apply_softmax) for row in logprobs], "model": model,
            "usage": {"prompt_tokens": num_prompt_tokens, "completion_tokens": 0, "total_tokens": num_prompt_tokens},
            "object": "scoring", "id": request_id}


def _scores(logprobs: list[float], apply_softmax: bool) -> list[float]:
    if not apply_softmax:
        return [math.exp(logprob) for logprob in logprobs]
    top = max(logprobs)
    weights = [math.exp(logprob - top) for logprob in logprobs]
    return [weight / sum(weights) for weight in weights]
