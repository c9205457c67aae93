"""A stream interval (the gateway's --stream-interval, SGLang's sampling_params.stream_interval): the
decode worker sends a request's tokens in chunks of at least that many, so the client gets one
event per chunk; the first token still comes alone and at once, the last chunk may be shorter, and
the text is the one every token's own event would have made."""
from __future__ import annotations

import json

import httpx
import pytest

from services.common.settings import ConfigError
from services.gateway.config import GatewayConfig
from tests.services.gateway.mesh import gateway_client

PROMPT = "Once upon a time there was"


def assert_chunked(sizes: list[int], interval: int, total: int) -> None:
    """Event sizes (tokens) of one answer: the first token at once, not held for the interval, then
    chunks of at least `interval` but the last. The workers merge into a chunk what queued behind it
    when the reader fell behind, the first too (tests/unit/test_output_batches.py): on a loaded machine
    the engine's second step can be done before the first token is sent."""
    assert sum(sizes) == total and sizes[0] < interval, sizes
    assert all(size >= interval for size in sizes[1:-1]), sizes
    assert len(sizes) <= 2 + (total - 1) // interval, sizes


def test_sglangs_stream_interval_sends_the_tokens_in_chunks(mesh):
    sampling = {"max_new_tokens": 14, "temperature": 0, "ignore_eos": True}
    body = {"text": PROMPT, "sampling_params": {**sampling, "stream_interval": 4}, "stream": True}
    events = []
    with httpx.stream("POST", f"{mesh.gateway.base_url}/generate", json=body, timeout=60) as answer:
        assert answer.status_code == 200
        events = [json.loads(line.removeprefix("data: ")) for line in answer.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    counts = [event["meta_info"]["completion_tokens"] for event in events]
    assert_chunked([b - a for a, b in zip([0, *counts], counts)], 4, 14)
    whole = httpx.post(f"{mesh.gateway.base_url}/generate", timeout=60,
                       json={"text": PROMPT, "sampling_params": sampling}).json()
    assert events[-1]["text"] == whole["text"] and events[-1]["output_ids"] == whole["output_ids"]
    mesh.assert_decode_pools_free()


def test_the_gateways_stream_interval_chunks_openai_streams_and_keeps_their_text(mesh, client):
    asked = {"model": mesh.model_name, "prompt": PROMPT, "max_tokens": 21, "temperature": 0, "logprobs": 0,
             "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}}
    expected = client.completions.create(**asked).choices[0]
    with gateway_client(mesh, "--stream-interval", "5") as chunked:
        sizes, text, tokens = [], "", []
        for chunk in chunked.completions.create(**asked, stream=True):
            if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.tokens:
                sizes.append(len(chunk.choices[0].logprobs.tokens))
                tokens += chunk.choices[0].logprobs.tokens
                text += chunk.choices[0].text
        assert_chunked(sizes, 5, 21)
        assert text == expected.text and tokens == expected.logprobs.tokens

        # A stop string found inside a chunk ends the text where every token's own event would.
        stop = expected.text[len(expected.text) // 2:][:3]
        streamed = "".join(chunk.choices[0].text for chunk in chunked.completions.create(
            **asked, stop=[stop], stream=True) if chunk.choices)
        assert streamed == client.completions.create(**asked, stop=[stop]).choices[0].text
        assert stop not in streamed

        chat = {"model": mesh.model_name, "messages": [{"role": "user", "content": "Tell me a story"}],
                "max_tokens": 12, "temperature": 0}
        reply = "".join(chunk.choices[0].delta.content or "" for chunk in chunked.chat.completions.create(
            **chat, stream=True) if chunk.choices)
        assert reply == client.chat.completions.create(**chat).choices[0].message.content
    mesh.assert_decode_pools_free()


def test_the_stream_interval_is_set_by_flag_or_environment_and_at_least_1(tiny_demo_model):
    common = ["--model", str(tiny_demo_model), "--tokenizer", "127.0.0.1:1", "--prefill", "127.0.0.1:2",
              "--decode", "127.0.0.1:3"]
    assert GatewayConfig.from_args(common, {}).stream_interval == 1
    assert GatewayConfig.from_args(common, {"BATON_GATEWAY_STREAM_INTERVAL": "8"}).stream_interval == 8
    assert GatewayConfig.from_args([*common, "--stream-interval", "3"], {}).stream_interval == 3
    for bad in ("0", str(2**31)):
        with pytest.raises(ConfigError, match=r"--stream-interval must be in \[1, 2\^31\)"):
            GatewayConfig.from_args([*common, "--stream-interval", bad], {})
