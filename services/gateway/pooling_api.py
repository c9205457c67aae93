"""vLLM's `POST /pooling`: what the model's pooler makes of each input, for any pooling model.

The body is `/v1/embeddings`' (embeddings_api.py: `input` in its four shapes or `messages`,
`truncate_prompt_tokens`, `dimensions`, `encoding_format`, `add_special_tokens`) with vLLM's
`task` and `use_activation`. `task` "embed" answers each input's embedding (normalized unless
`use_activation` or `normalize` is false), "classify" its classifier's probabilities (a
`*ForSequenceClassification` checkpoint's head: softmax, a sigmoid for one label); none, or
vLLM's older "encode", the model's own: "classify" for a model with a classification head, else
"embed". Each input's answer is a `data` entry of object "pooling". Per-token pooling
(`token_embed`, `token_classify`) and plugins are refused by name: the workers pool one vector
an input; so are a classifier's raw logits (`use_activation` false with "classify").
"""
from __future__ import annotations

import time
from typing import Literal

from pydantic import model_validator

from services.gateway.embeddings_api import EmbeddingRequest, embeddings, encoded
from services.gateway.errors import APIError, FieldError
from services.gateway.pipeline import RequestPipeline

PER_TOKEN_TASKS = ("token_embed", "token_classify", "plugin")


class PoolingRequest(EmbeddingRequest):
    task: Literal["embed", "classify", "encode", "token_embed", "token_classify", "plugin"] | None = None
    use_activation: bool | None = None  # vLLM's: embed normalized, classify as probabilities (None: true)

    @model_validator(mode="after")
    def _served_task(self):
        if self.task in PER_TOKEN_TASKS:
            raise FieldError("task", f"task {self.task!r} is not served here: the workers pool one vector per "
                                     "input (tasks embed and classify)")
        return self

    def pooling_task(self, has_classifier: bool) -> str:
        """The task served: "embed" or "classify"; APIError (400) for a classifier's raw logits, not served
        here."""
        task = self.task if self.task in ("embed", "classify") else "classify" if has_classifier else "embed"
        if task == "classify" and self.use_activation is False:
            raise APIError(400, "a classifier's raw logits are not served here: use_activation false only with "
                                "task embed", param="use_activation")
        return task


async def pool(pipeline: RequestPipeline, body: PoolingRequest, lora: str | None, model: str, request_id: str,
               max_model_len: int | None, has_classifier: bool) -> dict:
    """The response body of `body` for `model` (`lora`: the adapter it names); `has_classifier`: the
    model has a classification head, its default task then "classify"."""
    task = body.pooling_task(has_classifier)
    if body.use_activation is not None:
        body = body.model_copy(update={"normalize": body.use_activation})
    replies, num_tokens = await embeddings(pipeline, body, lora, request_id, max_model_len,
                                           classify=task == "classify")
    data = [list(reply.probs) if task == "classify" else encoded(list(reply.embedding), body.encoding_format)
            for reply in replies]
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": index, "object": "pooling", "data": pooled} for index, pooled in enumerate(data)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
