"""The OpenAI Responses API's stored responses: `GET` and `DELETE /v1/responses/{id}`, its
`/input_items`, and `POST /v1/responses/{id}/cancel` for a background one (the POST that makes a
response is generation_routes.py's)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.gateway.background_responses import ENDED, BackgroundResponses
from services.gateway.errors import APIError
from services.gateway.response_store import MemoryResponseStore, RedisResponseStore, StoredResponse, not_found

CANCEL_WAIT_S = 5.0  # how long a cancel waits for the gateway generating the response to stop it


def add_stored_response_routes(app: FastAPI, store: MemoryResponseStore | RedisResponseStore | None,
                               background: BackgroundResponses
                               ) -> Callable[[str, str | None], Awaitable[StoredResponse]]:
    """`store`: None where the gateway stores no responses. Returns what reads a stored response (a
    404 naming `param` where there is none)."""
    async def stored_response(response_id: str, param: str | None = None) -> StoredResponse:
        found = await store.get(response_id) if store is not None else None
        if found is None:
            raise not_found(response_id, param)
        return found

    async def get_response(request: Request):
        return JSONResponse((await stored_response(request.path_params["response_id"])).response)

    async def delete_response(request: Request):
        response_id = request.path_params["response_id"]
        if store is None or not await store.delete(response_id):
            raise not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def cancel_response(request: Request):
        """Stop a background response: where this gateway generates it, at once; where another
        sharing Redis does, by asking it (and waiting for it to say so). One already ended is
        answered as it is."""
        response_id = request.path_params["response_id"]
        if background.is_running(response_id):
            await background.cancel(response_id)
        response = (await stored_response(response_id)).response
        if not response["background"]:
            raise APIError(400, "only a background response can be cancelled")
        if response["status"] not in ENDED:
            await store.ask_to_cancel(response_id)
            deadline = time.monotonic() + CANCEL_WAIT_S
            while (response := (await stored_response(response_id)).response)["status"] not in ENDED:
                if time.monotonic() > deadline:
                    raise APIError(409, f"no gateway generating response {response_id!r} answered the cancel "
                                        f"within {CANCEL_WAIT_S:g} s", code="conflict")
                await asyncio.sleep(0.05)
        return JSONResponse(response)

    async def response_input_items(request: Request):
        """The input items a stored response answered (the earlier turns' too), newest first unless
        `order=asc`, `limit` (1-100, 20) of them after the item `after`, as OpenAI lists them."""
        found = await stored_response(request.path_params["response_id"])
        query = request.query_params
        items = found.conversation if query.get("order") == "asc" else found.conversation[::-1]
        try:
            limit = int(query.get("limit", 20))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise APIError(400, "limit must be an integer from 1 to 100", param="limit")
        if (after := query.get("after")) is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise APIError(400, f"after: no input item {after!r} in this response", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0].get("id") if page else None,
                             "last_id": page[-1].get("id") if page else None, "has_more": len(items) > limit})

    app.add_route("/v1/responses/{response_id}", get_response, methods=["GET"])
    app.add_route("/v1/responses/{response_id}", delete_response, methods=["DELETE"])
    app.add_route("/v1/responses/{response_id}/input_items", response_input_items, methods=["GET"])
    app.add_route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"])
    return stored_response
