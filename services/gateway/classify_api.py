"""vLLM's `POST /classify` (and `/v1/classify`): each input's class, by a sequence classifier's head
(a `*ForSequenceClassification` checkpoint: reward models, classifiers) at its last token.

`input`: a text, a list of texts, token ids or a list of such lists, as `/v1/embeddings` takes
them (embeddings_api.py: encoded with special tokens, vLLM's `truncate_prompt_tokens`, each input a
request against --max-num-requests). Answers `data`, per input its `probs` over the labels
(softmax; a sigmoid for a model of one label, a score), the likeliest `label` (the checkpoint's
id2label names) and `num_classes`. A model without a classification head is a 400.
"""
from __future__ import annotations

import time
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.embeddings_api import EmbeddingRequest, Input, embeddings
from services.gateway.pipeline import RequestPipeline


class ClassificationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: Input
    user: str | None = None
    add_special_tokens: bool = True  # vLLM's
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None


async def classify(pipeline: RequestPipeline, body: ClassificationRequest, lora: str | None, model: str,
                   request_id: str, max_model_len: int | None) -> dict[str, Any]:
    asked = EmbeddingRequest(model=model, input=body.input, add_special_tokens=body.add_special_tokens,
                             truncate_prompt_tokens=body.truncate_prompt_tokens)
    replies, num_tokens = await embeddings(pipeline, asked, lora, request_id, max_model_len, classify=True)
    data = []
    for index, reply in enumerate(replies):
        probs = list(reply.probs)
        data.append({"index": index, "label": reply.labels[max(range(len(probs)), key=probs.__getitem__)],
                     "probs": probs, "num_classes": len(probs)})
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
