"""What `baton up` runs: the mesh's settings and each child's command line.

Two layouts. Disaggregated (the default): a tokenizer, N prefill and M decode workers
(and a kvstore node, the prefill workers' host-memory tier), and a gateway that sends
each prompt to a prefill worker, which hands its KV pages to a decode worker; the
gateway's conditional disaggregation still lets decode prefill short prompts itself.
Colocated (`--colocated`): a tokenizer and M workers that each prefill and decode in
one engine (the decode service, every prompt through GenerateLocally), and a gateway
with no prefill pool: the baseline that disaggregation is measured against.
"""
from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from services.common.device_flag import ENV_DEVICE, check_device_name
from services.common.kv_events_config import KVEventsConfig, as_json, for_worker
from services.common.lora_flags import ENV_LORA_MODULES, lora_modules
from services.common.settings import ENV_DTYPE, ENV_HF_OVERRIDES, ENV_MAX_MODEL_LEN, hf_overrides
from services.common.tokenizer_dir_flag import ENV_TOKENIZER_DIR, tokenizer_dir
from services.launcher.process import ChildSpec
from services.tokenizer.template_setting import chat_template_source

# grpc.health.v1 names, as the servicers register them (`<proto package>.<service>`);
# written out so that starting the mesh imports neither torch nor generated code.
HEALTH_NAMES = {
    "tokenizer": "baton.tokenizer.v1.Tokenizer",
    "prefill": "baton.prefill.v1.Prefill",
    "decode": "baton.decode.v1.Decode",
    "kvstore": "baton.kvstore.v1.KVStore",
    "gateway": "baton.gateway.v1.Generate",
}
# The services whose command line takes `--redis URL` (the prefix index and instance
# registry); the others are started without it. Kept equal to what their --help lists
# by tests/services/test_baton_up.py.
REDIS_CLIENTS = frozenset({"prefill", "decode", "kvstore", "gateway"})
REDIS_URL_SCHEMES = ("redis", "rediss", "unix")
# Name prefixes of the children that run the decode service (each owns a shared-memory
# KV segment): decode workers, and colocated workers, which are decode workers too.
DECODE_NAME_PREFIXES = ("decode-", "colocated-")
# A colocated worker holds what the two pools of the disaggregated layout hold (each
# 1024 pages by default): the prompts it prefills and their prefix cache, which a prefill
# worker would keep, beside the sequences it decodes. Equal memory for both layouts.
COLOCATED_KV_BLOCKS = 2048
DECODE_KV_BLOCKS_VARIABLE = "BATON_DECODE_KV_BLOCKS"  # still sizes the pool where it is set
# The flags the launcher gives each kind of service itself: `--KIND-args` may not set them.
_BIND_FLAGS = ("--model", "--host", "--port", "--redis", "--shutdown-grace-s")
LAUNCHER_FLAGS = {
    # --dtype: both pools' (baton up --dtype), which for one alone would make their KV pages differ.
    # --lora-modules: every worker's and the gateway's (baton up --lora-modules), which must agree.
    # --kv-events-config: each worker's own endpoints (baton up --kv-events-config), which one for all would share.
    # --tokenizer-dir: every service's that reads the tokenizer (baton up --tokenizer), which must agree.
    "prefill": frozenset({*_BIND_FLAGS, "--kvstore", "--dtype", "--lora-modules", "--kv-events-config",
                          "--tokenizer-dir"}),
    "decode": frozenset({*_BIND_FLAGS, "--dtype", "--lora-modules", "--kv-events-config", "--tokenizer-dir"}),
    "kvstore": frozenset(_BIND_FLAGS),
    # --chat-template: the tokenizer service's too, which one for the gateway alone would differ from.
    "gateway": frozenset({*_BIND_FLAGS, "--tokenizer", "--prefill", "--decode", "--colocated", "--http-port",
                          "--api-key", "--chat-template", "--lora-modules", "--tokenizer-dir"}),
}
API_KEY_VARIABLE = "BATON_API_KEY"  # how the gateway is given `baton up --api-key`: not on its command line
CHAT_TEMPLATE_VARIABLE = "BATON_CHAT_TEMPLATE"  # how `baton up --chat-template` reaches the services that render
DTYPE_VARIABLE = ENV_DTYPE  # how `baton up --dtype` reaches every worker
DEVICE_VARIABLE = ENV_DEVICE  # and `baton up --device`
# How `baton up --max-model-len` reaches every service that reads it; one's own --max-model-len
# still wins (a gateway may take shorter requests than its workers serve).
MAX_MODEL_LEN_VARIABLE = ENV_MAX_MODEL_LEN
LORA_MODULES_VARIABLE = ENV_LORA_MODULES  # how `baton up --lora-modules` reaches the workers and the gateway
HF_OVERRIDES_VARIABLE = ENV_HF_OVERRIDES  # how `baton up --hf-overrides` reaches every service: they must agree


