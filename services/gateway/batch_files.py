"""OpenAI's Files API as batches use it (`POST /v1/files` with purpose "batch", `GET /v1/files`,
`GET /v1/files/{id}`, `GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`), as SGLang's server
serves it: the files uploaded and the batches' output and error files, kept in a directory of the
gateway's own (made when the first is stored, deleted when it stops): they last as long as it runs, or
until they expire where OpenAI's `expires_after` (an upload's; a batch's `output_expires_after` for its
files) says they do, gone then as a deleted file is."""
from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from services.gateway.errors import APIError

PURPOSES = ("batch",)  # what a client uploads; a batch's own files are "batch_output"
EXPIRY_ANCHOR = "created_at"  # the one OpenAI takes
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 24 * 3600  # OpenAI's bounds: an hour to 30 days


class ExpiresAfter(BaseModel):
    anchor: str
    seconds: int


def expiry_seconds(asked: ExpiresAfter | None, param: str) -> int | None:
    """OpenAI's `expires_after`, checked: the seconds a file lasts from its creation; None: as long as the
    gateway runs."""
    if asked is None:
        return None
    if asked.anchor != EXPIRY_ANCHOR:
        raise APIError(400, f"{param}.anchor must be {EXPIRY_ANCHOR!r}, got {asked.anchor!r}", param=f"{param}.anchor")
    if not MIN_EXPIRY_S <= asked.seconds <= MAX_EXPIRY_S:
        raise APIError(400, f"{param}.seconds must be from {MIN_EXPIRY_S} (an hour) to {MAX_EXPIRY_S} (30 days), got "
                            f"{asked.seconds}", param=f"{param}.seconds")
    return asked.seconds


class FileStore:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._directory: Path | None = None
        self._files: dict[str, dict[str, Any]] = {}  # id -> its File object, in the order stored

    def add(self, filename: str, purpose: str, data: bytes, expires_after_s: int | None = None) -> dict[str, Any]:
        """Store a file (until `expires_after_s` from now, or the gateway's end); its File object."""
        if self._directory is None:
            self._directory = Path(tempfile.mkdtemp(prefix="baton-files-"))
        file_id, now = f"file-{uuid.uuid4().hex}", int(self._clock())
        (self._directory / file_id).write_bytes(data)
        self._files[file_id] = {"id": file_id, "object": "file", "bytes": len(data), "created_at": now,
                                "filename": filename, "purpose": purpose, "status": "processed",
                                "status_details": None,
                                "expires_at": None if expires_after_s is None else now + expires_after_s}
        return self._files[file_id]

    def get(self, file_id: str) -> dict[str, Any]:
        self._drop_expired()
        found = self._files.get(file_id)
        if found is None:
            raise APIError(404, f"No file with id {file_id!r}", code="not_found", param="file_id")
        return found

    def content(self, file_id: str) -> bytes:
        self.get(file_id)
        return (self._directory / file_id).read_bytes()

    def delete(self, file_id: str) -> dict[str, Any]:
        self.get(file_id)
        del self._files[file_id]
        (self._directory / file_id).unlink()
        return {"id": file_id, "object": "file", "deleted": True}

    def listed(self, purpose: str | None, limit: int, after: str | None) -> dict[str, Any]:
        self._drop_expired()
        return page([f for f in self._files.values() if purpose is None or f["purpose"] == purpose], limit, after)

    def _drop_expired(self) -> None:
        now = self._clock()
        for file_id in [i for i, f in self._files.items() if f["expires_at"] is not None and f["expires_at"] <= now]:
            del self._files[file_id]
            (self._directory / file_id).unlink()

    def close(self) -> None:
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None
            self._files.clear()


def page(objects: list[dict[str, Any]], limit: int, after: str | None) -> dict[str, Any]:
    """OpenAI's list of `objects` (oldest first): newest first, `limit` of them after the one whose id
    is `after` (None: from the newest)."""
    newest_first = list(reversed(objects))
    if after is not None:
        ids = [o["id"] for o in newest_first]
        newest_first = newest_first[ids.index(after) + 1:] if after in ids else []
    shown = newest_first[:limit]
    return {"object": "list", "data": shown, "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(newest_first) > limit}
