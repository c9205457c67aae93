"""A gateway started with --discover-workers and no --prefill or --decode finds its workers in the
Redis instance registry, where each heartbeats: a prefill worker started later joins its pool once
it serves, and one that stops leaves it, with requests served throughout."""
from __future__ import annotations

import re

import httpx
import pytest

from services.common.settings import ConfigError
from services.decode.servicer import SERVICE_NAME as DECODE_SERVICE
from services.gateway.config import GatewayConfig
from services.prefill.servicer import SERVICE_NAME as PREFILL_SERVICE
from services.tokenizer.servicer import SERVICE_NAME as TOKENIZER_SERVICE
from tests.services.gateway.mesh import DECODE_KV_BLOCKS, GatewayProcess, assert_decode_pools_free
from tests.services.service_process import ServiceProcess, stop_processes, wait_all_serving
from tests.services.waiting import wait_until


def workers(gateway: GatewayProcess) -> dict[tuple[str, str], float]:
    """baton_gateway_workers by (kind, state)."""
    text = httpx.get(f"{gateway.base_url}/metrics", timeout=5).text
    return {(kind, state): float(value) for kind, state, value in re.findall(
        r'^baton_gateway_workers\{[^}]*kind="(\w+)"[^}]*state="(\w+)"[^}]*\} (\S+)$', text, re.M)}


def complete(gateway: GatewayProcess, model: str) -> None:
    response = httpx.post(f"{gateway.base_url}/v1/completions", timeout=30,
                          json={"model": model, "prompt": "Hello there", "max_tokens": 4})
    assert response.status_code == 200, response.text


def test_workers_are_found_in_the_registry_as_they_come_and_go(tiny_demo_model, redis_client, redis_server):
    registered = ("--redis", redis_server.url)
    started = [ServiceProcess("tokenizer", TOKENIZER_SERVICE, tiny_demo_model, wait=False),
               ServiceProcess("prefill", PREFILL_SERVICE, tiny_demo_model, "--kv-blocks", "128", *registered,
                              wait=False),
               ServiceProcess("decode", DECODE_SERVICE, tiny_demo_model, "--kv-blocks", str(DECODE_KV_BLOCKS),
                              *registered, wait=False)]
    try:
        wait_all_serving(started)
        tokenizer, first, decode = started
        gateway = GatewayProcess(tiny_demo_model, tokenizer.address, [], [], *registered, "--discover-workers",
                                 "--resolve-workers-s", "0.2")  # ready only once it found both kinds
        try:
            model = tiny_demo_model.name
            assert workers(gateway) == {("prefill", "known"): 1, ("prefill", "serving"): 1,
                                        ("decode", "known"): 1, ("decode", "serving"): 1,
                                        ("tokenizer", "known"): 1, ("tokenizer", "serving"): 1}
            complete(gateway, model)

            second = ServiceProcess("prefill", PREFILL_SERVICE, tiny_demo_model, "--kv-blocks", "128", *registered)
            started.append(second)
            wait_until(lambda: workers(gateway)[("prefill", "serving")] == 2, timeout_s=20)
            assert first.terminate() == 0  # a clean stop takes it out of the registry at once
            wait_until(lambda: workers(gateway)[("prefill", "known")] == 1, timeout_s=20)
            for _ in range(3):  # all on the worker that joined
                complete(gateway, model)
            assert_decode_pools_free([decode])
        finally:
            assert gateway.terminate() == 0
    finally:
        stop_processes(started)


def test_discovery_needs_the_registry(tiny_demo_model):
    common = ["--model", str(tiny_demo_model), "--tokenizer", "127.0.0.1:1"]
    config = GatewayConfig.from_args([*common, "--redis", "redis://127.0.0.1:2/0"],
                                     {"BATON_GATEWAY_DISCOVER_WORKERS": "1"})
    assert config.discover_workers and not config.prefill_addresses and not config.decode_addresses
    with pytest.raises(ConfigError, match="--discover-workers finds workers in the instance registry"):
        GatewayConfig.from_args([*common, "--discover-workers"], {})
    with pytest.raises(ConfigError, match="no prefill workers"):
        GatewayConfig.from_args([*common, "--decode", "127.0.0.1:3"], {})
    with pytest.raises(ConfigError, match="--resolve-workers-s: it must be > 0"):
        GatewayConfig.from_args([*common, "--redis", "redis://127.0.0.1:2/0", "--discover-workers",
                                 "--resolve-workers-s", "0"], {})


@pytest.mark.parametrize("name", ["BATON_GATEWAY_RESOLVE_WORKERS_S", "BATON_GATEWAY_RESPONSES_TTL_S",
                                  "BATON_ROUTER_OVERLAP_WEIGHT"])
def test_a_gateway_number_variable_that_is_no_number_is_a_config_error(tiny_demo_model, name):
    common = ["--model", str(tiny_demo_model), "--tokenizer", "127.0.0.1:1", "--decode", "127.0.0.1:3",
              "--prefill", "127.0.0.1:4"]
    with pytest.raises(ConfigError, match=rf"\${name} must be a number, got 'soon'"):
        GatewayConfig.from_args(common, {name: "soon"})
