"""`ServiceMetrics`, `RequestMetrics` and `EngineCollector` in-process: what each records,
exactly, and that two services in one process keep separate registries."""
from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from services.common.metrics import RequestMetrics, ServiceMetrics


def samples(metrics: ServiceMetrics) -> dict[tuple[str, frozenset], float]:
    text = metrics.exposition().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(metrics: ServiceMetrics, name: str, **extra: str) -> float:
    return samples(metrics).get((name, frozenset({**metrics.labels, **extra}.items())), 0.0)


def test_a_request_is_timed_once_and_ends_once():
    metrics = ServiceMetrics("gateway", model="m", instance="gw-0")
    requests = RequestMetrics(metrics)
    timer = requests.start()
    timer.num_prompt_tokens = 7
    timer.add_tokens(1)
    timer.add_tokens(0)  # a step without tokens is no step
    timer.add_tokens(2)
    timer.finish("stop")
    timer.fail("cancelled")  # the consumer closing after the last delta is no error
    requests.start().fail("overloaded")
    requests.observe_prefill(0.004, "grpc_stream", 0.003, 1000, early_bytes=600)  # 600 of them sent early
    requests.observe_prefill(0.004, None, 0.0, 0)  # no pages moved: queue only
    assert value(metrics, "baton_time_to_first_token_seconds_count") == 1
    assert value(metrics, "baton_inter_token_latency_seconds_count") == 2  # each token after the first
    assert value(metrics, "baton_time_per_output_token_seconds_count") == 1
    assert value(metrics, "baton_e2e_request_latency_seconds_count") == 1
    assert value(metrics, "baton_prompt_tokens_total") == 7
    assert value(metrics, "baton_generation_tokens_total") == 3
    assert value(metrics, "baton_request_success_total", finish_reason="stop") == 1
    assert value(metrics, "baton_request_errors_total", reason="overloaded") == 1
    assert value(metrics, "baton_request_errors_total", reason="cancelled") == 0
    assert value(metrics, "baton_request_queue_duration_seconds_count") == 2
    assert value(metrics, "baton_request_queue_duration_seconds_bucket", le="0.005") == 2
    assert value(metrics, "baton_request_queue_duration_seconds_bucket", le="0.002") == 0
    assert value(metrics, "baton_kv_transfer_duration_seconds_count", transport="grpc_stream") == 1
    assert value(metrics, "baton_kv_transfer_bytes_total", transport="grpc_stream") == 1000
    assert value(metrics, "baton_kv_transfer_early_bytes_total", transport="grpc_stream") == 600


def test_tokens_that_come_together_share_the_wait_before_them():
    metrics = ServiceMetrics("gateway", model="m", instance="gw-0")
    timer = RequestMetrics(metrics).start()
    start = timer.arrival
    timer.add_tokens(3, start + 0.5)  # two came with the first: no wait of their own
    timer.add_tokens(4, start + 0.9)  # a chunk of four after 0.4 s: 0.1 s each
    timer.add_tokens(1, start + 1.0)
    assert value(metrics, "baton_inter_token_latency_seconds_count") == 7
    assert value(metrics, "baton_inter_token_latency_seconds_sum") == pytest.approx(0.5)
    assert value(metrics, "baton_inter_token_latency_seconds_bucket", le="0.001") == 2  # the two that waited none
    assert value(metrics, "baton_time_to_first_token_seconds_sum") == pytest.approx(0.5)


def test_two_services_in_one_process_keep_their_own_registries():
    a, b = ServiceMetrics("decode", "m", "decode-a"), ServiceMetrics("decode", "m", "decode-b")
    RequestMetrics(a), RequestMetrics(b)  # the same families, registered twice without a clash
    a.count_error("lease_expired")
    assert value(a, "baton_request_errors_total", reason="lease_expired") == 1
    assert value(b, "baton_request_errors_total", reason="lease_expired") == 0


def test_the_engine_is_read_on_each_scrape(tiny_demo_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=16))
    metrics = ServiceMetrics("prefill", "tiny", "prefill-0")
    metrics.watch_engine(engine)
    assert value(metrics, "baton_engine_init_duration_seconds") == engine.init_seconds > 0
    assert value(metrics, "baton_weight_loading_duration_seconds") == engine.runner.weight_loading_seconds > 0
    assert value(metrics, "baton_kv_pages_free") == 16 and value(metrics, "baton_kv_pages_used") == 0
    prompt = list(range(1, 41))  # two full blocks of 16 and a bit
    engine.add_request("a", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    assert value(metrics, "baton_requests_waiting") == 1 and value(metrics, "baton_requests_running") == 0
    engine.step()
    assert value(metrics, "baton_requests_running") == 1
    assert value(metrics, "baton_kv_pages_used") == 3
    assert value(metrics, "baton_kv_cache_usage_perc") == 3 / 16
    while engine.has_unfinished_requests():
        engine.step()
    list(engine.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True)))
    assert value(metrics, "baton_kv_pages_used") == 0 and value(metrics, "baton_requests_running") == 0
    assert value(metrics, "baton_prefix_cache_queries_total") == 80
    # Steps by their tokens: the first prompt's 40, then 3 decode steps of one; the second prompt's 8
    # past its cached blocks, then one.
    assert value(metrics, "baton_iteration_tokens_count") == 6
    assert value(metrics, "baton_iteration_tokens_sum") == 40 + 3 + 8 + 1
    assert [value(metrics, "baton_iteration_tokens_bucket", le=le) for le in ("1.0", "8.0", "32.0", "64.0", "+Inf")] \
        == [4, 5, 5, 6, 6]
    assert value(metrics, "baton_prefix_cache_hits_total") == 32  # the second prompt's two full blocks
    with metrics.time_warmup():
        pass
    assert value(metrics, "baton_warmup_duration_seconds") >= 0


