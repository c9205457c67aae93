"""vLLM's score and rerank APIs over the served model's embeddings (embeddings_api.py): a pair of
texts scores the cosine similarity of their embeddings, as vLLM scores with an embedding model.

A sequence classifier of one label (a cross-encoder reranker, `is_cross_encoder`) scores a pair as
vLLM scores with one: the two texts joined by the tokenizer's pair template, read by the head,
sigmoid of its logit.

`POST /score` (and `/v1/score`): `text_1` and `text_2`, each a text or a list of them: one against
one, one against each of a list, or a list against a list of the same length pair by pair; answers
`data`, a score per pair in order. `POST /rerank` (and `/v1/rerank`, `/v2/rerank`: Jina's and
Cohere's shape): a `query` and its `documents`, answered with `results` ordered by
`relevance_score`, highest first, each with the document's `index` and `text`, the first `top_n`
(0, the default: all). Both take vLLM's `truncate_prompt_tokens`; `model` may be left out (the
served model) or name a LoRA adapter. Each distinct text is embedded once.
"""
from __future__ import annotations

import time
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictStr, model_validator

from engine.classifier_config import classifier_labels, is_sequence_classifier
from services.gateway.embeddings_api import EmbeddingRequest, embeddings
from services.gateway.errors import FieldError
from services.gateway.pipeline import RequestPipeline

Texts = StrictStr | Annotated[list[StrictStr], Field(min_length=1)]


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    text_1: Texts
    text_2: Texts
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None

    @model_validator(mode="after")
    def _pairs(self):
        first, second = _listed(self.text_1), _listed(self.text_2)
        if len(first) > 1 and len(first) != len(second):
            raise FieldError("text_2", f"text_1 and text_2 must be as long when text_1 is a list of more than one "
                                       f"text: {len(first)} and {len(second)}")
        return self

    def pairs(self) -> list[tuple[str, str]]:
        first, second = _listed(self.text_1), _listed(self.text_2)
        return list(zip(first * len(second) if len(first) == 1 else first, second))


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    query: StrictStr
    documents: Annotated[list[StrictStr], Field(min_length=1)]
    top_n: Annotated[int, Field(ge=0)] = 0
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None


async def score(pipeline: RequestPipeline, body: ScoreRequest, lora: str | None, model: str, request_id: str,
                max_model_len: int | None, is_cross_encoder: bool = False) -> dict[str, Any]:
    pairs = body.pairs()
    similarity, num_tokens = await _similarities(pipeline, pairs, body.truncate_prompt_tokens, lora, request_id,
                                                 max_model_len, is_cross_encoder)
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": index, "object": "score", "score": value} for index, value in enumerate(similarity)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


async def rerank(pipeline: RequestPipeline, body: RerankRequest, lora: str | None, model: str, request_id: str,
                 max_model_len: int | None, is_cross_encoder: bool = False) -> dict[str, Any]:
    pairs = [(body.query, document) for document in body.documents]
    similarity, num_tokens = await _similarities(pipeline, pairs, body.truncate_prompt_tokens, lora, request_id,
                                                 max_model_len, is_cross_encoder)
    ranked = sorted(range(len(pairs)), key=lambda index: similarity[index], reverse=True)
    return {"id": request_id, "model": model, "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
            "results": [{"index": index, "document": {"text": body.documents[index]},
                         "relevance_score": similarity[index]} for index in ranked[:body.top_n or None]]}


async def _similarities(pipeline: RequestPipeline, pairs: list[tuple[str, str]], truncate_prompt_tokens: int | None,
                        lora: str | None, request_id: str, max_model_len: int | None,
                        is_cross_encoder: bool) -> tuple[list[float], int]:
    """(each pair's score, the tokens computed): a cross-encoder's of the pair joined, else the cosine
    similarity of their embeddings."""
    if is_cross_encoder:
        joined = [pipeline.tokenizer.encode_pair(first, second) for first, second in pairs]
        asked = EmbeddingRequest(model="", input=joined, truncate_prompt_tokens=truncate_prompt_tokens)
        replies, num_tokens = await embeddings(pipeline, asked, lora, request_id, max_model_len, classify=True)
        return [reply.probs[0] for reply in replies], num_tokens
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))
    asked = EmbeddingRequest(model="", input=texts, truncate_prompt_tokens=truncate_prompt_tokens)
    replies, num_tokens = await embeddings(pipeline, asked, lora, request_id, max_model_len)
    of = {text: reply.embedding for text, reply in zip(texts, replies)}  # unit length: dot product is cosine
    return [sum(a * b for a, b in zip(of[first], of[second])) for first, second in pairs], num_tokens


def _listed(texts: str | list[str]) -> list[str]:
    return [texts] if isinstance(texts, str) else texts


def is_cross_encoder(config: dict[str, Any]) -> bool:
    """Whether the model of `config` (config.json's, its overrides applied) is a sequence classifier of
    one label (engine/classifier_config.py)."""
    return is_sequence_classifier(config) and len(classifier_labels(config)) == 1
