from __future__ import annotations

import asyncio
import json
import math

import httpx
import numpy as np
import pytest

from loadgen.client import RequestOptions, send_request
from loadgen.runner import LoadPoint, run_load
from loadgen.workload import RequestSpec
from tests.loadgen.sse_server import Script, ScriptedServer, sse

SPEC = RequestSpec(index=3, prompt=[5, 6, 7], prompt_len=3, output_len=3, prefix_id=None, prefix_len=0)
USAGE = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
         "prompt_tokens_details": {"cached_tokens": 2}}


def text_chunk(text: str) -> bytes:
    return sse({"choices": [{"index": 0, "text": text, "finish_reason": None}]})


def send(script, options: dict | None = None, spec: RequestSpec = SPEC):
    async def go():
        async with ScriptedServer(script) as server, httpx.AsyncClient() as client:
            opts = RequestOptions(base_url=server.base_url, model="m", **(options or {}))
            return await send_request(client, opts, spec, run_start=0.0), server.bodies
    return asyncio.run(go())


def test_completions_stream_is_timed_chunk_by_chunk():
    script = Script([(0.20, text_chunk("a")), (0.05, text_chunk("b")), (0.10, text_chunk("c")),
                     (0.0, sse({"choices": [], "usage": USAGE})), (0.0, sse("[DONE]"))])
    result, bodies = send(script)
    assert result.is_ok, result.error_message
    assert result.index == 3
    # At the first chunk, not a later one (0.15 s of the script follow it): bounded by the end, not by
    # the clock, which a loaded machine stretches.
    assert 0.19 < result.ttft < result.e2e - 0.14
    assert len(result.itl) == 2 and 0.04 < result.itl[0] < 0.1 and 0.09 < result.itl[1] < 0.16
    assert result.e2e >= result.ttft + sum(result.itl)
    assert (result.prompt_tokens, result.output_tokens, result.cached_tokens) == (3, 3, 2)
    assert result.tpot == pytest.approx((result.e2e - result.ttft) / 2)
    assert bodies == [{"model": "m", "stream": True, "stream_options": {"include_usage": True},
                       "temperature": 0.0, "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}]


def test_chat_skips_the_role_only_opening_chunk():
    role = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    word = sse({"choices": [{"index": 0, "delta": {"content": "hi"}}]})
    spec = RequestSpec(index=0, prompt="hello there", prompt_len=2, output_len=2, prefix_id=None, prefix_len=0)
    result, bodies = send(Script([(0.0, role), (0.2, word), (0.01, word), (0.0, sse("[DONE]"))]),
                          {"endpoint": "chat", "ignore_eos": False, "extra_body": {"top_k": 1}}, spec)
    assert result.is_ok and result.ttft > 0.19 and len(result.itl) == 1
    assert result.output_tokens == 2  # no usage chunk: the chunks are counted
    assert bodies[0]["messages"] == [{"role": "user", "content": "hello there"}]
    assert bodies[0]["max_completion_tokens"] == 2 and bodies[0]["top_k"] == 1 and "ignore_eos" not in bodies[0]


def test_http_error_keeps_status_and_message():
    body = json.dumps({"error": {"message": "no decode worker has free pages", "type": "x", "code": 429}})
    result, _ = send(Script(status=429, body=body.encode()))
    assert (result.error, result.error_message) == ("HTTP 429", "no decode worker has free pages")
    assert not result.is_ok and result.ttft is None


def test_error_event_mid_stream():
    result, _ = send(Script([(0.0, text_chunk("a")), (0.0, sse({"error": {"message": "worker died"}}))]))
    assert (result.error, result.error_message) == ("StreamError", "worker died")


def test_stream_without_output_is_an_error():
    result, _ = send(Script([(0.0, sse("[DONE]"))]))
    assert result.error == "EmptyResponse"


def test_timeout_covers_the_whole_request():
    result, _ = send(Script([(0.0, text_chunk("a")), (0.1, text_chunk("b")), (0.1, text_chunk("c")),
                             (5.0, sse("[DONE]"))]), {"timeout_s": 0.5})
    assert result.error == "TimeoutError"


def test_nothing_listening_is_a_connect_error():
    async def go():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        async with httpx.AsyncClient() as client:
            return await send_request(client, RequestOptions(base_url=f"http://127.0.0.1:{port}/v1", model="m"),
                                      SPEC, run_start=0.0)
    result = asyncio.run(go())
    assert result.error == "ConnectError" and result.error_message


def specs(n: int) -> list[RequestSpec]:
    return [RequestSpec(index=i, prompt=[1], prompt_len=1, output_len=1, prefix_id=None, prefix_len=0)
            for i in range(n)]


def run(script, load: LoadPoint, n: int):
    async def go():
        async with ScriptedServer(script) as server:
            options = RequestOptions(base_url=server.base_url, model="m")
            return await run_load(specs(n), options, load, np.random.default_rng(0)), server
    return asyncio.run(go())


def test_concurrency_cap_holds_in_flight_requests():
    script = Script([(0.1, text_chunk("a")), (0.0, sse("[DONE]"))])
    result, server = run(script, LoadPoint(max_concurrency=2), 6)
    assert server.max_in_flight == 2
    assert [r.index for r in result.results] == list(range(6)) and all(r.is_ok for r in result.results)
    assert 0.3 <= result.duration < 1.0  # three waves of two


def test_rate_schedule_spreads_the_sends():
    result, server = run(Script([(0.0, text_chunk("a")), (0.0, sse("[DONE]"))]), LoadPoint(request_rate=20.0), 20)
    sent = [r.sent_at for r in result.results]
    assert sent == sorted(sent) and sent[0] < 0.05
    assert 0.4 < sent[-1] < 2.5  # 19 gaps of 50 ms on average
    assert math.isfinite(result.duration) and result.duration >= sent[-1]
