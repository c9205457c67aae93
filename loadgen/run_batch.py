"""`baton run-batch`: a file of requests in OpenAI's batch format run against a server, the results
written in OpenAI's batch output format, as `vllm run-batch` runs one: against a running server
(`baton up` starts one, and any OpenAI-compatible server will do), or, given `--model DIR` as vLLM's
takes it, on a mesh of its own (one prefill and one decode worker, no Redis) started for the batch
and stopped after it, whose banner and logs go to stderr.

Each input line is `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}`;
each output line, in the input's order, `{"id": "batch_req_...", "custom_id": ..., "response":
{"status_code": ..., "request_id": ..., "body": {...}}, "error": null}`: the server's answer, a
refusal included (its status and error body). A line that cannot be sent (not JSON, no custom_id, a
custom_id used before, a method or url not served, a streamed body) and a request the server never
answered get `"response": null` and an `error` saying why. The requests run concurrently, at most
`--max-concurrency` at once, each as it is (its model named in its body). The exit status is 0 when
every line got a response (whatever its status), 1 when some did not, 2 for a file that cannot be read.

Imports only the standard library at load time (httpx once it runs), so `baton --help` stays fast.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"
# vLLM's run-batch endpoints, and the rest of Baton's that answer one JSON body.
SERVED_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/score",
               "/score", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/classify", "/classify")
DESCRIPTION = ("Run a JSONL file of requests in OpenAI's batch format (custom_id, method, url, body) against a "
               "running OpenAI-compatible server (or, with --model, a mesh of its own), and write each one's result "
               "in OpenAI's batch output format, in the input's order.")


def add_run_batch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input-file", required=True, help="the requests, one JSON object a line (- : stdin)")
    parser.add_argument("-o", "--output-file", required=True, help="where the results go (- : stdout)")
    server = parser.add_mutually_exclusive_group()
    server.add_argument("--url", default=DEFAULT_URL, help=f"the server, before its /v1 (default {DEFAULT_URL})")
    server.add_argument("--model", metavar="DIR", help="run the batch on a mesh of its own serving this model "
                        "directory, started for it and stopped after it (as vllm run-batch --model)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as a bearer token (default $OPENAI_API_KEY; none when unset)")
    parser.add_argument("--max-concurrency", type=int, default=32, help="requests in flight at once (default 32)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per request (default 600)")


def run_batch_command(args: argparse.Namespace) -> int:
    if args.max_concurrency < 1:
        print("baton run-batch: --max-concurrency must be at least 1", file=sys.stderr)
        return 2
    try:
        lines = _read(args.input_file)
    except OSError as e:
        print(f"baton run-batch: {e}", file=sys.stderr)
        return 2
    if args.model is not None:
        model_dir = Path(args.model).expanduser().resolve()
        if not model_dir.is_dir():
            print(f"baton run-batch: model directory not found: {model_dir}", file=sys.stderr)
            return 2
        results = asyncio.run(_on_own_mesh(model_dir, lines, args))
        if results is None:
            print("baton run-batch: the mesh for the batch did not come up (its log above says why)", file=sys.stderr)
            return 1
    else:
        results = asyncio.run(run_batch(lines, args.url, args.api_key, args.max_concurrency, args.timeout))
    text = "".join(json.dumps(result, ensure_ascii=False) + "\n" for result in results)
    if args.output_file == "-":
        sys.stdout.write(text)
    else:
        Path(args.output_file).write_text(text, encoding="utf-8")
    answered = sum(result["response"] is not None for result in results)
    succeeded = sum(result["response"] is not None and result["response"]["status_code"] < 400 for result in results)
    print(f"baton run-batch: {len(results)} requests: {succeeded} succeeded, {answered - succeeded} refused by the "
          f"server, {len(results) - answered} not answered", file=sys.stderr)
    return 0 if answered == len(results) else 1


async def _on_own_mesh(model_dir: Path, lines: list[str], args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """The results of the batch run on a mesh started for it (None: the mesh did not come up, as
    its log on stderr says); the mesh is stopped after it either way."""
    from services.launcher.mesh import Mesh
    from services.launcher.specs import MeshConfig

    mesh = Mesh(MeshConfig(model_dir=model_dir, http_port=0, with_redis=False), banner_to=sys.stderr)
    running = asyncio.ensure_future(mesh.run())
    up = asyncio.ensure_future(mesh.up.wait())
    try:
        await asyncio.wait([running, up], return_when=asyncio.FIRST_COMPLETED)
        if not mesh.is_up:
            return None
        return await run_batch(lines, mesh.api_url, None, args.max_concurrency, args.timeout)
    finally:
        up.cancel()
        mesh.stop()
        await running


def _read(path: str) -> list[str]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def parsed_lines(lines: list[str]) -> list[dict[str, Any]]:
    """Each line's request, or {"custom_id", "error"} saying why it cannot be sent."""
    requests, seen = [], set()
    for number, line in enumerate(lines, 1):
        request = _parsed(number, line, seen)
        requests.append(request)
        if "error" not in request:
            seen.add(request["custom_id"])
    return requests


