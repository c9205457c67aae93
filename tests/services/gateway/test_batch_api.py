"""OpenAI's Batch API through the real `openai` client: a file of requests uploaded, a batch run
through the gateway's own routes, its answers in an output file and its refusals in an error file
(in the input's order), a file that cannot run failing the batch before anything runs, a cancel
ending what runs and keeping what finished, a gateway with API keys running its batches, and no
page left held."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.services.gateway.mesh import GatewayProcess


def client_of(base_url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0)


def chat_line(custom_id: str, model: str, content: str, max_tokens: int = 4) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     "temperature": 0, "ignore_eos": True}}


def uploaded(client: openai.OpenAI, tmp_path, lines: list[dict]):
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with path.open("rb") as f:
        return client.files.create(file=f, purpose="batch")


def finished(client: openai.OpenAI, batch_id: str, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled"):
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)


def results(client: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_batch_runs_its_requests_and_writes_answers_and_refusals_apart(mesh, tmp_path):
    client = client_of(mesh.gateway.base_url)
    lines = [chat_line(f"c{i}", mesh.model_name, f"Hello number {i}") for i in range(5)]
    lines.insert(2, chat_line("unknown-model", "no-such-model", "Hi"))
    source = uploaded(client, tmp_path, lines)
    assert (source.purpose, source.filename, source.object) == ("batch", "requests.jsonl", "file")
    assert source.bytes == (tmp_path / "requests.jsonl").stat().st_size
    assert client.files.retrieve(source.id).id == source.id

    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "nightly"})
    assert batch.status == "in_progress" and batch.request_counts.total == 6 and batch.metadata == {"job": "nightly"}
    batch = finished(client, batch.id)
    assert batch.status == "completed" and batch.completed_at >= batch.in_progress_at
    assert (batch.request_counts.completed, batch.request_counts.failed) == (5, 1)

    answers = results(client, batch.output_file_id)
    assert [a["custom_id"] for a in answers] == [f"c{i}" for i in range(5)]  # the input's order
    body = dict(lines[0]["body"])
    extra = {"ignore_eos": body.pop("ignore_eos")}
    direct = client.chat.completions.create(**body, extra_body=extra)
    for answer in answers:
        assert answer["id"].startswith("batch_req_") and answer["error"] is None
        response = answer["response"]
        assert response["status_code"] == 200 and response["body"]["usage"]["completion_tokens"] == 4
        assert response["request_id"] == response["body"]["id"]
    assert answers[0]["response"]["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
    (refused,) = results(client, batch.error_file_id)
    assert refused["custom_id"] == "unknown-model" and refused["response"]["status_code"] == 404
    assert refused["response"]["body"]["error"]["code"] == "model_not_found"

    assert batch.id in [b.id for b in client.batches.list()]
    assert {source.id, batch.output_file_id, batch.error_file_id} <= {f.id for f in client.files.list()}
    assert client.files.delete(source.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(source.id)
    mesh.assert_decode_pools_free()


def test_a_file_that_cannot_run_fails_its_batch_and_runs_nothing(mesh, tmp_path):
    client = client_of(mesh.gateway.base_url)
    good = chat_line("a", mesh.model_name, "Hi")
    lines = [good, {**good, "url": "/v1/completions", "custom_id": "b"}, good]  # another endpoint, a repeated id
    batch = client.batches.create(input_file_id=uploaded(client, tmp_path, lines).id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert batch.status == "failed" and batch.output_file_id is None
    assert [(e.line, e.code) for e in batch.errors.data] == [(2, "invalid_request"), (3, "invalid_request")]
    assert "custom_id 'a' is used by an earlier line" in batch.errors.data[1].message

    source = uploaded(client, tmp_path, [good])
    for asked, param in (({"endpoint": "/v1/models"}, "endpoint"), ({"completion_window": "1h"}, "completion_window"),
                         ({"input_file_id": "file-nope"}, "file_id")):
        with pytest.raises(openai.APIStatusError) as e:
            client.batches.create(**{"input_file_id": source.id, "endpoint": "/v1/chat/completions",
                                     "completion_window": "24h", **asked})
        assert e.value.status_code in (400, 404) and e.value.body["param"] == param
    refused = httpx.post(f"{mesh.gateway.base_url}/v1/files", files={"file": ("x.jsonl", b"{}")},
                         data={"purpose": "fine-tune"}, timeout=10)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "purpose"
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")


def test_a_cancelled_batch_ends_what_runs_and_keeps_what_finished(mesh, tmp_path):
    client = client_of(mesh.gateway.base_url)
    lines = [chat_line(f"long{i}", mesh.model_name, f"Go on {i}", max_tokens=1500) for i in range(40)]
    batch = client.batches.create(input_file_id=uploaded(client, tmp_path, lines).id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    time.sleep(0.5)
    assert client.batches.cancel(batch.id).status == "cancelling"
    batch = finished(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    done = batch.request_counts.completed + batch.request_counts.failed
    assert done < 40
    if batch.output_file_id is not None:
        assert len(results(client, batch.output_file_id)) == batch.request_counts.completed
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(batch.id)
    mesh.assert_decode_pools_free()


def test_a_gateway_with_api_keys_runs_its_batches(mesh, tmp_path):
    gateway = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                             [d.address for d in mesh.decode], "--api-key", "sk-batch")
    try:
        client = client_of(gateway.base_url, "sk-batch")
        source = uploaded(client, tmp_path, [chat_line("k", mesh.model_name, "Hi")])
        batch = finished(client, client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                                       completion_window="24h").id)
        assert (batch.status, batch.request_counts.completed) == ("completed", 1)
        with pytest.raises(openai.AuthenticationError):
            client_of(gateway.base_url, "wrong").batches.retrieve(batch.id)
    finally:
        assert gateway.terminate() == 0


def test_files_expire_when_openais_expires_after_says(mesh, tmp_path):
    client = client_of(mesh.gateway.base_url)
    path = tmp_path / "requests.jsonl"
    path.write_text(json.dumps(chat_line("c0", mesh.model_name, "Hi")) + "\n")
    with path.open("rb") as f:
        source = client.files.create(file=f, purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600})
    assert source.expires_at == source.created_at + 3600
    assert uploaded(client, tmp_path, [chat_line("c0", mesh.model_name, "Hi")]).expires_at is None  # none asked
    for expires_after, param in (({"anchor": "created_at", "seconds": 60}, "expires_after.seconds"),
                                 ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor")):
        with path.open("rb") as f, pytest.raises(openai.BadRequestError) as refused:
            client.files.create(file=f, purpose="batch", expires_after=expires_after)
        assert refused.value.body["param"] == param
    batch = finished(client, client.batches.create(
        input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200}).id)
    output = client.files.retrieve(batch.output_file_id)
    assert output.expires_at == output.created_at + 7200
    with pytest.raises(openai.BadRequestError, match="output_expires_after.seconds"):
        client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h",
                              output_expires_after={"anchor": "created_at", "seconds": 10**9})
    mesh.assert_decode_pools_free()


def test_an_expired_file_is_gone_as_a_deleted_one_is():
    from services.gateway.batch_files import FileStore
    from services.gateway.errors import APIError

    now = [1_000_000.0]
    store = FileStore(clock=lambda: now[0])
    try:
        lasting, expiring = store.add("a.jsonl", "batch", b"a"), store.add("b.jsonl", "batch", b"b", 3600)
        now[0] += 3599
        assert store.content(expiring["id"]) == b"b"
        now[0] += 1
        with pytest.raises(APIError, match="No file with id"):
            store.get(expiring["id"])
        assert [f["id"] for f in store.listed(None, 10, None)["data"]] == [lasting["id"]]
        assert store.content(lasting["id"]) == b"a"
    finally:
        store.close()
