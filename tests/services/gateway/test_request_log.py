"""Request logging (services/gateway/request_log.py), off by default: with vLLM's
`--enable-log-requests` each generation request is logged as it arrives (its size and sampling
parameters) and as it ends (its finish, tokens, TTFT and its ledger's phases, which add up to its
end-to-end time); SGLang's `/configure_logging` turns it up (texts, cut to `--max-log-len`) or off
while the gateway serves; the flags and the environment set its level."""
from __future__ import annotations

import re
import time

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from protos import common_pb2
from services.common.settings import ConfigError
from services.gateway.config import GatewayConfig
from services.gateway.request_log import RequestLog
from tests.services.gateway.mesh import GatewayProcess

PROMPT = "Once upon a time there was"


def logged(gateway: GatewayProcess, request_id: str, within_s: float = 10.0) -> tuple[str, str]:
    """(the Received line, the Finished line) of `request_id`."""
    deadline = time.monotonic() + within_s
    while True:
        lines = list(gateway.stderr_lines)
        received = [line for line in lines if f"Received request {request_id}:" in line]
        finished = [line for line in lines if f"Finished request {request_id}:" in line]
        if received and finished:
            return received[-1], finished[-1]
        assert time.monotonic() < deadline, f"{request_id} was not logged: {lines[-5:]}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def logging_gateway(mesh):
    gateway = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                             [d.address for d in mesh.decode], "--enable-log-requests", "--max-log-len", "8")
    try:
        yield gateway
    finally:
        assert gateway.terminate() == 0


def test_a_request_is_logged_as_it_arrives_and_ends_with_where_its_time_went(mesh, logging_gateway):
    with openai.OpenAI(base_url=f"{logging_gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        answer = client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=5, temperature=0.5,
                                           extra_body={"ignore_eos": True})
    received, finished = logged(logging_gateway, answer.id)
    assert f"prompt_tokens={answer.usage.prompt_tokens}, params: " in received and "temperature: 0.5" in received
    assert PROMPT not in received and "prompt_token_ids" not in received  # level 1: no texts
    assert f"finished (length), prompt_tokens={answer.usage.prompt_tokens} cached_tokens=0 generated=5" in finished
    assert "output:" not in finished
    e2e = float(re.search(r"e2e_ms=([\d.]+)", finished)[1])
    assert 0 < float(re.search(r"ttft_ms=([\d.]+)", finished)[1]) < e2e
    phases = dict(re.findall(r"(\w+)=([\d.]+)", finished.split("phases_ms: ")[1]))
    assert {"ingress", "route"} <= phases.keys()
    # Its worker's part: its steps after the first token, unless a loaded worker sent all five tokens in
    # the chunk of the first (then its compute and queue hold them).
    assert phases.keys() & {"decode_steps", "prefill_compute", "decode_queue"}
    assert sum(map(float, phases.values())) == pytest.approx(e2e, abs=0.01 * len(phases) + 0.01)


def test_configure_logging_turns_it_up_or_off_while_serving(mesh, logging_gateway):
    base = logging_gateway.base_url

    def complete(prompt: str) -> str:
        answer = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": mesh.model_name, "prompt": prompt, "max_tokens": 3, "temperature": 0})
        assert answer.status_code == 200, answer.text
        return answer.json()["id"], answer.json()["choices"][0]["text"]

    try:
        assert httpx.post(f"{base}/configure_logging", json={"log_requests_level": 2}, timeout=10).status_code == 200
        request_id, text = complete(PROMPT)
        received, finished = logged(logging_gateway, request_id)
        assert f"prompt: {PROMPT[:8]!r}, prompt_token_ids: [" in received  # cut to --max-log-len
        assert finished.rstrip().endswith(f"output: {text[:8]!r}")
        # A chat's prompt is logged as rendered (its first ids decoded), as vLLM logs it.
        messages = [{"role": "user", "content": PROMPT}]
        chat = httpx.post(f"{base}/v1/chat/completions", timeout=60,
                          json={"model": mesh.model_name, "messages": messages, "max_tokens": 2}).json()
        rendered = httpx.post(f"{base}/tokenize", json={"messages": messages}, timeout=10).json()["tokens"]
        tokenizer = Tokenizer.from_file(str(mesh.model_dir / "tokenizer.json"))
        text = tokenizer.decode(rendered[:8], skip_special_tokens=False)
        assert f"prompt: {text[:8]!r}, prompt_token_ids: {rendered[:8]}" in logged(logging_gateway, chat["id"])[0]
        assert httpx.post(f"{base}/configure_logging", json={"log_requests": False}, timeout=10).status_code == 200
        quiet_id, _ = complete("not logged")
        refused = httpx.post(f"{base}/configure_logging", json={"dump_requests_folder": "/tmp"}, timeout=10)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "dump_requests_folder"
        time.sleep(0.2)
        assert not any(quiet_id in line for line in logging_gateway.stderr_lines)
    finally:
        httpx.post(f"{base}/configure_logging", json={"log_requests": True, "log_requests_level": 1}, timeout=10)


