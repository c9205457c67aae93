"""deploy/kubernetes checked without a cluster: every object valid against Kubernetes' own
schemas (kubernetes-validate, strict: an unknown field fails), each Baton service started by
compose.yaml's entry point and flags, Services that reach their pods, probes on the ports the
services serve health on, and autoscalers that scale prefill and decode on metrics the workers
export, through the prometheus-adapter rules beside them."""
from __future__ import annotations

import functools
import re
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from tests.static.test_compose import GRPC_PORTS, REPO_ROOT, command_of, default_config, help_flags
from tests.static.test_grafana import GAUGES

KUBE_DIR = REPO_ROOT / "deploy" / "kubernetes"
GPU_OVERLAY = REPO_ROOT / "deploy" / "kubernetes-gpu"
KUBERNETES_VERSION = "1.31.0"  # gRPC probes are GA from 1.27, autoscaling/v2 from 1.23
NOT_APPLIED = {"kustomization.yaml", "prometheus-adapter-values.yaml", "podmonitor.yaml"}
LIGHT_SERVICES = ("tokenizer", "gateway")  # as compose.yaml builds them: the image without torch
IMAGE_USER = 10001  # the Dockerfile's USER


def load(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((KUBE_DIR / name).read_text()) if doc]


@functools.cache
def kustomization() -> dict:
    return load("kustomization.yaml")[0]


@functools.cache
def objects() -> list[dict]:
    return [doc for name in kustomization()["resources"] for doc in load(name)]


def named(kind: str, name: str) -> dict:
    [found] = [o for o in objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def pod_spec(name: str) -> dict:
    return named("Deployment", name)["spec"]["template"]["spec"]


def container(name: str) -> dict:
    [found] = [c for c in pod_spec(name)["containers"] if c["name"] == name]
    return found


def config_env() -> dict[str, str]:
    return named("ConfigMap", "baton-env")["data"]


def expanded(argv: list[str]) -> list[str]:
    """`argv` as the kubelet runs it: $(VAR) replaced from the ConfigMap the containers read."""
    return [re.sub(r"\$\((\w+)\)", lambda m: config_env()[m.group(1)], arg) for arg in argv]


def test_kustomization_applies_every_manifest_and_only_those():
    manifests = {path.name for path in KUBE_DIR.glob("*.yaml")} - NOT_APPLIED
    assert sorted(kustomization()["resources"]) == sorted(manifests)


@pytest.mark.parametrize("name", sorted({p.name for p in KUBE_DIR.glob("*.yaml")} - NOT_APPLIED))
def test_every_object_is_valid_kubernetes(name):
    for doc in load(name):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name", GRPC_PORTS)
def test_each_service_runs_composes_entry_point_and_flags(name):
    argv = expanded(container(name)["command"])
    assert argv == command_of(default_config()["services"][name])
    unknown = [a for a in argv if a.startswith("--") and a not in help_flags(f"services.{name}")]
    assert not unknown


@pytest.mark.parametrize("name", GRPC_PORTS)
def test_each_service_is_reached_at_its_port_by_its_name(name):
    service = named("Service", name)
    labels = named("Deployment", name)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert named("Deployment", name)["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"]: p["containerPort"] for p in container(name)["ports"]}
    served = {p["port"] for p in service["spec"]["ports"] if ports.get(p["targetPort"]) == p["port"]}
    assert GRPC_PORTS[name] in served
    if name == "gateway":
        assert 8000 in served


