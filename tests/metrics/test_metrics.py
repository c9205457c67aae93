"""Prometheus `/metrics` on every service of a real mesh (a tokenizer, a prefill and a
decode process, the gateway): after N requests through the `openai` client, some
streamed, the counters and histogram counts match N and the usage the client got; every
exposition parses with prometheus-client's parser; refusals are counted by reason."""
from __future__ import annotations

import time

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos import decode_pb2, decode_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from tests.services.gateway.mesh import DECODE_KV_BLOCKS, WHOLE_POOL_TOKENS, start_mesh, stop_mesh
from tests.services.service_process import metrics_address

Samples = dict[tuple[str, frozenset], float]  # (sample name, its labels) -> value


@pytest.fixture(scope="module")
def mesh(tiny_demo_model):
    # Every prompt through the prefill worker and a KV transfer: queue and transfer are counted per request.
    mesh = start_mesh(tiny_demo_model, num_prefill=1, num_decode=1, gateway_args=("--local-prefill-max-tokens", "0"))
    try:
        yield mesh
    finally:
        codes = stop_mesh(mesh)
    assert all(code == 0 for code in codes.values()), codes


@pytest.fixture(scope="module")
def client(mesh):
    with openai.OpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def worker_metrics(mesh) -> dict[str, str]:
    """The base URL of the tokenizer's, the prefill worker's and the decode worker's /metrics."""
    return {svc.name: f"http://{metrics_address(svc)}/metrics"
            for svc in (mesh.tokenizer, mesh.prefill[0], mesh.decode[0])}