@dataclass(frozen=True)
class MeshConfig:
    model_dir: Path
    num_prefill: int = 1  # 0 when colocated
    num_decode: int = 1  # colocated: the workers that prefill and decode
    is_colocated: bool = False
    host: str = "127.0.0.1"  # the gateway's; workers bind loopback only
    http_port: int = 8000
    grpc_port: int = 0
    with_gateway: bool = True
    with_kvstore: bool = False
    with_redis: bool = True  # False: no Redis at all, the services route by load only
    redis_url: str | None = None  # an existing Redis to use; None: start one (if with_redis)
    start_timeout_s: float = 300.0  # per child: spawn to health SERVING
    # Every service's --shutdown-grace-s: how long it lets in-flight calls finish after SIGTERM.
    shutdown_grace_s: float = 5.0
    # Per child, SIGTERM to exit, then SIGKILL; None: the grace and 10 s more (loading torch, unmapping).
    stop_timeout_s: float | None = None
    python: str = field(default=sys.executable)
    # More flags by service kind ("prefill", "decode", "kvstore", "gateway"), after the launcher's own.
    service_args: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    api_key: str | None = field(default=None, repr=False)  # the gateway asks clients for it; None: for none
    # Replaces the model's chat template (a file's absolute path, or the template); None: the model's.
    chat_template: str | None = None
    tokenizer_dir: str | None = None  # every service's --tokenizer-dir (baton up --tokenizer); None: the model's
    dtype: str | None = None  # every worker's; None: as $BATON_DTYPE says, else float32 on CPUs, auto on GPUs
    device: str | None = None  # every worker's --device; None: as $BATON_DEVICE says, else auto
    max_model_len: int | None = None  # every service's context; None: as $BATON_MAX_MODEL_LEN says, else the model's
    # LoRA adapters every worker and the gateway serve, NAME=PATH each (paths made absolute: the
    # children run elsewhere); None: as $BATON_LORA_MODULES says, else none.
    lora_modules: tuple[str, ...] | None = None
    hf_overrides: str | None = None  # every service's (a JSON object); None: as $BATON_HF_OVERRIDES says, else none
    otlp_traces_endpoint: str | None = None  # where every service's spans go; None: as the OTEL_* variables say
    kv_events_config: str | None = None  # vLLM's --kv-events-config for every worker, each on its own ports
    gpu_memory_utilization: float | None = None  # each GPU's share for the workers on it, split between them
    num_gpus: int = 0  # the CUDA devices the workers spread over (baton up counts torch's); under 2: none placed

    def __post_init__(self) -> None:
        if self.is_colocated:
            if self.num_prefill:
                raise ValueError("--colocated runs no prefill workers: drop --prefill")
            if self.with_kvstore:
                raise ValueError("--colocated runs no prefill workers to fill a kvstore node: drop --kvstore")
        elif self.num_prefill < 1:
            raise ValueError("--prefill must be at least 1 (or --colocated for none)")
        if self.num_decode < 1:
            raise ValueError("--decode must be at least 1")
        if self.device is not None:
            check_device_name(self.device)
        for flag, port in (("--port", self.http_port), ("--grpc-port", self.grpc_port)):
            if not 0 <= port <= 65535:
                raise ValueError(f"{flag} must be in 0..65535, got {port}")
        if self.start_timeout_s <= 0 or (self.stop_timeout_s is not None and self.stop_timeout_s <= 0):
            raise ValueError("timeouts must be positive")
        if not self.shutdown_grace_s >= 0:  # NaN too
            raise ValueError(f"--shutdown-grace-s must be >= 0, got {self.shutdown_grace_s}")
        if self.stop_timeout_s is not None and self.stop_timeout_s <= self.shutdown_grace_s:
            raise ValueError(f"--stop-timeout ({self.stop_timeout_s:g}) must be more than --shutdown-grace-s "
                             f"({self.shutdown_grace_s:g}): a child still draining would be killed")
        if self.redis_url is not None:
            if not self.with_redis:
                raise ValueError("--redis and --no-redis exclude each other")
            if urlsplit(self.redis_url).scheme not in REDIS_URL_SCHEMES:
                raise ValueError(f"--redis must be a redis://, rediss:// or unix:// URL, got {self.redis_url!r}")
        if self.api_key is not None and (not self.api_key or self.api_key != "".join(self.api_key.split())):
            raise ValueError("--api-key must be non-empty, without spaces")
        if self.lora_modules is not None:
            pairs = lora_modules(self.lora_modules)  # a bad one refused here, not by five children
            object.__setattr__(self, "lora_modules", tuple(f"{name}={Path(path).resolve()}" for name, path in pairs))
        if self.hf_overrides is not None:
            hf_overrides(self.hf_overrides)  # refused here rather than by every child
        if self.kv_events_config is not None:
            self._check_kv_events_endpoints()
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be at least 1, got {self.max_model_len}")
        if self.chat_template is not None:
            chat_template_source(self.chat_template)  # refused here rather than by two children
            if Path(self.chat_template).expanduser().is_file():  # the children run in another directory
                object.__setattr__(self, "chat_template", str(Path(self.chat_template).expanduser().resolve()))
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"not a model directory (no config.json): {self.model_dir}")
        if self.tokenizer_dir is not None:  # refused here rather than by every child; they run elsewhere
            object.__setattr__(self, "tokenizer_dir", str(tokenizer_dir(self.tokenizer_dir)))
        elif not (self.model_dir / "tokenizer.json").is_file() and not os.environ.get(ENV_TOKENIZER_DIR):
            raise ValueError(f"no tokenizer.json in {self.model_dir}: give the tokenizer's directory with --tokenizer")
        for kind, args in self.service_args.items():
            if kind not in LAUNCHER_FLAGS:
                raise ValueError(f"no {kind} service to give flags to")
            for arg in args:
                name = arg.partition("=")[0]
                # A prefix too: argparse takes `--po` for `--port`.
                if name.startswith("--") and len(name) > 2 and any(f.startswith(name) for f in LAUNCHER_FLAGS[kind]):
                    raise ValueError(f"--{kind}-args cannot set {name}: baton up sets it itself")


    def _check_kv_events_endpoints(self) -> None:
        """Refused here rather than by every worker, as is a replay endpoint that a later worker's
        endpoint would take (5557 and 5558 for two workers: the second publishes on 5558)."""
        workers = kv_events_by_worker(self).values()
        endpoints = [e for worker in workers for e in (worker.endpoint, worker.replay_endpoint) if e]
        if len(set(endpoints)) < len(endpoints):
            given = KVEventsConfig.from_json(self.kv_events_config, "--kv-events-config")
            n = len(workers)
            raise ValueError(f"--kv-events-config: {n} workers publish on ports {given.endpoint} + 0..{n - 1} and "
                             f"replay on {given.replay_endpoint} + 0..{n - 1}, which overlap: move the replay "
                             f"endpoint {n} ports or more away")

    @property
    def stop_after_s(self) -> float:
        """How long a child may take to exit after SIGTERM before it is killed."""
        return self.stop_timeout_s if self.stop_timeout_s is not None else self.shutdown_grace_s + 10.0


