"""OpenAI's Batch API (`POST /v1/batches`, `GET /v1/batches`, `GET /v1/batches/{id}`,
`POST /v1/batches/{id}/cancel`), as SGLang's server serves it: a file of requests uploaded with the
Files API (batch_files.py) run in the background, through this gateway's own routes (in process: no
network hop, the same checks and limits as a client's request), at most `max_concurrency` at once,
as `baton run-batch` runs one (loadgen/run_batch.py). The answers with status 200 go to the batch's
output file, the others to its error file, in the input's order; `request_counts` follows them.

A batch is checked first ("validating"): every line a POST to the batch's `endpoint` with a unique
custom_id and a body not streamed, or the batch "failed" with an error per line, and nothing runs.
Then "in_progress", "finalizing" while its files are written, "completed". A cancel makes it
"cancelling", ends the requests still running and writes what had finished, then "cancelled". Its
`completion_window` must be "24h", the only one OpenAI takes; a batch runs at once, so it never
expires. Batches, like files, last as long as the gateway runs; one still running when it stops is
cancelled."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, File, Form, Query, Request, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from loadgen.run_batch import SERVED_URLS, parsed_lines, run_batch
from services.gateway.batch_files import PURPOSES, ExpiresAfter, FileStore, expiry_seconds, page
from services.gateway.errors import APIError
from services.gateway.http_body import parsed_body

COMPLETION_WINDOW = "24h"
OPEN = ("validating", "in_progress")  # what a cancel may still stop


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None  # its output and error files', from their creation


class BatchJobs:
    """The gateway's batches and their files. `max_concurrency`: requests of one batch in flight at once."""

    def __init__(self, max_concurrency: int = 32, timeout_s: float = 600.0) -> None:
        self.files = FileStore()
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.transport = None  # httpx's way into the gateway's app, set with the routes
        self.api_key: str | None = None  # one the app admits, when it asks for one
        self._batches: dict[str, dict[str, Any]] = {}
        self._running: dict[str, asyncio.Task] = {}

    def create(self, asked: CreateBatch) -> dict[str, Any]:
        source = self.files.get(asked.input_file_id)
        if source["purpose"] != "batch":
            raise APIError(400, f"file {asked.input_file_id} has purpose {source['purpose']!r}, not 'batch'",
                           param="input_file_id")
        if asked.endpoint not in SERVED_URLS:
            raise APIError(400, f"endpoint must be one of {', '.join(SERVED_URLS)}, got {asked.endpoint!r}",
                           param="endpoint")
        output_expiry_s = expiry_seconds(asked.output_expires_after, "output_expires_after")
        if asked.completion_window != COMPLETION_WINDOW:
            raise APIError(400, f"completion_window must be {COMPLETION_WINDOW!r}, got {asked.completion_window!r}",
                           param="completion_window")
        try:
            lines = [line for line in self.files.content(source["id"]).decode().splitlines() if line.strip()]
        except UnicodeDecodeError as e:
            raise APIError(400, f"file {source['id']} is not UTF-8 text: {e}", param="input_file_id") from None
        now = int(time.time())
        batch = {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": asked.endpoint, "errors": None,
                 "input_file_id": source["id"], "completion_window": COMPLETION_WINDOW, "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                 "expires_at": now + 24 * 3600, "finalizing_at": None, "completed_at": None, "failed_at": None,
                 "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": len(lines), "completed": 0, "failed": 0}, "metadata": asked.metadata}
        self._batches[batch["id"]] = batch
        errors = _line_errors(lines, asked.endpoint)
        if errors:
            batch.update(status="failed", failed_at=now, errors={"object": "list", "data": errors})
            return batch
        batch.update(status="in_progress", in_progress_at=now)
        task = asyncio.ensure_future(self._run(batch, lines, output_expiry_s))
        self._running[batch["id"]] = task
        task.add_done_callback(lambda _: self._running.pop(batch["id"], None))
        return batch

    def get(self, batch_id: str) -> dict[str, Any]:
        found = self._batches.get(batch_id)
        if found is None:
            raise APIError(404, f"No batch with id {batch_id!r}", code="not_found", param="batch_id")
        return found

    def listed(self, limit: int, after: str | None) -> dict[str, Any]:
        return page(list(self._batches.values()), limit, after)

    def cancel(self, batch_id: str) -> dict[str, Any]:
        batch = self.get(batch_id)
        if batch["status"] not in OPEN:
            raise APIError(400, f"batch {batch_id} is {batch['status']}: only one validating or in progress can "
                                f"be cancelled", param="batch_id")
        batch.update(status="cancelling", cancelling_at=int(time.time()))
        task = self._running.get(batch_id)
        if task is not None:
            task.cancel()
        return batch

    async def close(self) -> None:
        """Cancel the batches still running, then delete every file."""
        for batch_id in list(self._running):
            self.cancel(batch_id)
        await asyncio.gather(*self._running.values(), return_exceptions=True)
        self.files.close()

    async def _run(self, batch: dict[str, Any], lines: list[str], output_expiry_s: int | None) -> None:
        results: dict[int, dict[str, Any]] = {}
        counts = batch["request_counts"]

        def finished(index: int, result: dict[str, Any]) -> None:
            results[index] = result
            counts["completed" if _succeeded(result) else "failed"] += 1

        try:
            await run_batch(lines, "http://gateway", self.api_key, self.max_concurrency, self.timeout_s,
                            transport=self.transport, on_result=finished)
        except asyncio.CancelledError:  # cancelled: what finished is written all the same
            pass
        is_cancelled = batch["status"] == "cancelling"
        batch.update(status=batch["status"] if is_cancelled else "finalizing", finalizing_at=int(time.time()))
        done = [results[i] for i in sorted(results)]
        answered = [r for r in done if _succeeded(r)]
        refused = [r for r in done if not _succeeded(r)]
        if answered:
            batch["output_file_id"] = self._write(f"{batch['id']}_output.jsonl", answered, output_expiry_s)
        if refused:
            batch["error_file_id"] = self._write(f"{batch['id']}_error.jsonl", refused, output_expiry_s)
        if is_cancelled:
            batch.update(status="cancelled", cancelled_at=int(time.time()))
        else:
            batch.update(status="completed", completed_at=int(time.time()))

    def _write(self, filename: str, results: list[dict[str, Any]], expires_after_s: int | None) -> str:
        data = "".join(json.dumps(r) + "\n" for r in results).encode()
        return self.files.add(filename, "batch_output", data, expires_after_s)["id"]