def scrape(url: str) -> Samples:
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name` over the samples carrying `labels` (0 when there is none)."""
    return sum(value for (sample, sample_labels), value in samples.items()
               if sample == name and set(labels.items()) <= sample_labels)


def labels_of(samples: Samples, name: str) -> list[dict[str, str]]:
    return [dict(sample_labels) for sample, sample_labels in samples if sample == name]


def test_after_n_requests_the_gateway_counts_match_them(mesh, client):
    url = f"{mesh.gateway.base_url}/metrics"
    before = scrape(url)
    usages = []
    for i in range(3):
        completion = client.completions.create(model=mesh.model_name, prompt=f"Count to {i}:", max_tokens=4 + i,
                                               temperature=0, extra_body={"ignore_eos": True})
        usages.append(completion.usage)
    for i in range(2):
        stream = client.chat.completions.create(
            model=mesh.model_name, messages=[{"role": "user", "content": f"Say {i}"}], max_tokens=6,
            temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usages.append([chunk.usage for chunk in stream if chunk.usage is not None][-1])
    stream = client.completions.create(model=mesh.model_name, prompt="Streamed", max_tokens=5, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    usages.append([chunk.usage for chunk in stream if chunk.usage is not None][-1])
    n = len(usages)
    num_prompt = sum(u.prompt_tokens for u in usages)
    num_generated = sum(u.completion_tokens for u in usages)

    after = scrape(url)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("baton_time_to_first_token_seconds_count") == n
    assert delta("baton_e2e_request_latency_seconds_count") == n
    assert delta("baton_time_per_output_token_seconds_count") == n  # every request made more than one token
    assert delta("baton_request_queue_duration_seconds_count") == n  # each went through the prefill worker
    assert delta("baton_request_success_total", finish_reason="length") == n
    assert delta("baton_prompt_tokens_total") == num_prompt
    assert delta("baton_generation_tokens_total") == num_generated
    # The first token comes from prefill, then one decode step per token.
    assert delta("baton_inter_token_latency_seconds_count") == num_generated - n
    assert delta("baton_kv_transfer_duration_seconds_count", transport="shared_memory") == n
    assert delta("baton_kv_transfer_bytes_total", transport="shared_memory") > 0
    # Its prefill worker is on this host: both legs of each wait for a first token, in tenths of a ms.
    for leg in ("to_prefill", "from_prefill"):
        assert delta("baton_prefill_rpc_leg_duration_seconds_count", leg=leg) == n
        assert 0.0 < delta("baton_prefill_rpc_leg_duration_seconds_sum", leg=leg) / n < 0.5
    assert {"0.0001", "0.0005", "0.001"} <= {labels["le"] for labels in
                                            labels_of(after, "baton_prefill_rpc_leg_duration_seconds_bucket")}
    # vLLM's per-request histograms: one observation each, summing to the usage and the requests' max_tokens.
    for name in ("prompt_tokens", "generation_tokens", "params_max_tokens", "prefill_time_seconds",
                 "decode_time_seconds", "inference_time_seconds"):
        assert delta(f"baton_request_{name}_count") == n, name
    assert delta("baton_request_prompt_tokens_sum") == num_prompt
    assert delta("baton_request_generation_tokens_sum") == num_generated
    assert delta("baton_request_params_max_tokens_sum") == num_generated  # each ran to its max_tokens (ignore_eos)
    assert delta("baton_request_generation_tokens_bucket", le="5.0") == 3  # of 4, 5, 6, 6, 6 and 5 tokens
    # Each request one prompt of one sequence: n 1, its one sequence's tokens the most.
    assert delta("baton_request_params_n_count") == delta("baton_request_params_n_sum") == n
    assert delta("baton_request_max_num_generation_tokens_sum") == num_generated
    inference = delta("baton_request_inference_time_seconds_sum")
    assert inference == pytest.approx(delta("baton_request_prefill_time_seconds_sum")
                                      + delta("baton_request_decode_time_seconds_sum"), rel=1e-6)
    assert 0 < inference < delta("baton_e2e_request_latency_seconds_sum")
    # The +Inf bucket holds every observation; the bounds resolve milliseconds, up to a minute.
    assert delta("baton_time_to_first_token_seconds_bucket", le="+Inf") == n
    bounds = {labels["le"] for labels in labels_of(after, "baton_inter_token_latency_seconds_bucket")}
    assert {"0.001", "0.002", "0.005", "60.0", "+Inf"} <= bounds
    instance = f"gateway-{mesh.gateway.grpc_address.replace(':', '-')}"
    for labels in labels_of(after, "baton_time_to_first_token_seconds_count"):
        assert (labels["model"], labels["service"], labels["instance"]) == (mesh.model_name, "gateway", instance)
    # The router's and the placement counter are still served beside them.
    assert delta("baton_gateway_prefills_total", place="prefill") == n


def test_a_prompts_sequences_are_counted_once_they_all_end(mesh, client):
    """vLLM's request_params_n and request_max_num_generation_tokens: one observation per prompt, by
    every API that answers several sequences of one or several prompts."""
    url = f"{mesh.gateway.base_url}/metrics"
    before = scrape(url)
    completion = client.completions.create(model=mesh.model_name, prompt=["One", "Two"], n=3, max_tokens=4,
                                           temperature=0.8, extra_body={"ignore_eos": True})
    assert len(completion.choices) == 6
    chat = client.chat.completions.create(model=mesh.model_name, messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=3, temperature=0.8, extra_body={"ignore_eos": True})
    assert len(chat.choices) == 2
    answer = httpx.post(f"{mesh.gateway.base_url}/generate", timeout=30, json={
        "text": ["a", "b"], "sampling_params": [{"max_new_tokens": 2, "ignore_eos": True, "n": 2},
                                                {"max_new_tokens": 5, "ignore_eos": True}]})
    assert answer.status_code == 200, answer.text
    after = scrape(url)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    # Prompts of 3, 3, 2, 2 and 1 sequences, whose longest made 4, 4, 3, 2 and 5 tokens.
    assert delta("baton_request_params_n_count") == 5 and delta("baton_request_params_n_sum") == 3 + 3 + 2 + 2 + 1
    assert [delta("baton_request_params_n_bucket", le=le) for le in ("1.0", "2.0", "5.0")] == [1, 3, 5]
    assert delta("baton_request_max_num_generation_tokens_count") == 5
    assert delta("baton_request_max_num_generation_tokens_sum") == 4 + 4 + 3 + 2 + 5


def test_refused_requests_are_counted_by_reason(mesh, client):
    url = f"{mesh.gateway.base_url}/metrics"
    before = scrape(url)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):  # over the context: refused by the pipeline
        client.completions.create(model=mesh.model_name, prompt=[5] * 10, max_tokens=WHOLE_POOL_TOKENS + 10)
    with pytest.raises(openai.BadRequestError):  # a bad body: refused before the pipeline
        client.completions.create(model=mesh.model_name, prompt="hi", max_tokens=-1)
    after = scrape(url)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("baton_request_errors_total", reason="model_not_found") == 1
    assert delta("baton_request_errors_total", reason="context_length_exceeded") == 1
    assert delta("baton_request_errors_total", reason="invalid_request") == 1
    assert delta("baton_request_errors_total") == 3
    assert delta("baton_time_to_first_token_seconds_count") == 0
    assert delta("baton_request_success_total") == 0


def test_the_decode_worker_exports_its_pages_load_and_start_up(mesh, client, worker_metrics):
    url = worker_metrics["decode"]
    before = scrape(url)
    n = 3
    for i in range(n):
        client.completions.create(model=mesh.model_name, prompt=f"Decode {i}", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    # No free pages for a second whole-pool reservation: refused, and counted by reason.
    stub = decode_pb2_grpc.DecodeStub(mesh.decode[0].channel)
    stub.Reserve(decode_pb2.ReserveRequest(request_id="hog", num_tokens=WHOLE_POOL_TOKENS), timeout=5)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Reserve(decode_pb2.ReserveRequest(request_id="hog-2", num_tokens=WHOLE_POOL_TOKENS), timeout=5)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    held = scrape(url)
    assert total(held, "baton_kv_pages_used") == DECODE_KV_BLOCKS
    assert stub.Abort(decode_pb2.AbortRequest(request_id="hog"), timeout=5).found

    deadline = time.monotonic() + 2
    while total(after := scrape(url), "baton_kv_pages_used") != 0:
        assert time.monotonic() < deadline, "the decode pages did not come back"
        time.sleep(0.05)
    assert total(after, "baton_kv_pages_free") == DECODE_KV_BLOCKS
    assert total(after, "baton_requests_running") == 0 and total(after, "baton_requests_waiting") == 0
    assert total(after, "baton_request_success_total", finish_reason="length") \
        - total(before, "baton_request_success_total", finish_reason="length") == n
    assert total(after, "baton_request_errors_total", reason="no_free_pages") \
        - total(before, "baton_request_errors_total", reason="no_free_pages") == 1
    # Warm-up prefilled prompts here: the prefix cache was queried, in tokens.
    assert total(after, "baton_prefix_cache_queries_total") >= total(after, "baton_prefix_cache_hits_total") >= 0
    assert total(after, "baton_prefix_cache_queries_total") > 0
    for name in ("baton_engine_init_duration_seconds", "baton_weight_loading_duration_seconds",
                 "baton_warmup_duration_seconds"):
        assert total(after, name) > 0, name
    assert total(after, "baton_engine_init_duration_seconds") > total(after, "baton_weight_loading_duration_seconds")
    instance = f"decode-{mesh.decode[0].address.replace(':', '-')}"
    for labels in labels_of(after, "baton_kv_pages_used") + labels_of(after, "baton_request_success_total"):
        assert (labels["model"], labels["service"], labels["instance"]) == (mesh.model_name, "decode", instance)


def test_a_stop_string_the_gateway_matched_counts_as_stopped_on_the_decode_worker(mesh, client, worker_metrics):
    """Not as a cancelled (failed) request: the gateway ends it with an Abort naming the stop."""
    url = worker_metrics["decode"]
    kwargs = dict(model=mesh.model_name, prompt="Stop somewhere", temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(max_tokens=40, **kwargs).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), f"pick another stop string from {full!r}"
    before = scrape(url)
    # Room for 900 tokens (~1 s here): the decode worker cannot finish by itself before the Abort.
    choice = client.completions.create(max_tokens=900, stop=[stop], **kwargs).choices[0]
    assert (choice.text, choice.finish_reason) == (full[:full.find(stop)], "stop")

    def delta(samples: Samples, name: str, **labels: str) -> float:
        return total(samples, name, **labels) - total(before, name, **labels)

    deadline = time.monotonic() + 2  # the Abort reaches the decode worker after the response
    while delta(after := scrape(url), "baton_request_success_total", finish_reason="stop") != 1:
        assert time.monotonic() < deadline, "the stopped request was not counted as stopped"
        time.sleep(0.05)
    assert delta(after, "baton_request_errors_total") == 0
    assert delta(after, "baton_request_success_total") == 1
    assert total(after, "baton_kv_pages_used") == 0


def test_the_prefill_worker_exports_its_handoffs_pages_and_start_up(mesh, client, worker_metrics):
    url = worker_metrics["prefill"]
    before = scrape(url)
    n = 3
    for i in range(n):
        client.completions.create(model=mesh.model_name, prompt=f"Prefill {i}", max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = scrape(url)
    assert total(after, "baton_request_success_total", finish_reason="prefilled") \
        - total(before, "baton_request_success_total", finish_reason="prefilled") == n
    assert total(after, "baton_prefix_cache_queries_total") > total(before, "baton_prefix_cache_queries_total")
    assert total(after, "baton_kv_pages_used") + total(after, "baton_kv_pages_free") > 0
    for name in ("baton_engine_init_duration_seconds", "baton_weight_loading_duration_seconds",
                 "baton_warmup_duration_seconds"):
        assert total(after, name) > 0, name
    instance = f"prefill-{mesh.prefill[0].address.replace(':', '-')}"
    for labels in labels_of(after, "baton_request_success_total") + labels_of(after, "baton_kv_pages_used"):
        assert (labels["model"], labels["service"], labels["instance"]) == (mesh.model_name, "prefill", instance)


def test_the_tokenizer_counts_refusals_by_reason(mesh, worker_metrics):
    url = worker_metrics["tokenizer"]
    before = scrape(url)
    stub = tokenizer_pb2_grpc.TokenizerStub(mesh.tokenizer.channel)
    with pytest.raises(grpc.RpcError) as refused:
        stub.ApplyChatTemplate(tokenizer_pb2.ApplyChatTemplateRequest(request_id="x"), timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = scrape(url)
    assert total(after, "baton_request_errors_total", reason="invalid_argument") \
        - total(before, "baton_request_errors_total", reason="invalid_argument") == 1
    instance = f"tokenizer-{mesh.tokenizer.address.replace(':', '-')}"
    assert labels_of(after, "baton_request_errors_total") == [
        {"model": mesh.model_name, "service": "tokenizer", "instance": instance, "reason": "invalid_argument"}]
