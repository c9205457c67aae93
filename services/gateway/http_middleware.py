"""The HTTP API's ASGI middleware: each request's arrival stamped for its ledger, and bodies over
the limit refused with 413 before the app reads them."""
from __future__ import annotations

import json
import time
from collections.abc import Callable

from services.gateway.anthropic_errors import in_its_apis_shape
from services.gateway.errors import APIError

ARRIVAL_KEY = "baton_arrival"


class ArrivalTime:
    """Stamps each HTTP request's arrival (`time.perf_counter()`) in its ASGI scope's state,
    where the request's ledger starts."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope.setdefault("state", {})[ARRIVAL_KEY] = time.perf_counter()
        await self.app(scope, receive, send)


class BodySizeLimit:
    """Refuses a request body over `max_bytes` with 413 before the app sees it: by its
    Content-Length when it gives one, else by counting while it is read in full here
    (request bodies are small JSON, which the app would read whole anyway). `on_refuse`
    is called for each refusal."""

    def __init__(self, app, max_bytes: int, on_refuse: Callable[[], None] = lambda: None):
        self.app = app
        self.max_bytes = max_bytes
        self.on_refuse = on_refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, send)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await self._refuse(scope, send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body, only the disconnect can come

        await self.app(scope, replay, send)

    async def _refuse(self, scope, send) -> None:
        self.on_refuse()
        too_large = APIError(413, f"The request body is larger than this server accepts ({self.max_bytes} bytes: "
                                  f"the gateway's --max-body-bytes).", code="request_too_large")
        error = in_its_apis_shape(scope, too_large)  # (the Messages API's in Anthropic's shape)
        payload = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})