def test_preemptions_are_counted(tiny_demo_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=4))  # 64 tokens
    metrics = ServiceMetrics("decode", "tiny", "decode-0")
    metrics.watch_engine(engine)
    # Two requests of 20 prompt tokens each that grow to 60: both cannot hold their pages at once.
    outputs = engine.generate([list(range(1, 21)), list(range(21, 41))], SamplingParams(max_tokens=40, ignore_eos=True))
    assert sum(len(output.new_token_ids) for output in outputs) == 80
    assert value(metrics, "baton_num_preemptions_total") == engine.scheduler.num_preemptions >= 1


def test_a_worker_serves_its_registry_over_http():
    metrics = ServiceMetrics("tokenizer", "m", "tokenizer-0")
    metrics.count_error("invalid_argument")
    port = metrics.serve_http("127.0.0.1", 0)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        metrics.close()
    assert 'baton_request_errors_total{instance="tokenizer-0",model="m",reason="invalid_argument",' \
           'service="tokenizer"} 1.0' in text


def test_kv_block_residency_is_exported_with_kv_cache_metrics(tiny_demo_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=4, kv_cache_metrics_sample=1.0))
    metrics = ServiceMetrics("prefill", "tiny", "prefill-0")
    metrics.watch_engine(engine)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    list(engine.generate([list(range(1, 34))], params))  # two full blocks cached
    list(engine.generate([list(range(1, 34))], params))  # both read again
    assert value(metrics, "baton_kv_block_lifetime_seconds_count") == 0  # none evicted yet
    list(engine.generate([list(range(100, 163))], params))  # four fresh pages: both go
    for name in ("lifetime", "idle_before_evict"):
        assert value(metrics, f"baton_kv_block_{name}_seconds_count") == 2
    assert value(metrics, "baton_kv_block_reuse_gap_seconds_count") == 2
    assert 0 < value(metrics, "baton_kv_block_idle_before_evict_seconds_sum") \
        <= value(metrics, "baton_kv_block_lifetime_seconds_sum")
    plain = ServiceMetrics("prefill", "tiny", "prefill-1")
    plain.watch_engine(LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=4)))
    assert not any(name.startswith("baton_kv_block_") for name, _ in samples(plain))


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_the_workers_take_vllms_kv_cache_metrics_flags(tiny_demo_model, kind):
    from services.common.settings import ConfigError
    from services.decode.config import DecodeServiceConfig
    from services.prefill.config import PrefillServiceConfig

    config_type = PrefillServiceConfig if kind == "prefill" else DecodeServiceConfig
    model = ["--model", str(tiny_demo_model)]
    assert config_type.from_args(model, env={}).kv_cache_metrics_sample == 0
    assert config_type.from_args([*model, "--kv-cache-metrics"], env={}).kv_cache_metrics_sample == 0.01
    assert config_type.from_args([*model, "--kv-cache-metrics", "--kv-cache-metrics-sample", "0.5"],
                                 env={}).kv_cache_metrics_sample == 0.5
    with pytest.raises(ConfigError, match=r"--kv-cache-metrics-sample must be in \(0, 1\], got 1.5"):
        config_type.from_args([*model, "--kv-cache-metrics", "--kv-cache-metrics-sample", "1.5"], env={})


def test_the_cache_config_and_the_adapters_of_requests_are_exported_in_labels(tiny_demo_model, tmp_path):
    import time

    import transformers

    from tests.lora_adapters import ALL_PROJECTIONS, make_adapter

    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_demo_model, dtype="float32")
    make_adapter(tmp_path / "tuned", base, ALL_PROJECTIONS, 4, 8.0, False, seed=5)
    engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=16, max_num_seqs=1, max_loras=1,
                                    lora_modules=(("tuned", str(tmp_path / "tuned")),)))
    metrics = ServiceMetrics("decode", "tiny", "decode-0")
    metrics.watch_engine(engine)
    labels = {**metrics.labels, "block_size": "16", "cache_dtype": "auto", "num_gpu_blocks": "16",
              "enable_prefix_caching": "True"}
    assert samples(metrics)[("baton_cache_config_info", frozenset(labels.items()))] == 1

    def adapters() -> tuple[str, str, str, float]:
        (key, when), = [(k, v) for k, v in samples(metrics).items() if k[0] == "baton_lora_requests_info"]
        got = dict(key[1])
        return got["max_lora"], got["running_lora_adapters"], got["waiting_lora_adapters"], when

    assert adapters()[:3] == ("1", "", "")
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
    engine.add_request("b", [4, 5, 6], SamplingParams(max_tokens=3, lora_name="tuned"))  # one at a time: it waits
    engine.step()
    max_lora, running, waiting, when = adapters()
    assert (max_lora, running, waiting) == ("1", "", "tuned") and abs(when - time.time()) < 60
    seen = set()
    while engine.has_unfinished_requests():
        engine.step()
        seen.add(adapters()[1:3])
    assert ("tuned", "") in seen and adapters()[:3] == ("1", "", "")