@pytest.mark.parametrize("name", ["tokenizer", "prefill", "decode"])
def test_workers_services_are_headless_so_the_gateway_sees_every_pod(name):
    assert named("Service", name)["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("name", GRPC_PORTS)
def test_probes_ask_each_service_its_health(name):
    probes = {kind: container(name)[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    if name == "gateway":  # HTTP: ready once every kind of worker serves, live while the process answers
        assert probes["readinessProbe"]["httpGet"]["path"] == "/health"
        assert {probes[k]["httpGet"]["path"] for k in ("startupProbe", "livenessProbe")} == {"/live"}
    else:  # grpc.health.v1, SERVING only once the model is loaded and warm
        assert all(probe["grpc"]["port"] == GRPC_PORTS[name] for probe in probes.values())


@pytest.mark.parametrize("name", GRPC_PORTS)
def test_images_run_as_the_dockerfiles_user_and_stop_after_the_drain(name):
    assert container(name)["image"] == ("baton-light" if name in LIGHT_SERVICES else "baton")
    assert f"USER {IMAGE_USER}:{IMAGE_USER}" in (REPO_ROOT / "Dockerfile").read_text()
    context = pod_spec(name)["securityContext"]
    assert context["runAsNonRoot"] and context["runAsUser"] == IMAGE_USER
    assert pod_spec(name)["terminationGracePeriodSeconds"] > int(config_env()["BATON_SHUTDOWN_GRACE_S"])
    assert {"name": "baton-env"} in [source["configMapRef"] for source in container(name)["envFrom"]]


@pytest.mark.parametrize("name", [n for n in GRPC_PORTS if n != "kvstore"])
def test_model_services_make_the_model_first_as_composes_model_init_does(name):
    [init] = pod_spec(name)["initContainers"]
    model_init = command_of(default_config()["services"]["model-init"])
    assert init["command"] == [*model_init[:2], model_init[2].replace("$$", "$")]
    assert init["image"] == "baton"  # making the demo model needs torch
    mounts = {m["name"]: m for m in container(name)["volumeMounts"]}
    assert mounts["models"]["mountPath"] == "/models" and mounts["models"]["readOnly"]
    assert config_env()["BATON_MODEL"].startswith("/models/")


def test_decode_has_memory_backed_shared_memory_for_its_pool():
    mounts = {m["mountPath"]: m["name"] for m in container("decode")["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec("decode")["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


@functools.cache
def adapter_rules() -> dict[str, dict]:
    values = load("prometheus-adapter-values.yaml")[0]
    assert values["rules"]["default"] is False
    return {rule["name"]["as"]: rule for rule in values["rules"]["custom"]}


@pytest.mark.parametrize(("name", "metric"), [("prefill", "baton_requests_waiting"),
                                              ("decode", "baton_kv_pages_used_ratio")])
def test_prefill_and_decode_scale_on_their_own_metrics(name, metric):
    hpa = named("HorizontalPodAutoscaler", name)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
    [used] = hpa["spec"]["metrics"]
    assert used["type"] == "Pods" and used["pods"]["metric"]["name"] == metric
    rule = adapter_rules()[metric]
    series = set(re.findall(r"baton_[a-z_]+", rule["seriesQuery"] + rule["metricsQuery"]))
    assert series and series <= GAUGES, f"{metric} reads {series - GAUGES}, which no worker exports"
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] > 0


def test_the_pod_monitor_scrapes_every_baton_pods_metrics_port():
    [monitor] = load("podmonitor.yaml")
    [labels] = kustomization()["labels"]
    assert labels["includeTemplates"] and monitor["spec"]["selector"]["matchLabels"].items() <= labels["pairs"].items()
    scraped = {endpoint["port"] for endpoint in monitor["spec"]["podMetricsEndpoints"]}
    for name in GRPC_PORTS:
        ports = {p["name"]: p["containerPort"] for p in container(name)["ports"]}
        annotations = named("Deployment", name)["spec"]["template"]["metadata"]["annotations"]
        [port_name] = [p for p in scraped if p in ports]
        assert ports[port_name] == int(annotations["prometheus.io/port"])


def rendered(directory) -> list[dict]:
    """What `kubectl kustomize` makes of `directory`: the objects `kubectl apply -k` would send."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on PATH: it renders kustomizations without a cluster")
    result = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_the_gpu_overlay_gives_each_worker_a_gpu_and_changes_nothing_else():
    base = {(o["kind"], o["metadata"]["name"]): o for o in rendered(KUBE_DIR)}
    gpu = {(o["kind"], o["metadata"]["name"]): o for o in rendered(GPU_OVERLAY)}
    assert gpu.keys() == base.keys()
    for key, made in gpu.items():
        kubernetes_validate.validate(made, KUBERNETES_VERSION, strict=True)
        if key not in (("Deployment", "prefill"), ("Deployment", "decode")):
            assert made == base[key], key
            continue
        name, before = key[1], base[key]["spec"]["template"]["spec"]
        [worker] = [c for c in made["spec"]["template"]["spec"]["containers"] if c["name"] == name]
        [was] = [c for c in before["containers"] if c["name"] == name]
        assert worker["image"] == "baton-cuda:latest" and was["image"] == "baton:latest"
        assert worker["resources"] == was["resources"] | {"limits": {"nvidia.com/gpu": 1}}
        assert sorted(worker["env"], key=lambda e: e["name"]) == sorted(
            [*was["env"], {"name": "BATON_DEVICE", "value": "cuda"}], key=lambda e: e["name"])
        assert {k: v for k, v in worker.items() if k not in ("image", "resources", "env")} == \
            {k: v for k, v in was.items() if k not in ("image", "resources", "env")}
        assert made["spec"]["template"]["spec"]["initContainers"] == before["initContainers"]  # the CPU image
