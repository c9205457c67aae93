"""SageMaker's two routes, as vLLM serves them for a model deployed there: `GET`/`POST /ping`, the
health check (the gateway's /health), and `POST /invocations`, one route for every API, each
request sent where its body's fields say it belongs: `messages` to chat, `prompt` to completions,
`query` with `documents` to rerank, `text_1` with `text_2` to score, `input` to embeddings."""
from __future__ import annotations

import json

from fastapi import FastAPI, Request

from services.gateway.errors import APIError
from services.gateway.route_endpoints import route_endpoint

# A body's telling field(s) → the API's route, tried in this order.
INVOCATIONS = ((("messages",), "/v1/chat/completions"), (("prompt",), "/v1/completions"),
               (("query", "documents"), "/v1/rerank"), (("text_1", "text_2"), "/v1/score"),
               (("input",), "/v1/embeddings"))


def add_sagemaker_routes(app: FastAPI) -> None:
    async def ping(request: Request):
        return await route_endpoint(app, "/health", "GET")()

    async def invocations(request: Request):
        try:
            body = json.loads(await request.body())  # the API's endpoint reads it again, from the request's copy
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object", param="body")
        path = next((path for fields, path in INVOCATIONS if all(f in body for f in fields)), None)
        if path is None:
            raise APIError(400, "the body is none of the APIs' requests: it needs messages (chat), prompt "
                                "(completions), query and documents (rerank), text_1 and text_2 (score) or input "
                                "(embeddings)", param="body")
        return await route_endpoint(app, path, "POST")(request)

    app.add_route("/ping", ping, methods=["GET", "POST"])
    app.add_route("/invocations", invocations, methods=["POST"])
