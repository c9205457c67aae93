"""Vertex AI's routes, as SGLang serves them for a custom container there: Vertex sends predictions
to `$AIP_PREDICT_ROUTE` (SGLang's default `/vertex_generate`) as `{"instances": [...], "parameters":
{...}}`, each instance a prompt (`text`, or `input_ids`), and health checks to `$AIP_HEALTH_ROUTE`
(the gateway's /health). The prompts go to SGLang's /generate as one batch, the parameters beside
them, and its answers come back as `{"predictions": [...]}`, in the instances' order."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.gateway.errors import APIError
from services.gateway.route_endpoints import route_endpoint

PREDICT_ROUTE_VARIABLE = "AIP_PREDICT_ROUTE"
HEALTH_ROUTE_VARIABLE = "AIP_HEALTH_ROUTE"
DEFAULT_PREDICT_ROUTE = "/vertex_generate"  # SGLang's
PROMPT_FIELDS = ("text", "input_ids")  # an instance's prompt, as /generate names it


def add_vertex_routes(app: FastAPI, env: Mapping[str, str] | None = None) -> None:
    env = os.environ if env is None else env

    async def predict(request: Request):
        generate_body = _generate_body(await _json_body(request))
        if generate_body is None:
            return JSONResponse({"predictions": []})
        answer = await route_endpoint(app, "/generate", "POST")(_with_body(request, generate_body))
        if answer.status_code != 200:
            return answer
        predictions = json.loads(answer.body)
        return JSONResponse({"predictions": predictions if isinstance(predictions, list) else [predictions]})

    async def health(request: Request):
        return await route_endpoint(app, "/health", "GET")()

    app.add_route(env.get(PREDICT_ROUTE_VARIABLE) or DEFAULT_PREDICT_ROUTE, predict, methods=["POST"])
    if env.get(HEALTH_ROUTE_VARIABLE):
        app.add_route(env[HEALTH_ROUTE_VARIABLE], health, methods=["GET"])


async def _json_body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object with instances (and parameters)", param="body")
    return body


def _generate_body(body: dict) -> dict | None:
    """/generate's body for a prediction request; None for one of no instances."""
    instances, parameters = body.get("instances"), body.get("parameters") or {}
    if not isinstance(instances, list):
        raise APIError(400, "instances must be a list of prompts, each {\"text\": ...} or {\"input_ids\": [...]}",
                       param="instances")
    if not instances:
        return None
    if not isinstance(parameters, dict):
        raise APIError(400, "parameters must be a JSON object (/generate's fields)", param="parameters")
    if not all(isinstance(instance, dict) for instance in instances):
        raise APIError(400, "each instance must be an object: {\"text\": ...} or {\"input_ids\": [...]}",
                       param="instances")
    field = next((f for f in PROMPT_FIELDS if instances[0].get(f) is not None), None)
    if field is None or any(instance.get(field) is None for instance in instances):
        raise APIError(400, "every instance must give its prompt the same way: text, or input_ids",
                       param="instances")
    if parameters.get("stream"):
        raise APIError(400, "a prediction is answered whole: stream is not taken here", param="parameters.stream")
    taken = {f for f in parameters if f in PROMPT_FIELDS}
    if taken:
        raise APIError(400, f"the prompts are the instances': {', '.join(sorted(taken))} is not a parameter",
                       param="parameters")
    return {**parameters, field: [instance[field] for instance in instances]}


def _with_body(request: Request, body: dict) -> Request:
    """`request` carrying `body` instead of its own (its headers, client and disconnect as they are)."""
    data = json.dumps(body).encode()
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        return await request.receive()

    return Request(request.scope, receive)
