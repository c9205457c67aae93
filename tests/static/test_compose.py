"""compose.yaml checked without a Docker engine: `docker-compose config` must accept it,
and every service must start with an entry point and flags the code really has.

Needs the `docker-compose` command (Debian's package; scripts/install-system-packages.sh
installs it); skips without it.
"""
from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.services.preloaded_python import spawn

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "compose.yaml"
GPU_OVERRIDE = REPO_ROOT / "compose.gpu.yaml"
# gRPC services and the port each listens on inside its container.
GRPC_PORTS = {"tokenizer": 50051, "prefill": 50052, "decode": 50053, "kvstore": 50054, "gateway": 50050}
BATON_SERVICES = ["model-init", *GRPC_PORTS]
# Variables compose.yaml reads: cleared so the caller's shell cannot change the results.
COMPOSE_VARS = ["BATON_MODEL", "PREFILL_REPLICAS", "DECODE_REPLICAS", "TOKENIZER_REPLICAS", "BATON_PORT",
                "BATON_GRPC_PORT",
                "DECODE_SHM_SIZE", "PREFILL_SHM_SIZE", "BATON_TENSOR_PARALLEL_SIZE", "KVSTORE_CAPACITY_BYTES",
                "BATON_DECODE_SPECULATIVE_CONFIG",
                "GRAFANA_PORT", "PROMETHEUS_PORT", "JAEGER_UI_PORT",
                "COMPOSE_FILE", "COMPOSE_PROJECT_NAME", "WORKER_GPUS", "TORCH_INDEX_URL"]


