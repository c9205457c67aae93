"""vLLM's `POST /pooling`: what the model's pooler makes of each input, for any pooling model.

The body is `/v1/embeddings`' (embeddings_api.py: `input` in its four shapes or `messages`,
`truncate_prompt_tokens`, `dimensions`, `encoding_format`, `add_special_tokens`) with vLLM's
`task` and `use_activation`. `task` "embed" answers each input's embedding (normalized unless
`use_activation` or `normalize` is false), "classify" its classifier's probabilities (a
`*ForSequenceClassification` checkpoint's head: softmax, a sigmoid for one label); none, or
vLLM's older "encode", the model's own: "classify" for a model with a classification head, else
"embed". The per-token tasks answer a list with one entry per input token: "token_embed" each
token's last hidden state (cut to `dimensions`, then normalized, each), "token_classify" the
classification head's probabilities at each token (a process reward model's per-step scores; a
decoder's head: an encoder's pools its [CLS] token); with `encoding_format` "base64" their rows
are packed one after another. Each input's answer is a `data` entry of object "pooling".
Plugins are refused by name; so are a classifier's raw logits (`use_activation` false with a
classify task).
"""
from __future__ import annotations

import time
from typing import Literal

from pydantic import model_validator

from protos import embed_pb2
from services.gateway.embeddings_api import EmbeddingRequest, embeddings, encoded
from services.gateway.errors import APIError, FieldError
from services.gateway.pipeline import RequestPipeline

SERVED_TASKS = ("embed", "classify", "token_embed", "token_classify")


class PoolingRequest(EmbeddingRequest):
    task: Literal["embed", "classify", "encode", "token_embed", "token_classify", "plugin"] | None = None
    use_activation: bool | None = None  # vLLM's: embed normalized, classify as probabilities (None: true)

    @model_validator(mode="after")
    def _served_task(self):
        if self.task == "plugin":
            raise FieldError("task", "task 'plugin' is not served here: no pooling plugins are loaded "
                                     f"(tasks {', '.join(SERVED_TASKS)})")
        return self

    def pooling_task(self, has_classifier: bool) -> str:
        """The task served, one of SERVED_TASKS; APIError (400) for a classifier's raw logits, not
        served here."""
        task = self.task if self.task in SERVED_TASKS else "classify" if has_classifier else "embed"
        if task.endswith("classify") and self.use_activation is False:
            raise APIError(400, "a classifier's raw logits are not served here: use_activation false only with "
                                "task embed or token_embed", param="use_activation")
        return task


async def pool(pipeline: RequestPipeline, body: PoolingRequest, lora: str | None, model: str, request_id: str,
               max_model_len: int | None, has_classifier: bool) -> dict:
    """The response body of `body` for `model` (`lora`: the adapter it names); `has_classifier`: the
    model has a classification head, its default task then "classify"."""
    task = body.pooling_task(has_classifier)
    if body.use_activation is not None:
        body = body.model_copy(update={"normalize": body.use_activation})
    per_token = task.startswith("token_")
    replies, num_tokens = await embeddings(pipeline, body, lora, request_id, max_model_len,
                                           classify=task.endswith("classify"), per_token=per_token)
    data = [pooled(reply, task, body.encoding_format) for reply in replies]
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": index, "object": "pooling", "data": pooled} for index, pooled in enumerate(data)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def pooled(reply: embed_pb2.EmbedResponse, task: str, encoding_format: str) -> list | str:
    """One input's `data`: its vector, or one a token; base64 packs a per-token answer's rows one after another."""
    if task == "classify":
        return list(reply.probs)
    if task == "embed":
        return encoded(list(reply.embedding), encoding_format)
    rows = [list(token.values) for token in reply.tokens]
    return rows if encoding_format == "float" else encoded([x for row in rows for x in row], encoding_format)
