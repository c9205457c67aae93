"""Every failure the gateway reports, as one `APIError` with an HTTP status and OpenAI's
error object; the public gRPC API sends the same object (common.proto `Error`)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from services.gateway.request_errors import ContextLengthError, InvalidRequestError, OverloadedError
from services.gateway.workers import NoHealthyWorkerError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # OpenAI's, with code invalid_api_key
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        return ERROR_TYPES.get(self.status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


RETRY_AFTER_S = 1  # told to a client refused for load; the openai client waits that long, then retries


def api_error_response(e: APIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """`e` as the HTTP API answers it: its status, OpenAI's error object as the body, and when the
    server is too busy for it (429, 503) the `Retry-After` clients honour."""
    if e.status in (429, 503):
        headers = {"retry-after": str(RETRY_AFTER_S), **(headers or {})}
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def model_not_found(model: str, served: Sequence[str]) -> APIError:
    names = " or ".join(f"`{name}`" for name in served)
    return APIError(404, f"The model `{model}` does not exist. This server serves {names}.", param="model",
                    code="model_not_found")


def to_api_error(e: Exception, prompt_param: str) -> APIError:
    """The APIError for an exception from the request pipeline; `prompt_param` names the
    request field a too-long or invalid prompt came in ("prompt" or "messages")."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ContextLengthError):
        return APIError(400, str(e), param=prompt_param, code="context_length_exceeded")
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(e), param=e.param or prompt_param)
    if isinstance(e, OverloadedError):
        return APIError(429, f"The server is at capacity, retry later ({e})", code="overloaded")
    if isinstance(e, NoHealthyWorkerError):
        return APIError(503, str(e), code="unavailable")
    if isinstance(e, grpc.aio.AioRpcError):
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return APIError(503, f"a worker is unavailable: {e.code().name}: {e.details()}", code="unavailable")
        return APIError(500, f"a worker failed: {e.code().name}: {e.details()}", code="internal_error")
    return APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")


class FieldError(ValueError):
    """A refusal a request's model-level check makes, naming the field it is about: pydantic reports
    such checks at the body's root, and OpenAI's error shape wants the field as `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def validation_error(e: RequestValidationError | ValidationError) -> APIError:
    """One 400 naming the first bad field, in OpenAI's words where it has them: of a body as the route
    read it, or as another API's request made into one of the routes' (chat_request.py)."""
    errors = e.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = _most_telling(errors)
    location = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_union_member(part)]
    cause = (first.get("ctx") or {}).get("error")
    if not location and isinstance(cause, FieldError):
        location = [cause.param]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        return APIError(400, f"We could not parse the JSON body of your request: {first.get('msg')}")
    if first.get("type") == "missing" and not location:
        return APIError(400, "the request needs a JSON body")
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return APIError(400, message, param=param)


def _is_union_member(part: Any) -> bool:
    """Whether a part of an error's location is pydantic's name for the member of a union it tried
    (`list[constrained-int]`, `str`), not a field: the client never wrote it."""
    return isinstance(part, str) and ("[" in part or part.startswith(("constrained-", "function-"))
                                      or part in ("str", "int", "float", "bool"))


def _most_telling(errors: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The error to report: where every member of a union failed, one of the member with the fewest
    errors, and of those the one that got deepest (the shape the client meant: `[[5], []]` is a list of
    lists with an empty one, not a list of ints gone wrong); else the first."""
    def member(error: Mapping[str, Any]) -> tuple | None:
        location = tuple(error.get("loc", ()))
        at = next((i for i, part in enumerate(location) if _is_union_member(part)), None)
        return None if at is None else location[:at + 1]
    counts = Counter(map(member, errors))
    return min(errors, key=lambda error: (0, 0) if member(error) is None
               else (counts[member(error)], -len(error.get("loc", ()))))
