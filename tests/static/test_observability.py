"""The observability stack in compose.yaml (deploy/), checked without a Docker engine: the
OpenTelemetry collector, Jaeger and Prometheus, and how the Baton services reach them
(Grafana and its dashboard: test_grafana.py). Each file parses and addresses compose's
service names and ports.

The compose checks need `docker-compose` (see test_compose.py) and skip without it; the
files' own checks do not.
"""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from tests.static.test_compose import (
    GRPC_PORTS,
    REPO_ROOT,
    command_of,
    default_config,
    flag_value,
)

DEPLOY = REPO_ROOT / "deploy"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
COLLECTOR_CONFIG = DEPLOY / "otel-collector" / "config.yaml"
GRAFANA_PROVISIONING = DEPLOY / "grafana" / "provisioning"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "baton.json"

WORKERS = [name for name in GRPC_PORTS if name != "gateway"]  # serve /metrics on --metrics-port
OBSERVABILITY = ["otel-collector", "jaeger", "prometheus", "grafana"]
OTLP_GRPC_PORT = 4317


def load_yaml(path: Path) -> dict:
    assert path.is_file(), f"{path.relative_to(REPO_ROOT)} does not exist"
    return yaml.safe_load(path.read_text())



def bind_mounts(service: dict) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts, as `docker-compose config` prints them."""
    mounts = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            source, target = volume.get("source", ""), volume["target"]
        else:
            source, target = volume.split(":")[:2]
        if source.startswith("/"):
            mounts[target] = Path(source)
    return mounts


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "://" in url else f"//{url}")
    return parts.hostname, parts.port


# --- compose.yaml ---------------------------------------------------------------------------


def test_the_observability_services_are_in_the_stack_with_pinned_images():
    services = default_config()["services"]
    for name in OBSERVABILITY:
        assert name in services, f"compose.yaml has no {name} service"
        image = services[name]["image"]
        repository, _, tag = image.rpartition(":")
        assert repository and re.fullmatch(r"v?\d+\.\d+\.\d+", tag), f"{name}: pin a version, got {image}"
        assert not services[name].get("profiles"), f"{name} must start with a plain `docker compose up`"


@pytest.mark.parametrize("name, port", [("grafana", 3000), ("prometheus", 9090), ("jaeger", 16686)])
def test_the_uis_are_published_on_their_usual_ports(name, port):
    ports = default_config()["services"][name]["ports"]
    assert {"published": port, "target": port} in [
        {"published": int(p["published"]), "target": int(p["target"])} for p in ports]


@pytest.mark.parametrize("name", WORKERS)
def test_every_worker_serves_metrics_on_a_fixed_port(name):
    argv = command_of(default_config()["services"][name])
    port = int(flag_value(argv, "--metrics-port"))
    assert 0 < port < 65536 and port != GRPC_PORTS[name], f"{name}: --metrics-port {port}"


@pytest.mark.parametrize("name", GRPC_PORTS)
def test_every_baton_service_sends_traces_to_the_collector(name):
    services = default_config()["services"]
    environment = services[name]["environment"]
    endpoint = environment.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    assert endpoint.startswith("http://"), f"{name}: OTEL_EXPORTER_OTLP_ENDPOINT {endpoint!r}"
    assert host_port(endpoint) == ("otel-collector", OTLP_GRPC_PORT)
    assert environment.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc") == "grpc"
    assert environment.get("OTEL_SERVICE_NAME") == f"baton-{name}"
    assert environment["BATON_MODEL"] == "/models/demo-model"  # the per-service environment keeps the shared one


@pytest.mark.parametrize("name, files", [
    ("prometheus", {"/etc/prometheus/prometheus.yml": PROMETHEUS_CONFIG}),
    ("otel-collector", {"/etc/otelcol-contrib/config.yaml": COLLECTOR_CONFIG}),
    ("grafana", {"/etc/grafana/provisioning": GRAFANA_PROVISIONING, "/var/lib/grafana/dashboards": DASHBOARD.parent}),
])
def test_config_files_are_mounted_from_deploy(name, files):
    service = default_config()["services"][name]
    mounts = bind_mounts(service)
    for target, source in files.items():
        assert mounts.get(target) == source, f"{name}: {target} is not mounted from {source}"
        assert source.exists()
    if name == "otel-collector":
        assert "--config=/etc/otelcol-contrib/config.yaml" in command_of(service)


def test_grafana_opens_on_the_baton_dashboard():
    environment = default_config()["services"]["grafana"]["environment"]
    assert environment["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == "/var/lib/grafana/dashboards/baton.json"


# --- Prometheus ----------------------------------------------------------------------------


def scrape_jobs() -> dict[str, dict]:
    return {job["job_name"]: job for job in load_yaml(PROMETHEUS_CONFIG)["scrape_configs"]}


def expected_metrics_port(name: str) -> int:
    """The port compose.yaml gives the service's /metrics: --metrics-port, or the gateway's HTTP port."""
    argv = command_of(default_config()["services"][name])
    return int(flag_value(argv, "--http-port" if name == "gateway" else "--metrics-port"))


@pytest.mark.parametrize("name", GRPC_PORTS)
def test_prometheus_scrapes_every_replica_of_every_baton_service(name):
    jobs = [job for job in scrape_jobs().values()
            if any(name in sd.get("names", []) for sd in job.get("dns_sd_configs", []))]
    assert len(jobs) == 1, f"no single scrape job finds {name} through compose's DNS"
    job = jobs[0]
    # An A lookup of a compose service name answers one address per replica.
    [sd] = [sd for sd in job["dns_sd_configs"] if name in sd["names"]]
    assert sd["type"] == "A"
    assert sd["port"] == expected_metrics_port(name)
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job.get("scheme", "http") == "http"
    # The target address stays `instance`, distinct per replica even where the services' own
    # instance ids collide; theirs is kept as `exported_instance`.
    assert not job.get("honor_labels", False)


def test_prometheus_config_parses_and_scrapes_often_enough_for_one_minute_rates():
    config = load_yaml(PROMETHEUS_CONFIG)
    interval = config["global"]["scrape_interval"]
    assert re.fullmatch(r"\d+s", interval) and int(interval[:-1]) <= 15
    names = list(scrape_jobs())
    assert len(names) == len(set(names))


# --- the OpenTelemetry collector -----------------------------------------------------------


def test_collector_receives_otlp_and_sends_traces_to_jaeger():
    config = load_yaml(COLLECTOR_CONFIG)
    grpc = config["receivers"]["otlp"]["protocols"]["grpc"]
    # Since 0.104 the receiver binds localhost unless told: other containers could not reach it.
    assert host_port(grpc["endpoint"]) == ("0.0.0.0", OTLP_GRPC_PORT)
    traces = config["service"]["pipelines"]["traces"]
    assert "otlp" in traces["receivers"]
    jaeger = [name for name in traces["exporters"]
              if name.split("/")[0] == "otlp" and host_port(config["exporters"][name]["endpoint"])[0] == "jaeger"]
    assert jaeger, f"no exporter of the traces pipeline sends OTLP to jaeger: {traces['exporters']}"
    assert host_port(config["exporters"][jaeger[0]]["endpoint"]) == ("jaeger", OTLP_GRPC_PORT)
    assert config["exporters"][jaeger[0]]["tls"]["insecure"] is True
    for pipeline in config["service"]["pipelines"].values():
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind, []):
                assert component in config.get(kind, {}), f"{kind} {component} is used but not configured"
    for extension in config["service"].get("extensions", []):
        assert extension in config["extensions"]


def test_jaeger_takes_otlp():
    environment = default_config()["services"]["jaeger"].get("environment", {})
    assert str(environment.get("COLLECTOR_OTLP_ENABLED", "true")).lower() == "true"
