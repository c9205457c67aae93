"""vLLM's cancel API through the mesh: a running request ended by its id (every choice of it), many
by their ids, every one in flight by `/abort_requests` with no ids; each ends with finish_reason
"abort" and fewer tokens than it asked for, its pages freed; an id nothing runs under is a 404 in
OpenAI's error shape."""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from tests.services.gateway.test_openai_api import MESSAGES

MAX_TOKENS = 1500  # far more than come before the cancel does


@contextmanager
def running_chat(mesh, request_id: str, n: int = 1) -> Iterator[Iterator[dict]]:
    """A streamed chat under `request_id`, once its first chunk is in: its chunks after that."""
    body = {"model": mesh.model_name, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "n": n, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{mesh.gateway.base_url}/v1/chat/completions", json=body, timeout=60,
                      headers={"x-request-id": request_id}) as answer:
        assert answer.status_code == 200
        chunks = (json.loads(line.removeprefix("data: ")) for line in answer.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]")
        next(chunks)
        yield chunks


def ended_by_abort(chunks: Iterator[dict], n: int = 1) -> None:
    finish_reasons, num_chunks = {}, 1
    for chunk in chunks:
        num_chunks += 1
        for choice in chunk["choices"]:
            if choice["finish_reason"] is not None:
                finish_reasons[choice["index"]] = choice["finish_reason"]
    assert finish_reasons == dict.fromkeys(range(n), "abort")
    assert num_chunks < MAX_TOKENS


def post(mesh, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{mesh.gateway.base_url}{path}", timeout=10, **kwargs)


def test_a_request_is_cancelled_by_its_id_every_choice_of_it(mesh):
    with running_chat(mesh, "cancel-me") as chunks:
        cancelled = post(mesh, "/v1/requests/cancel-me/cancel")
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json() == {"status": "cancelled", "request_id": "cancel-me"}
        ended_by_abort(chunks)
    with running_chat(mesh, "delete-me", n=2) as chunks:
        deleted = httpx.delete(f"{mesh.gateway.base_url}/v1/requests/delete-me", timeout=10)
        assert deleted.json() == {"status": "cancelled", "request_id": "delete-me"}
        ended_by_abort(chunks, n=2)
    mesh.assert_decode_pools_free()


def test_an_id_nothing_runs_under_is_a_404(mesh):
    for answer in (post(mesh, "/v1/requests/cancel-me/cancel"),  # finished above, or never ran
                   httpx.delete(f"{mesh.gateway.base_url}/v1/requests/no-such-request", timeout=10)):
        assert answer.status_code == 404
        assert answer.json()["error"]["type"] == "not_found_error"
        assert answer.json()["error"]["code"] == "request_not_found"


def test_many_are_cancelled_by_their_ids_and_all_without_ids(mesh):
    with running_chat(mesh, "first") as first, running_chat(mesh, "second") as second:
        cancelled = post(mesh, "/v1/requests/cancel", json={"request_ids": ["first", "no-such-request"]})
        assert cancelled.json() == {"status": "cancelled", "cancelled_request_ids": ["first"]}
        ended_by_abort(first)
        everything = post(mesh, "/abort_requests")  # no body: every request in flight
        assert everything.json() == {"status": "cancelled", "cancelled_request_ids": ["second"]}
        ended_by_abort(second)
    assert post(mesh, "/abort_requests", json={}).json() == {"status": "cancelled", "cancelled_request_ids": []}
    assert post(mesh, "/v1/requests/cancel", json={"request_ids": "first"}).status_code == 400
    mesh.assert_decode_pools_free()