def test_a_request_that_fails_is_logged_with_why(mesh, logging_gateway):
    answer = httpx.post(f"{logging_gateway.base_url}/v1/completions", timeout=60, headers={"x-request-id": "too-long"},
                        json={"model": mesh.model_name, "prompt": [5] * 2048, "max_tokens": 4})
    assert answer.status_code == 400
    _, finished = logged(logging_gateway, "too-long")
    assert "Finished request too-long: context_length_exceeded," in finished and "generated=0" in finished


def test_embeddings_score_and_rerank_requests_are_logged_by_their_endpoint(mesh, logging_gateway):
    base = logging_gateway.base_url
    embedded = httpx.post(f"{base}/v1/embeddings", timeout=60,
                          json={"model": mesh.model_name, "input": ["a cat", "a dog sat"]})
    assert embedded.status_code == 200
    received, finished = logged(logging_gateway, embedded.json()["id"])
    assert received.rstrip().endswith(": embeddings")
    tokens = embedded.json()["usage"]["prompt_tokens"]
    assert f": embeddings finished, inputs=2 prompt_tokens={tokens}, e2e_ms=" in finished
    scored = httpx.post(f"{base}/score", timeout=60, headers={"x-request-id": "scored-1"},
                        json={"model": mesh.model_name, "text_1": "a cat", "text_2": ["a dog", "a hat"]})
    assert scored.status_code == 200 and scored.json()["id"] == scored.headers["x-request-id"] == "scored-1"
    assert ": score finished, inputs=2 " in logged(logging_gateway, "scored-1")[1]
    reranked = httpx.post(f"{base}/rerank", timeout=60, json={"query": "a cat", "documents": ["a", "b", "c"]})
    assert ": rerank finished, inputs=3 " in logged(logging_gateway, reranked.headers["x-request-id"])[1]
    refused = httpx.post(f"{base}/v1/embeddings", timeout=60, headers={"x-request-id": "long-input"},
                         json={"model": mesh.model_name, "input": [[5] * 2049]})
    assert refused.status_code == 400
    assert ": embeddings failed (context_length_exceeded), e2e_ms=" in logged(logging_gateway, "long-input")[1]
    labeled = httpx.post(f"{base}/v1/score", timeout=60, headers={"x-request-id": "bad-label"},  # the worker refuses it
                         json={"query": "a", "items": ["b"], "label_token_ids": [10**6]})
    assert labeled.status_code == 400
    assert ": score failed (invalid_request), e2e_ms=" in logged(logging_gateway, "bad-label")[1]


def test_the_default_gateway_logs_no_request(mesh, client):
    client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=2)
    time.sleep(0.2)
    assert not any("Received request" in line for line in mesh.gateway.stderr_lines)


def test_the_level_comes_from_vllms_or_sglangs_flags_or_the_environment(tiny_demo_model):
    common = ["--model", str(tiny_demo_model), "--tokenizer", "127.0.0.1:1", "--prefill", "127.0.0.1:2",
              "--decode", "127.0.0.1:3"]

    def level(*flags: str, env: dict[str, str] | None = None) -> int | None:
        return GatewayConfig.from_args([*common, *flags], env or {}).log_requests_level
    assert level() is None
    assert level("--enable-log-requests") == 1
    assert level("--enable-log-requests", "--enable-log-outputs") == 2
    assert level("--log-requests") == 2 and level("--log-requests", "--log-requests-level", "0") == 0
    assert level(env={"BATON_GATEWAY_LOG_REQUESTS": "3"}) == 3
    with pytest.raises(ConfigError, match="BATON_GATEWAY_LOG_REQUESTS must be one of 0, 1, 2, 3"):
        level(env={"BATON_GATEWAY_LOG_REQUESTS": "7"})
    with pytest.raises(ConfigError, match="--max-log-len"):
        level("--enable-log-requests", "--max-log-len", "-1")


def test_logging_turned_off_while_a_request_runs_does_not_fail_it(caplog):
    """Turned off between a request's arrival and its prompt being known, its arrival is not logged,
    and nothing raises in the request's path."""
    request_log = RequestLog(level=1)
    request_log.configure(log_requests=False, level=None)
    with caplog.at_level("INFO", logger="baton.gateway.requests"):
        request_log.received("r-1", [1, 2, 3], common_pb2.SamplingParams(max_tokens=3), None)
    assert not caplog.records
    request_log.configure(log_requests=True, level=None)
    assert request_log.level == 1  # back at the level it had