def redis_args(kind: str, redis_url: str | None) -> tuple[str, ...]:
    """`--redis URL` for a service that takes it, when there is a Redis."""
    return ("--redis", redis_url) if redis_url is not None and kind in REDIS_CLIENTS else ()


def _worker_spec(config: MeshConfig, redis_url: str | None, name: str, kind: str, *args: str, port: int = 0
                 ) -> ChildSpec:
    """A service bound to loopback `port` (0: a free one)."""
    return ChildSpec(name, (config.python, "-m", f"services.{kind}", *args, *redis_args(kind, redis_url),
                            "--host", "127.0.0.1", "--port", str(port),
                            "--shutdown-grace-s", f"{config.shutdown_grace_s:g}",
                            *config.service_args.get(kind, ())),
                     f"{kind} listening on ", HEALTH_NAMES[kind])


def kvstore_spec(config: MeshConfig, redis_url: str | None = None, port: int = 0) -> ChildSpec:
    """The kvstore node, on `port` (0: any free one): prefill workers are given its address."""
    return _worker_spec(config, redis_url, "kvstore", "kvstore", port=port)


def worker_specs(config: MeshConfig, redis_url: str | None = None, kvstore_address: str | None = None
                 ) -> list[ChildSpec]:
    """Every service but the gateway and the kvstore node; with `kvstore_address`, prefill
    workers store the prefix blocks they compute there."""
    model = ("--model", str(config.model_dir))
    tier = ("--kvstore", kvstore_address) if kvstore_address else ()
    specs = [_worker_spec(config, redis_url, "tokenizer", "tokenizer", *model)]
    kv_events = kv_events_by_worker(config)

    devices = devices_by_worker(config)
    shares = gpu_shares_by_worker(config)

    def own_flags(name: str) -> tuple[str, ...]:
        placed = ("--device", devices[name]) if name in devices else ()
        share = ("--gpu-memory-utilization", f"{shares[name]:.6g}") if name in shares else ()
        return placed + share + (("--kv-events-config", as_json(kv_events[name])) if name in kv_events else ())

    if config.is_colocated:
        pool = () if DECODE_KV_BLOCKS_VARIABLE in os.environ else ("--kv-blocks", str(COLOCATED_KV_BLOCKS))
        return specs + [_worker_spec(config, redis_url, name, "decode", *model, *pool, *own_flags(name))
                        for name in _worker_names(config)]
    specs += [_worker_spec(config, redis_url, name, name.partition("-")[0], *model,
                           *(tier if name.startswith("prefill-") else ()), *own_flags(name))
              for name in _worker_names(config)]
    return specs


