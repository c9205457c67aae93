"""API keys (`--api-key`, as vLLM's): who may use the gateway's APIs.

With keys configured, every HTTP request must carry one as `Authorization: Bearer KEY` (or as
`x-api-key: KEY`, as Anthropic's clients send it), and every call of the public gRPC `Generate` as
`authorization` metadata of the Bearer form. A request without a key, or with another, gets HTTP 401
with OpenAI's error object (code `invalid_api_key`) and `WWW-Authenticate: Bearer`, or gRPC
UNAUTHENTICATED, before its body is read. What probes and scrapers call stays open (`/health`,
`/live`, `/metrics`, `/ping`, gRPC health and reflection): a load balancer or Prometheus carries no
key. (vLLM asks only under `/v1`, which leaves its `/tokenize` open; here nothing but those is.)
The workers behind the gateway take none: they listen on the mesh's private network.

Several keys may be valid at once, so that one can be rotated without downtime. Each is
compared in constant time (hmac.compare_digest), so response times do not tell how much of
a guess was right.
"""
from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Sequence

from starlette.routing import get_route_path

from services.gateway.anthropic_errors import in_its_apis_shape
from services.gateway.errors import APIError

OPEN_HTTP_PATHS = frozenset({"/health", "/live", "/metrics", "/ping"})  # /ping: SageMaker's health check
BEARER = b"bearer "  # the scheme is case-insensitive (RFC 9110 section 11.1)


class ApiKeys:
    def __init__(self, keys: Sequence[str]):
        if not keys:
            raise ValueError("ApiKeys needs at least one key")
        self._keys = [key.encode() for key in keys]

    def any_key(self) -> str:
        """One of the keys, for a request the gateway sends itself (a batch's)."""
        return self._keys[0].decode()

    def admits(self, authorization: str | bytes | None) -> bool:
        """Whether an `Authorization` header value carries one of the keys."""
        if authorization is None:
            return False
        if isinstance(authorization, str):
            authorization = authorization.encode()
        if authorization[:len(BEARER)].lower() != BEARER:
            return False
        return self.admits_key(authorization[len(BEARER):].strip())

    def admits_key(self, given: str | bytes | None) -> bool:
        """Whether `given` (an `x-api-key` header's value) is one of the keys."""
        if not given:
            return False
        if isinstance(given, str):
            given = given.encode()
        matched = False
        for key in self._keys:  # every key, matched or not: the time taken does not tell which one
            matched |= hmac.compare_digest(given, key)
        return matched


def refusal(authorization: str | bytes | None) -> APIError:
    """The 401 for a request whose `Authorization` header, or else `x-api-key` (None: neither), `ApiKeys`
    refused."""
    if authorization is None:
        return APIError(401, "No API key was provided: send it as the header `Authorization: Bearer KEY`.",
                        code="invalid_api_key")
    return APIError(401, "Incorrect API key provided.", code="invalid_api_key")


class RequireApiKey:
    """ASGI middleware: refuses an HTTP request that `keys` does not admit (but to OPEN_HTTP_PATHS), with
    401 before its body is read (and closes the connection, whose unread body would otherwise
    be taken for the next request). `on_refuse` is called for each refusal."""

    def __init__(self, app, keys: ApiKeys, on_refuse: Callable[[], None] = lambda: None):
        self.app = app
        self.keys = keys
        self.on_refuse = on_refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or get_route_path(scope) in OPEN_HTTP_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        authorization, api_key = headers.get(b"authorization"), headers.get(b"x-api-key")
        if self.keys.admits(authorization) or self.keys.admits_key(api_key):
            return await self.app(scope, receive, send)
        self.on_refuse()
        error = in_its_apis_shape(scope, refusal(authorization if authorization is not None else api_key))
        payload = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode()),
                                (b"www-authenticate", b"Bearer"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})
