"""vLLM's cancel API: a client or an operator ends requests it knows the ids of, wherever they are in
the mesh (running_requests.py: on the decode worker their tokens stream from, or while a prefill
worker computes their first token). Each ends as an abort ends it: finish_reason "abort", the text
so far, its pages freed. A request's id is its response's (`x-request-id`, or the `id` the reply
gave); it names every choice of that response.

- `POST /v1/requests/{request_id}/cancel`, `DELETE /v1/requests/{request_id}`: one request,
  `{"status": "cancelled", "request_id"}`, or a 404 when none by that id is running;
- `POST /v1/requests/cancel` (`{"request_ids": [...]}`): those of them that are running,
  `{"status": "cancelled", "cancelled_request_ids"}`;
- `POST /abort_requests`: the same, and with no ids (or no body) every request in flight (not those
  held at a generation pause: they go on after it, as with SGLang's abort_all).
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from services.gateway.errors import APIError
from services.gateway.http_body import optional_body, parsed_body
from services.gateway.running_requests import RunningRequests


class CancelRequest(BaseModel):
    request_ids: list[str] = []


def add_cancel_routes(app: FastAPI, running: RunningRequests) -> None:
    def cancelled(request_ids: list[str]) -> JSONResponse:
        return JSONResponse({"status": "cancelled", "cancelled_request_ids": request_ids})

    def cancel_each(request_ids: list[str]) -> list[str]:
        """Those of `request_ids` that named a running request, each aborted."""
        return [request_id for request_id in request_ids if running.abort(request_id)]

    async def cancel_one(request: Request):
        request_id = request.path_params["request_id"]
        if not running.abort(request_id):
            raise APIError(404, f"Request {request_id} not found or already completed.", param="request_id",
                           code="request_not_found")
        return JSONResponse({"status": "cancelled", "request_id": request_id})

    async def cancel_many(request: Request):
        return cancelled(cancel_each((await parsed_body(request, CancelRequest)).request_ids))

    async def abort_requests(request: Request):
        request_ids = (await optional_body(request, CancelRequest)).request_ids
        return cancelled(cancel_each(request_ids) if request_ids else running.abort_all())

    # Before /v1/requests/{request_id}/... routes could take "cancel" for an id.
    app.add_route("/v1/requests/cancel", cancel_many, methods=["POST"])
    app.add_route("/v1/requests/{request_id}/cancel", cancel_one, methods=["POST"])
    app.add_route("/v1/requests/{request_id}", cancel_one, methods=["DELETE"])
    app.add_route("/abort_requests", abort_requests, methods=["POST"])
