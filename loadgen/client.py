"""One streamed request to an OpenAI-compatible server, timed token by token.

A chunk that carries a choice counts as the arrival of output: the first is the TTFT,
the gaps between the rest are the ITLs (a chunk holding several tokens is one gap, as in
vLLM's benchmark). Chat's role-only opening chunk carries no output and is skipped. The
output token count is the server's `usage.completion_tokens` (asked for with
`stream_options.include_usage`), else the number of chunks.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from loadgen.workload import RequestSpec

Endpoint = Literal["completions", "chat"]
ENDPOINT_PATHS = {"completions": "/completions", "chat": "/chat/completions"}


@dataclass
class RequestResult:
    """Times are seconds; `sent_at` counts from the start of the run. `error` is None on
    success, else its kind (`HTTP 429`, `ConnectError`, ...), and `error_message` says more."""

    index: int
    sent_at: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None
    error_message: str = ""

    @property
    def is_ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for fewer than two tokens."""
        if not self.is_ok or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class RequestOptions:
    """What every request of a run shares."""

    base_url: str
    model: str
    endpoint: Endpoint = "completions"
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout_s: float = 600.0  # the whole request, from sending to the last byte
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINT_PATHS[self.endpoint]

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                                "temperature": self.temperature}
        if self.endpoint == "completions":
            body.update(prompt=spec.prompt, max_tokens=spec.output_len)
        else:
            body.update(messages=[{"role": "user", "content": spec.prompt}], max_completion_tokens=spec.output_len)
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM's and SGLang's extra: the output is exactly max_tokens long
        body.update(self.extra_body)
        return body


class _StreamError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


async def send_request(client: httpx.AsyncClient, options: RequestOptions, spec: RequestSpec,
                       run_start: float) -> RequestResult:
    """Never raises for a failed request: the failure is in the result."""
    result = RequestResult(index=spec.index)
    start = time.perf_counter()
    result.sent_at = start - run_start
    last = start
    num_chunks = 0
    try:
        async with (asyncio.timeout(options.timeout_s),
                    client.stream("POST", options.url, json=options.body(spec)) as response):
            if response.status_code != 200:
                await response.aread()
                raise _StreamError(f"HTTP {response.status_code}", _error_message(response.text))
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, `event:` lines
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise _StreamError("StreamError", _error_message(payload))
                if _carries_output(chunk, options.endpoint):
                    if num_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    num_chunks += 1
                if usage := chunk.get("usage"):
                    result.prompt_tokens = usage.get("prompt_tokens")
                    result.output_tokens = usage.get("completion_tokens") or 0
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        result.e2e = time.perf_counter() - start
        if num_chunks == 0:
            raise _StreamError("EmptyResponse", "the stream ended without any output")
        if not result.output_tokens:
            result.output_tokens = num_chunks
    except _StreamError as exc:
        result.error, result.error_message = exc.kind, str(exc)
    # TimeoutError (from asyncio.timeout) is an OSError; ValueError: a chunk that is not JSON.
    except (httpx.HTTPError, OSError, ValueError) as exc:
        result.error, result.error_message = type(exc).__name__, str(exc) or repr(exc)
    return result


def _carries_output(chunk: dict[str, Any], endpoint: Endpoint) -> bool:
    choices = chunk.get("choices")
    if not choices:
        return False
    if endpoint == "chat":
        delta = choices[0].get("delta") or {}
        # vLLM opens a chat stream with {"role": "assistant", "content": ""} before any token.
        return bool(delta.get("content")) or not delta.get("role")
    return True


def _error_message(body: str) -> str:
    """The OpenAI error object's message, else the body itself (shortened)."""
    try:
        error = json.loads(body)["error"]
        return str(error.get("message", error) if isinstance(error, dict) else error)
    except (ValueError, KeyError, TypeError):
        return body[:300]
