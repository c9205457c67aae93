"""A process that stops answering without closing its connections (frozen by SIGSTOP here, as a host
cut off the network or powered off would be) is found by gRPC keepalive (services/common/keepalive.py)
within two periods, 1 s each here (BATON_GRPC_KEEPALIVE_S): a frozen decode worker leaves routing and
its streams go on on another, a prompt it was prefilling itself too; a frozen gateway has its calls on
the workers cancelled; with the tokenizer service frozen, the gateway encodes long prompts itself.
Before, each waited out its call's deadline (an hour for a decode stream, or a prefill worker's wait
for decode pages). Its own mesh: it freezes its processes."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos import decode_pb2, decode_pb2_grpc
from services.common.keepalive import ENV_KEEPALIVE_S, keepalive_options, keepalive_seconds, server_keepalive_options
from services.common.settings import ConfigError
from tests.services.gateway.mesh import (
    WHOLE_POOL_TOKENS,
    assert_decode_pools_free,
    metric_value,
    start_mesh,
    stop_mesh,
)
from tests.services.service_process import REPO_ROOT, metrics_address
from tests.services.waiting import wait_until

KEEPALIVE_S = 1
FOUND_WITHIN_S = 15  # two periods, and the slowest CI machine's room to move the stream
PREFILLED_PROMPT = [7 + i % 500 for i in range(300)]  # over the gateway's 256 tokens a decode worker prefills itself


@pytest.fixture(scope="module")
def mesh(tiny_demo_model):
    # Reservations leased for longer than a test waits: the pages a test reserves stay so until it gives them back.
    mesh = start_mesh(tiny_demo_model, num_prefill=1, num_decode=2, decode_args=("--lease-ms", "120000"),
                      env={ENV_KEEPALIVE_S: str(KEEPALIVE_S)})
    mesh.decode_metrics = [f"http://{metrics_address(decode)}" for decode in mesh.decode]
    try:
        yield mesh
    finally:
        for process in [mesh.gateway, mesh.tokenizer, *mesh.decode]:
            process.proc.send_signal(signal.SIGCONT)
        codes = stop_mesh(mesh)
    assert all(code == 0 for code in codes.values()), codes


def client_of(mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def running_on(mesh) -> list[float]:
    """Each decode worker's running requests."""
    return [metric_value(url, "baton_requests_running") for url in mesh.decode_metrics]


def serving_workers(mesh, kind: str) -> float:
    text = httpx.get(f"{mesh.gateway.base_url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "baton_gateway_workers" and sample.labels.get("kind") == kind
               and sample.labels.get("state") == "serving")


def reserves_waiting(mesh) -> float:
    return sum(metric_value(url, "baton_kv_reserves_waiting") for url in mesh.decode_metrics)


def test_keepalive_is_set_on_both_ends_from_its_variable():
    assert keepalive_seconds({}) == 10.0
    assert dict(keepalive_options({ENV_KEEPALIVE_S: "2.5"}))["grpc.keepalive_time_ms"] == 2500
    server = dict(server_keepalive_options({ENV_KEEPALIVE_S: "1"}))
    # Pings a client may send, taken more often than any client is set to send them.
    assert server["grpc.http2.min_ping_interval_without_data_ms"] < server["grpc.keepalive_time_ms"] == 1000
    for bad in ("0.5", "0", "nan", "soon"):
        with pytest.raises(ConfigError, match=ENV_KEEPALIVE_S):
            keepalive_seconds({ENV_KEEPALIVE_S: bad})


def test_a_service_refuses_a_keepalive_under_a_second_as_it_starts(tiny_demo_model):
    result = subprocess.run([sys.executable, "-m", "services.tokenizer", "--model", str(tiny_demo_model)],
                            cwd=REPO_ROOT, env={"PATH": "/usr/bin:/bin", ENV_KEEPALIVE_S: "0.1"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == f"tokenizer: {ENV_KEEPALIVE_S} must be at least 1 (seconds), got 0.1"


def test_a_stream_whose_decode_worker_freezes_goes_on_on_another(mesh):
    client = client_of(mesh)
    kwargs = dict(model=mesh.model_name, prompt=PREFILLED_PROMPT, max_tokens=1000, temperature=0)
    unmoved = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text
    migrations = metric_value(mesh.gateway.base_url, "baton_gateway_decode_migrations_total")
    # Salted: not in any worker's prefix cache, so a prefill worker computes it as it did the first.
    stream = client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True, "cache_salt": "moved"})
    text = next(stream).choices[0].text
    frozen = mesh.decode[running_on(mesh).index(1)]
    frozen.proc.send_signal(signal.SIGSTOP)
    try:
        frozen_at = time.monotonic()
        chunks = list(stream)
        assert time.monotonic() - frozen_at < FOUND_WITHIN_S
        assert chunks[-1].choices[0].finish_reason == "length"
        assert text + "".join(chunk.choices[0].text for chunk in chunks) == unmoved
        assert metric_value(mesh.gateway.base_url, "baton_gateway_decode_migrations_total") == migrations + 1
        assert serving_workers(mesh, "decode") == 1  # out of routing while it does not answer
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: serving_workers(mesh, "decode") == 2, timeout_s=FOUND_WITHIN_S)
    # Its stream from the gateway was closed while it was frozen: it ends it, and frees the pages.
    assert_decode_pools_free(mesh.decode, within_s=5)


