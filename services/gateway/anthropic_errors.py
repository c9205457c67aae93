"""Errors in the shape of the API a request called: Anthropic's error object for its Messages API
(`{"type": "error", "error": {"type", "message"}}`, whose SDK reads it so), OpenAI's for the rest;
for the app's handlers and for the middleware that refuses a request before it reaches them
(a missing API key, a body over the limit)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.routing import get_route_path

from services.gateway.errors import APIError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})


class AnthropicError(APIError):
    """An APIError whose body is Anthropic's error object."""

    @classmethod
    def of(cls, error: APIError) -> AnthropicError:
        return error if isinstance(error, AnthropicError) else cls(error.status, error.message, param=error.param,
                                                                   code=error.code)

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": error_object(self)}


def in_its_apis_shape(scope: Mapping[str, Any], error: APIError) -> APIError:
    """`error` as the API the request (its ASGI `scope`) called answers errors: Anthropic's for its
    Messages API, else OpenAI's (as it is)."""
    return AnthropicError.of(error) if get_route_path(scope) in ANTHROPIC_PATHS else error


def error_object(error: APIError) -> dict[str, str]:
    default = "invalid_request_error" if error.status < 500 else "api_error"
    return {"type": ERROR_TYPES.get(error.status, default), "message": error.message}