async def run_batch(lines: list[str], url: str, api_key: str | None, max_concurrency: int,
                    timeout_s: float, transport=None, on_result=None) -> list[dict[str, Any]]:
    """Each line's result, in order. `transport`: httpx's way to the server (None: the network; the
    gateway's Batch API hands it the app itself); `on_result(index, result)`: told of each as it comes."""
    import httpx

    requests = parsed_lines(lines)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(max_concurrency)
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s, limits=limits,
                                 transport=transport) as client:
        async def one(index: int, request: dict[str, Any]) -> dict[str, Any]:
            result = await answer(request)
            if on_result is not None:
                on_result(index, result)
            return result

        async def answer(request: dict[str, Any]) -> dict[str, Any]:
            if "error" in request:
                return _result(request.get("custom_id"), error=request["error"])
            async with limit:
                try:
                    response = await client.post(request["url"], json=request["body"])
                except httpx.HTTPError as e:
                    return _result(request["custom_id"], error={"code": "request_failed",
                                                                "message": f"{type(e).__name__}: {e}"})
            try:
                body = response.json()
            except ValueError:
                body = {"text": response.text}
            return _result(request["custom_id"], {"status_code": response.status_code,
                                                  "request_id": response.headers.get("x-request-id"), "body": body})

        return list(await asyncio.gather(*(one(i, request) for i, request in enumerate(requests))))


def _parsed(number: int, line: str, seen: set[str]) -> dict[str, Any]:
    """The request on input line `number`, or {"custom_id", "error"} saying why it cannot be sent."""
    try:
        request = json.loads(line)
    except json.JSONDecodeError as e:
        return {"error": _invalid(number, f"not JSON: {e}")}
    if not isinstance(request, dict):
        return {"error": _invalid(number, "not a JSON object")}
    custom_id = request.get("custom_id")
    why = None
    if not isinstance(custom_id, str) or not custom_id:
        why, custom_id = "custom_id must be a non-empty string", None
    elif custom_id in seen:
        why = f"custom_id {custom_id!r} is used by an earlier line"
    elif request.get("method") != "POST":
        why = f"method must be POST, got {request.get('method')!r}"
    elif request.get("url") not in SERVED_URLS:
        why = f"url {request.get('url')!r} is not one a batch runs (one of {', '.join(SERVED_URLS)})"
    elif not isinstance(request.get("body"), dict):
        why = "body must be a JSON object"
    elif request["body"].get("stream"):
        why = "a batch's requests are not streamed (stream must be false)"
    if why is not None:
        return {"custom_id": custom_id, "error": _invalid(number, why)}
    return request


def _invalid(number: int, why: str) -> dict[str, str]:
    return {"code": "invalid_request", "message": f"line {number}: {why}"}


def _result(custom_id: str | None, response: dict[str, Any] | None = None,
            error: dict[str, str] | None = None) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}