def test_a_prompt_a_frozen_decode_worker_was_prefilling_itself_goes_to_another(mesh):
    """Short prompts are prefilled by their decode worker: one that freezes before the first token has
    given nothing out, so the prompt goes elsewhere, as one whose prefill worker went away does."""
    wait_until(lambda: serving_workers(mesh, "decode") == 2, timeout_s=FOUND_WITHIN_S)
    client = client_of(mesh)
    migrations = metric_value(mesh.gateway.base_url, "baton_gateway_decode_migrations_total")
    frozen = mesh.decode[0]
    frozen.proc.send_signal(signal.SIGSTOP)
    try:
        # Two at once: the second goes to the worker the first did not (as it would one after the other).
        with ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(lambda i: client.completions.create(
                model=mesh.model_name, prompt=f"Hello number {i}", max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True}), range(2)))
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
    assert [reply.choices[0].finish_reason for reply in replies] == ["length", "length"]
    assert metric_value(mesh.gateway.base_url, "baton_gateway_decode_migrations_total") == migrations + 1
    wait_until(lambda: serving_workers(mesh, "decode") == 2, timeout_s=FOUND_WITHIN_S)
    assert_decode_pools_free(mesh.decode, within_s=5)


def test_a_frozen_gateways_requests_are_ended_on_the_workers(mesh):
    """Its prompt's first token out, the prefill worker waits for decode pages (every one reserved
    here) when the gateway freezes: the prefill worker's pings go unanswered, it cancels the call and
    the Reserve waiting for it (which held its place there for --kv-reserve-wait-s, 30 s)."""
    wait_until(lambda: serving_workers(mesh, "decode") == 2, timeout_s=FOUND_WITHIN_S)
    hogs = [decode_pb2_grpc.DecodeStub(decode.channel) for decode in mesh.decode]
    for hog in hogs:
        hog.Reserve(decode_pb2.ReserveRequest(request_id="hog", num_tokens=WHOLE_POOL_TOKENS), timeout=5)
    client = client_of(mesh)
    try:
        stream = client.completions.create(model=mesh.model_name, prompt=PREFILLED_PROMPT, max_tokens=8,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(stream)
        wait_until(lambda: reserves_waiting(mesh) == 1, timeout_s=5)
        mesh.gateway.proc.send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: reserves_waiting(mesh) == 0, timeout_s=FOUND_WITHIN_S)
        finally:
            mesh.gateway.proc.send_signal(signal.SIGCONT)
        stream.close()
    finally:
        for hog in hogs:
            hog.Abort(decode_pb2.AbortRequest(request_id="hog"), timeout=5)
    assert_decode_pools_free(mesh.decode, within_s=5)
    wait_until(lambda: serving_workers(mesh, "decode") == 2, timeout_s=FOUND_WITHIN_S)
    reply = client.completions.create(model=mesh.model_name, prompt="after", max_tokens=4)
    assert reply.choices[0].finish_reason == "length"


def test_long_prompts_are_encoded_by_the_gateway_while_no_tokenizer_service_answers(mesh):
    """Prompts over the gateway's --local-tokenize-max-chars go to the tokenizer service; with it frozen
    the gateway encodes them itself, the same ids (one asked as it froze once the call is given up on, the
    next at once once it is out of routing), and its /health stays 200. So do /tokenize and /detokenize."""
    client = client_of(mesh)
    text = "A long prompt for the tokenizer service, " * 60  # 2460 characters, over the gateway's 2048

    def prompt_tokens() -> tuple[int, int]:
        completion = client.completions.create(model=mesh.model_name, prompt=text, max_tokens=2)
        chat = client.chat.completions.create(model=mesh.model_name, max_tokens=2,
                                              messages=[{"role": "user", "content": text}])
        return completion.usage.prompt_tokens, chat.usage.prompt_tokens

    def tokens_api() -> list:
        """/tokenize's and /detokenize's answers (a prompt, a conversation, ids and ids outside the vocabulary),
        and Anthropic's token count."""
        def post(path: str, body: dict) -> tuple[int, dict]:
            response = httpx.post(f"{mesh.gateway.base_url}{path}", json=body, timeout=60)
            return response.status_code, response.json()
        return [post("/tokenize", {"prompt": "short"}), post("/tokenize", {"prompt": [text, "short"]}),
                post("/tokenize", {"messages": [{"role": "user", "content": text}]}),
                post("/detokenize", {"tokens": [5, 6, 7]}), post("/v1/detokenize", {"tokens": [[5, 6], [7]]}),
                post("/detokenize", {"tokens": [5, 10**6]}),
                post("/v1/messages/count_tokens", {"model": mesh.model_name,
                                                   "messages": [{"role": "user", "content": text}]})]

    by_service = prompt_tokens(), tokens_api()
    assert by_service[1][-2][0] == 400  # the id outside the vocabulary
    fallbacks = metric_value(mesh.gateway.base_url, "baton_gateway_tokenizer_fallbacks_total")
    mesh.tokenizer.proc.send_signal(signal.SIGSTOP)
    try:
        assert prompt_tokens() == by_service[0]  # its call given up on after two keepalive periods
        wait_until(lambda: serving_workers(mesh, "tokenizer") == 0, timeout_s=FOUND_WITHIN_S)
        assert httpx.get(f"{mesh.gateway.base_url}/health", timeout=10).status_code == 200
        assert (prompt_tokens(), tokens_api()) == by_service
    finally:
        mesh.tokenizer.proc.send_signal(signal.SIGCONT)
    # The generation requests' long prompts, and every tokenize and detokenize call once it was out of routing.
    assert metric_value(mesh.gateway.base_url, "baton_gateway_tokenizer_fallbacks_total") == fallbacks + 4 + 9
    wait_until(lambda: serving_workers(mesh, "tokenizer") == 1, timeout_s=FOUND_WITHIN_S)