def _succeeded(result: dict[str, Any]) -> bool:
    return result["response"] is not None and result["response"]["status_code"] == 200


def _line_errors(lines: list[str], endpoint: str) -> list[dict[str, Any]]:
    """OpenAI's errors of a batch that fails its validation, one per line that cannot run."""
    if not lines:
        return [{"code": "empty_file", "message": "the input file holds no request", "param": None, "line": None}]
    errors = []
    for number, request in enumerate(parsed_lines(lines), 1):
        if "error" in request:
            errors.append({"code": request["error"]["code"], "message": request["error"]["message"],
                           "param": None, "line": number})
        elif request["url"] != endpoint:
            errors.append({"code": "invalid_request", "message": f"line {number}: url {request['url']!r} is not the "
                           f"batch's endpoint {endpoint!r}", "param": None, "line": number})
    return errors


def add_batch_routes(app: FastAPI, jobs: BatchJobs, api_key: str | None) -> None:
    import httpx

    jobs.transport = httpx.ASGITransport(app=app)
    jobs.api_key = api_key
    files = jobs.files

    @app.post("/v1/files")
    async def upload(file: UploadFile = File(...), purpose: str = Form(...),
                     expires_anchor: str | None = Form(None, alias="expires_after[anchor]"),
                     expires_seconds: int | None = Form(None, alias="expires_after[seconds]")):
        if purpose not in PURPOSES:
            raise APIError(400, f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}", param="purpose")
        asked = None
        if expires_anchor is not None or expires_seconds is not None:
            asked = ExpiresAfter(anchor=expires_anchor or "", seconds=expires_seconds or 0)
        return files.add(file.filename or "upload.jsonl", purpose, await file.read(),
                         expiry_seconds(asked, "expires_after"))

    @app.get("/v1/files")
    async def list_files(purpose: str | None = None, limit: int = Query(10000, ge=1, le=10000),
                         after: str | None = None):
        return files.listed(purpose, limit, after)

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str):
        return files.get(file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str):
        return Response(files.content(file_id), media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str):
        return files.delete(file_id)

    @app.post("/v1/batches")
    async def create_batch(request: Request):
        return jobs.create(await parsed_body(request, CreateBatch))

    @app.get("/v1/batches")
    async def list_batches(limit: int = Query(20, ge=1, le=100), after: str | None = None):
        return jobs.listed(limit, after)

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str):
        return jobs.get(batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str):
        return jobs.cancel(batch_id)