def _worker_names(config: MeshConfig) -> list[str]:
    """The prefill and decode workers' names (colocated ones'), in order: prefill workers first."""
    if config.is_colocated:
        return [f"colocated-{i}" for i in range(config.num_decode)]
    return [*(f"prefill-{i}" for i in range(config.num_prefill)), *(f"decode-{i}" for i in range(config.num_decode))]


def devices_by_worker(config: MeshConfig) -> dict[str, str]:
    """Each worker's CUDA device by name, round robin in order (prefill workers first, so one prefill and
    one decode worker on two GPUs take one each), where there are several GPUs and no device is asked
    for ($BATON_DEVICE auto or unset; a --device in --prefill-args or --decode-args comes after and wins).
    With one GPU or none, none: each worker's --device auto takes the GPU or the CPU."""
    asked = config.device if config.device is not None else os.environ.get(ENV_DEVICE, "auto")
    if config.num_gpus < 2 or asked not in ("", "auto"):
        return {}
    return {name: f"cuda:{index % config.num_gpus}" for index, name in enumerate(_worker_names(config))}


def gpu_shares_by_worker(config: MeshConfig) -> dict[str, float]:
    """Each worker's --gpu-memory-utilization by name: `baton up --gpu-memory-utilization` split evenly
    between the workers placed on a GPU (devices_by_worker), or between all of them where none is
    placed (one GPU: they share it); none without the flag."""
    if config.gpu_memory_utilization is None:
        return {}
    names = _worker_names(config)
    devices = devices_by_worker(config)
    sharing = Counter(devices.get(name, "") for name in names)
    return {name: config.gpu_memory_utilization / sharing[devices.get(name, "")] for name in names}


def kv_events_by_worker(config: MeshConfig) -> dict[str, KVEventsConfig]:
    """Each worker's --kv-events-config by name, the `index`th in order on its own ports (for_worker);
    none without `baton up --kv-events-config`."""
    if config.kv_events_config is None:
        return {}
    given = KVEventsConfig.from_json(config.kv_events_config, "--kv-events-config")
    return {name: for_worker(given, index) for index, name in enumerate(_worker_names(config))}


def kv_events_endpoints(config: MeshConfig) -> dict[str, str]:
    """Where each worker publishes its KV events (and replays them), by name, for `baton up`'s table."""
    return {name: worker.endpoint + (f", replay {worker.replay_endpoint}" if worker.replay_endpoint else "")
            for name, worker in kv_events_by_worker(config).items()}


def gateway_spec(config: MeshConfig, workers: dict[str, str], redis_url: str | None = None) -> ChildSpec:
    """The gateway, given the workers' addresses by name."""
    def addresses(*prefixes: str) -> str:
        return ",".join(address for name, address in workers.items() if name.startswith(prefixes))

    layout = (("--colocated",) if config.is_colocated else ("--prefill", addresses("prefill-")))
    argv = (config.python, "-m", "services.gateway", "--model", str(config.model_dir),
            "--tokenizer", workers["tokenizer"], *layout, "--decode", addresses(*DECODE_NAME_PREFIXES),
            "--host", config.host, "--port", str(config.grpc_port), "--http-port", str(config.http_port),
            *redis_args("gateway", redis_url), "--shutdown-grace-s", f"{config.shutdown_grace_s:g}",
            *config.service_args.get("gateway", ()))
    return ChildSpec("gateway", argv, "gateway listening on ", HEALTH_NAMES["gateway"])
