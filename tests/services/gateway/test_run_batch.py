"""`baton run-batch` against the mesh: OpenAI's batch format in, each request's answer out in the
input's order (refusals with their status and error body), and the lines that cannot be sent
answered with an error saying why."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from tests.services.service_process import REPO_ROOT


def run_batch(mesh, tmp_path, lines: list[str]) -> tuple[subprocess.CompletedProcess, list[dict]]:
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    done = subprocess.run([sys.executable, "-m", "cli", "run-batch", "-i", str(tmp_path / "in.jsonl"),
                           "-o", str(tmp_path / "out.jsonl"), "--url", mesh.gateway.base_url,
                           "--max-concurrency", "4"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    out = tmp_path / "out.jsonl"
    return done, [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def request(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_a_batch_answers_each_request_in_order(mesh, client, tmp_path):
    chat = {"model": mesh.model_name, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8,
            "temperature": 0}
    completion = {"model": mesh.model_name, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    lines = [request("chat-1", "/v1/chat/completions", chat),
             request("cmpl-1", "/v1/completions", completion),
             request("embd-1", "/v1/embeddings", {"model": mesh.model_name, "input": ["a", "b"]}),
             request("unknown-model", "/v1/completions", {**completion, "model": "nope"})]
    done, results = run_batch(mesh, tmp_path, lines)
    assert done.returncode == 0, done.stderr
    assert [r["custom_id"] for r in results] == ["chat-1", "cmpl-1", "embd-1", "unknown-model"]
    assert all(r["id"].startswith("batch_req_") and r["error"] is None for r in results)
    assert [r["response"]["status_code"] for r in results] == [200, 200, 200, 404]
    chat_body, completion_body = results[0]["response"]["body"], results[1]["response"]["body"]
    assert chat_body["choices"][0]["message"]["content"] == client.chat.completions.create(
        **chat).choices[0].message.content
    assert completion_body["choices"][0]["text"] == client.completions.create(**completion).choices[0].text
    assert results[0]["response"]["request_id"] == chat_body["id"]
    assert len(results[2]["response"]["body"]["data"]) == 2
    assert results[3]["response"]["body"]["error"]["param"] == "model"
    assert "3 succeeded, 1 refused by the server, 0 not answered" in done.stderr
    mesh.assert_decode_pools_free()


def test_lines_that_cannot_be_sent_get_an_error_saying_why(mesh, tmp_path):
    body = {"model": mesh.model_name, "prompt": "hi", "max_tokens": 2}
    lines = ["not json", request("a", "/v1/completions", body), request("a", "/v1/completions", body),
             request("b", "/v1/models", body), request("c", "/v1/completions", {**body, "stream": True}),
             json.dumps({"custom_id": "d", "method": "GET", "url": "/v1/completions", "body": body})]
    done, results = run_batch(mesh, tmp_path, lines)
    assert done.returncode == 1
    assert [r["custom_id"] for r in results] == [None, "a", "a", "b", "c", "d"]
    assert results[1]["response"]["status_code"] == 200
    errors = [r["error"]["message"] for r in results if r["error"] is not None]
    assert [r["response"] for r in results if r["error"] is not None] == [None] * 5
    for fragment, message in zip(("line 1: not JSON", "line 3: custom_id 'a' is used by an earlier line",
                                  "line 4: url '/v1/models'", "line 5: a batch's requests are not streamed",
                                  "line 6: method must be POST"), errors):
        assert message.startswith(fragment), message


def test_a_server_that_does_not_answer_leaves_each_request_an_error(tmp_path):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    (tmp_path / "in.jsonl").write_text(request("a", "/v1/completions", {"model": "m", "prompt": "hi"}) + "\n")
    done = subprocess.run([sys.executable, "-m", "cli", "run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", "-",
                           "--url", url], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    [result] = [json.loads(line) for line in done.stdout.splitlines()]
    assert done.returncode == 1 and result["response"] is None
    assert result["error"]["code"] == "request_failed" and "ConnectError" in result["error"]["message"]


def orphaned_services() -> set[int]:
    """Service processes whose parent is gone (adopted by init)."""
    orphans = set()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and "services." in (proc / "cmdline").read_bytes().decode(errors="replace") \
                    and (proc / "stat").read_text().rsplit(")", 1)[1].split()[1] == "1":
                orphans.add(int(proc.name))
        except OSError:  # gone meanwhile
            pass
    return orphans


def test_given_a_model_a_batch_runs_on_a_mesh_of_its_own(mesh, client, tmp_path):
    """As vllm run-batch --model: the mesh is started for the batch and stopped after it, none of its
    processes left; the results alone on stdout, the mesh's banner and logs on stderr."""
    completion = {"model": mesh.model_name, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    (tmp_path / "in.jsonl").write_text(request("cmpl-1", "/v1/completions", completion) + "\n"
                                       + request("embd-1", "/v1/embeddings", {"model": mesh.model_name, "input": "a"}))
    before = orphaned_services()
    done = subprocess.run([sys.executable, "-m", "cli", "run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", "-",
                           "--model", str(mesh.model_dir)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["custom_id"], r["response"]["status_code"]) for r in results] == [("cmpl-1", 200), ("embd-1", 200)]
    expected = client.completions.create(**completion).choices[0].text
    assert results[0]["response"]["body"]["choices"][0]["text"] == expected
    assert "Baton is up: OpenAI API at " in done.stderr and "baton: stopped" in done.stderr
    assert orphaned_services() <= before

    missing = subprocess.run([sys.executable, "-m", "cli", "run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", "-",
                              "--model", str(tmp_path / "nowhere")], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=60)
    assert missing.returncode == 2 and "model directory not found" in missing.stderr and missing.stdout == ""
