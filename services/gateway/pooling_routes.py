"""The HTTP routes of the served model's embeddings (embeddings_api.py) and of the scores made
from them (score_api.py), a sequence classifier's classes (classify_api.py), and either by task
(pooling_api.py): `/v1/embeddings`, `/score` and `/v1/score`, `/rerank`, `/v1/rerank` and `/v2/rerank`,
`/classify` and `/v1/classify`, `/pooling`, as vLLM serves them (and SGLang's score API for a
generative model, sglang_score.py). A client that goes away before its
answer cancels the workers' calls for it, whose computation of what they had not begun is dropped
(as vLLM's cancellation does)."""
from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.gateway.classify_api import ClassificationRequest, classify
from services.gateway.embeddings_api import EmbeddingRequest, embed
from services.gateway.errors import APIError
from services.gateway.http_body import parsed_body
from services.gateway.http_responses import ClientDisconnected, unless_disconnected
from services.gateway.pipeline import RequestPipeline
from services.gateway.pooling_api import PoolingRequest, pool
from services.gateway.request_errors import error_reason
from services.gateway.score_api import RerankRequest, ScoreRequest, rerank, score
from services.gateway.served_models import ServedModels
from services.gateway.sglang_score import SGLangScoreRequest, asks_for_labels, sglang_score


def add_pooling_routes(app: FastAPI, pipeline: RequestPipeline, models: ServedModels,
                       check_model: Callable[[str], str | None]) -> None:
    """The routes; `check_model(model)`: the LoRA adapter a request's `model` names (None: the model
    itself), APIError (404) for a name neither is."""
    def num_data(answer: dict) -> int:
        return len(answer["data"])

    async def identified(request: Request, endpoint: str, prefix: str, work: Callable[[str], Awaitable[dict]],
                         started: float, num_inputs: Callable[[dict], int] = num_data) -> JSONResponse:
        """`work`'s answer, counted under `endpoint` and logged, whose id is the client's x-request-id
        (else a new one starting with `prefix`), given to `work` and echoed in the response's header;
        a 499 nobody reads (what access logs expect) when the client went away first, which cancels
        the work."""
        response_id = request.headers.get("x-request-id") or f"{prefix}-{uuid.uuid4().hex}"
        request_log = pipeline.request_log if pipeline.request_log.is_on else None  # as it is at arrival
        if request_log is not None:
            request_log.pooling_received(response_id, endpoint)
        try:
            answer = await unless_disconnected(request, work(response_id))
        except ClientDisconnected:
            if request_log is not None:
                request_log.pooling_finished(response_id, endpoint, "cancelled", time.perf_counter() - started)
            return JSONResponse({}, status_code=499, headers={"x-request-id": response_id})
        except Exception as e:
            if request_log is not None:
                why = (e.code or e.status) if isinstance(e, APIError) else error_reason(e)
                request_log.pooling_finished(response_id, endpoint, f"failed ({why})", time.perf_counter() - started)
            raise
        e2e_seconds = time.perf_counter() - started
        num_tokens = answer["usage"]["total_tokens"]
        pipeline.pooling.observe(endpoint, num_inputs(answer), num_tokens, e2e_seconds)
        if request_log is not None:
            request_log.pooling_finished(response_id, endpoint, "finished", e2e_seconds, num_inputs(answer),
                                         num_tokens)
        return JSONResponse(answer, headers={"x-request-id": response_id})

    async def embeddings(request: Request) -> JSONResponse:
        started = time.perf_counter()
        body = await parsed_body(request, EmbeddingRequest)
        lora = check_model(body.model)
        return await identified(request, "embeddings", "embd", lambda response_id: embed(
            pipeline, body, lora, body.model, response_id, models.max_model_len), started)

    async def scores(request: Request) -> JSONResponse:
        started = time.perf_counter()
        if asks_for_labels(await request.body()):  # SGLang's: a generative model's next-token odds
            labeled = await parsed_body(request, SGLangScoreRequest)
            lora = check_model(labeled.model) if labeled.model is not None else None
            models.check_generates()
            return await identified(request, "score", "score", lambda response_id: sglang_score(
                pipeline, labeled, lora, labeled.model or models.name, response_id), started,
                lambda answer: len(answer["scores"]))
        body = await parsed_body(request, ScoreRequest)
        lora = check_model(body.model) if body.model is not None else None
        return await identified(request, "score", "score", lambda response_id: score(
            pipeline, body, lora, body.model or models.name, response_id, models.max_model_len,
            models.is_cross_encoder), started)

    async def reranked(request: Request) -> JSONResponse:
        started = time.perf_counter()
        body = await parsed_body(request, RerankRequest)
        lora = check_model(body.model) if body.model is not None else None
        return await identified(request, "rerank", "rerank", lambda response_id: rerank(
            pipeline, body, lora, body.model or models.name, response_id, models.max_model_len,
            models.is_cross_encoder), started, lambda _: len(body.documents))

    async def classified(request: Request) -> JSONResponse:
        started = time.perf_counter()
        body = await parsed_body(request, ClassificationRequest)
        lora = check_model(body.model) if body.model is not None else None
        return await identified(request, "classify", "classify", lambda response_id: classify(
            pipeline, body, lora, body.model or models.name, response_id, models.max_model_len), started)

    async def pooled(request: Request) -> JSONResponse:
        started = time.perf_counter()
        body = await parsed_body(request, PoolingRequest)
        lora = check_model(body.model)
        return await identified(request, "pooling", "pool", lambda response_id: pool(
            pipeline, body, lora, body.model, response_id, models.max_model_len, models.has_classifier), started)

    app.add_route("/v1/embeddings", embeddings, methods=["POST"])
    app.add_route("/pooling", pooled, methods=["POST"])
    for path in ("/classify", "/v1/classify"):
        app.add_route(path, classified, methods=["POST"])
    for path in ("/score", "/v1/score"):
        app.add_route(path, scores, methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_route(path, reranked, methods=["POST"])