def compose_config(*overrides: Path, **env: str) -> dict:
    """The resolved configuration of compose.yaml (and `overrides` over it), as `docker-compose config`
    prints it, under `env`."""
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not on PATH (scripts/install-system-packages.sh installs it as root)")
    full_env = {k: v for k, v in os.environ.items() if k not in COMPOSE_VARS} | env
    files = [arg for path in (COMPOSE_FILE, *overrides) for arg in ("-f", str(path))]
    result = subprocess.run(["docker-compose", *files, "config"], cwd=REPO_ROOT, env=full_env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"docker-compose config failed:\n{result.stderr}"
    return yaml.safe_load(result.stdout)


@functools.cache
def default_config() -> dict:
    return compose_config()


def command_of(service: dict) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else list(command)


def flags_in(argv: list[str]) -> list[str]:
    return [arg.split("=", 1)[0] for arg in argv if arg.startswith("--")]


def flag_value(argv: list[str], flag: str) -> str:
    assert flag in argv, f"{flag} missing from {shlex.join(argv)}"
    return argv[argv.index(flag) + 1]


@functools.cache
def help_flags(module: str) -> frozenset[str]:
    """Every --flag `python -m <module> --help` lists (forked from the tests' preloaded Python: a worker's module
    imports torch, two seconds of CPU afresh)."""
    helping = spawn([sys.executable, "-m", module, "--help"], cwd=REPO_ROOT)
    listed, errors = helping.stdout.read(), helping.stderr.read()
    assert helping.wait(timeout=120) == 0, f"python -m {module} --help failed:\n{errors}"
    return frozenset(re.findall(r"--[a-z0-9][a-z0-9-]*", listed))


def test_config_is_valid_and_has_every_service():
    services = default_config()["services"]
    assert {"redis", *BATON_SERVICES} <= services.keys()
    assert default_config()["volumes"].keys() >= {"models"}


def test_redis_is_the_official_image_with_a_ping_healthcheck():
    redis = default_config()["services"]["redis"]
    assert redis["image"].split(":")[0] in ("redis", "docker.io/library/redis")
    assert redis["healthcheck"]["test"][-2:] == ["redis-cli", "ping"]


# What runs without torch: the Dockerfile's `light` image (tests/services/test_light_services.py).
LIGHT_SERVICES = ("tokenizer", "gateway")


@pytest.mark.parametrize("name", BATON_SERVICES)
def test_baton_services_are_built_from_the_dockerfile_light_where_they_can_be(name):
    service = default_config()["services"][name]
    target, image = ("light", "baton-light:latest") if name in LIGHT_SERVICES else ("full", "baton:latest")
    assert service["image"] == image and service["build"]["target"] == target
    assert Path(service["build"]["context"]).resolve() == REPO_ROOT
    assert "models:/models" in " ".join(str(v) for v in service["volumes"])


@pytest.mark.parametrize("name", GRPC_PORTS)
def test_command_is_the_service_entry_point(name):
    argv = command_of(default_config()["services"][name])
    assert argv[:3] == ["python", "-m", f"services.{name}"], f"{name}: {shlex.join(argv)}"
    assert (REPO_ROOT / "services" / name / "__main__.py").is_file(), f"services/{name}/__main__.py does not exist"
    assert flag_value(argv, "--host") == "0.0.0.0"
    assert int(flag_value(argv, "--port")) == GRPC_PORTS[name]


@pytest.mark.parametrize("name", GRPC_PORTS)
def test_every_flag_is_accepted_by_the_service(name):
    argv = command_of(default_config()["services"][name])
    unknown = [flag for flag in flags_in(argv) if flag not in help_flags(f"services.{name}")]
    assert not unknown, f"python -m services.{name} does not accept {unknown}"


@pytest.mark.parametrize("name", GRPC_PORTS)
def test_every_service_that_takes_redis_gets_the_redis_service(name):
    argv = command_of(default_config()["services"][name])
    if "--redis" not in help_flags(f"services.{name}"):
        pytest.skip(f"python -m services.{name} takes no --redis")
    assert flag_value(argv, "--redis") == "redis://redis:6379/0"
    assert "redis" in default_config()["services"][name]["depends_on"]


@pytest.mark.parametrize("name", GRPC_PORTS)
def test_healthcheck_probes_the_service_port(name):
    service = default_config()["services"][name]
    test = service["healthcheck"]["test"]
    assert test[:4] == ["CMD", "python", "-m", "services.common.healthcheck"]
    target = test[4]
    expected = "http://127.0.0.1:8000/health" if name == "gateway" else f"127.0.0.1:{GRPC_PORTS[name]}"
    assert target == expected


def test_model_services_wait_for_the_model_and_use_baton_model():
    config = compose_config(BATON_MODEL="/models/other")
    services = config["services"]
    for name in ("tokenizer", "prefill", "decode", "gateway"):
        assert flag_value(command_of(services[name]), "--model") == "/models/other"
    for name in ("tokenizer", "prefill", "decode"):
        assert services[name]["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
    init = services["model-init"]
    assert init["environment"]["BATON_MODEL"] == "/models/other"
    assert "baton make-demo-model" in " ".join(command_of(init))
    assert init["restart"] == "no"


def test_default_model_is_the_demo_model_in_the_volume():
    argv = command_of(default_config()["services"]["prefill"])
    assert flag_value(argv, "--model") == "/models/demo-model"


def test_gateway_starts_after_every_worker_is_healthy():
    depends_on = default_config()["services"]["gateway"]["depends_on"]
    for name in ("redis", "tokenizer", "prefill", "decode", "kvstore"):
        assert depends_on[name]["condition"] == "service_healthy", name


def test_gateway_reaches_workers_by_service_name_and_port():
    services = default_config()["services"]
    argv = command_of(services["gateway"])
    for name in ("tokenizer", "prefill", "decode"):
        assert flag_value(argv, f"--{name}") == f"{name}:{GRPC_PORTS[name]}"
    assert flag_value(argv, "--http-port") == "8000"


@pytest.mark.parametrize("env, published", [({}, 8000), ({"BATON_PORT": "18000"}, 18000)])
def test_gateway_publishes_http(env, published):
    ports = compose_config(**env)["services"]["gateway"]["ports"]
    assert {"published": published, "target": 8000} in [
        {"published": int(p["published"]), "target": int(p["target"])} for p in ports]


def test_only_the_gateway_and_the_dashboards_publish_ports():
    services = default_config()["services"]
    published = {name for name, service in services.items() if service.get("ports")}
    assert published == {"gateway", "grafana", "prometheus", "jaeger"}


@pytest.mark.parametrize("env, prefill, decode, tokenizer", [
    ({}, 1, 1, 1),
    ({"PREFILL_REPLICAS": "3"}, 3, 1, 1),
    ({"PREFILL_REPLICAS": "2", "DECODE_REPLICAS": "4", "TOKENIZER_REPLICAS": "2"}, 2, 4, 2),
])
def test_replicas_come_from_the_environment(env, prefill, decode, tokenizer):
    services = compose_config(**env)["services"]
    assert int(services["prefill"]["deploy"]["replicas"]) == prefill
    assert int(services["decode"]["deploy"]["replicas"]) == decode
    assert int(services["tokenizer"]["deploy"]["replicas"]) == tokenizer


def test_decode_has_room_for_its_shared_memory_pool():
    # Docker's default /dev/shm (64 MiB) is smaller than the demo model's default pool.
    assert default_config()["services"]["decode"].get("shm_size")


def test_workers_split_across_ranks_as_asked_with_room_for_the_pool_their_ranks_share():
    services = compose_config(BATON_TENSOR_PARALLEL_SIZE="2", PREFILL_SHM_SIZE="2gb")["services"]
    for name in ("prefill", "decode"):
        assert services[name]["environment"]["BATON_TENSOR_PARALLEL_SIZE"] == "2"
    assert services["prefill"]["shm_size"] in ("2gb", 2 << 30)


def test_an_eagle_heads_speculative_config_reaches_prefill_and_decode():
    """An EAGLE head's KV is in every page: the prefill workers compute it too, so both take the config."""
    eagle = '{"method": "eagle3", "model": "/models/eagle3", "num_speculative_tokens": 3}'
    services = compose_config(BATON_DECODE_SPECULATIVE_CONFIG=eagle)["services"]
    assert services["decode"]["environment"]["BATON_DECODE_SPECULATIVE_CONFIG"] == eagle
    assert services["prefill"]["environment"]["BATON_PREFILL_SPECULATIVE_CONFIG"] == eagle


def test_the_gpu_override_puts_prefill_and_decode_on_gpus_and_leaves_the_rest_alone():
    base = default_config()["services"]
    gpu = compose_config(GPU_OVERRIDE)["services"]
    for name in ("prefill", "decode"):
        service = gpu[name]
        assert service["environment"] == base[name]["environment"] | {"BATON_DEVICE": "cuda"}
        assert service["image"] == "baton-cuda:latest" and service["build"]["target"] == "full"
        assert service["build"]["args"]["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cu128"
        [device] = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and int(device["count"]) == 1
        assert service["deploy"]["replicas"] == base[name]["deploy"]["replicas"]
        assert command_of(service) == command_of(base[name])
    assert {name: gpu[name] for name in base.keys() - {"prefill", "decode"}} == \
        {name: base[name] for name in base.keys() - {"prefill", "decode"}}
    more = compose_config(GPU_OVERRIDE, WORKER_GPUS="2", PREFILL_REPLICAS="3")["services"]["prefill"]
    assert int(more["deploy"]["resources"]["reservations"]["devices"][0]["count"]) == 2
    assert more["deploy"]["replicas"] == 3
