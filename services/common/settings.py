"""The settings every Baton service shares: its flags and `BATON_*` variables, and their checks.

Each service keeps one frozen config dataclass (validated in `__post_init__`, built
in `from_args`); this module supplies the parts they have in common, so the same
flag reads the same variable, defaults alike and fails with the same message in
every service. A flag wins over its environment variable, which wins over the
default. Host and port carry the service's name (`BATON_DECODE_PORT`) so that a
variable set for one service of a local mesh is not inherited by its neighbours;
the model, the context override and the message limit are shared on purpose.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.checkpoint import read_model_config
from engine.config import DTYPES, KV_CACHE_DTYPES, SCHEDULING_POLICIES, stored_dtype
from services.common.limits import DEFAULT_MAX_MESSAGE_BYTES

ENV_MODEL = "BATON_MODEL"
ENV_MAX_MODEL_LEN = "BATON_MAX_MODEL_LEN"
ENV_MAX_MESSAGE_BYTES = "BATON_MAX_MESSAGE_BYTES"
ENV_REDIS_URL = "BATON_REDIS_URL"
ENV_SHUTDOWN_GRACE = "BATON_SHUTDOWN_GRACE_S"
# Shared by prefill and decode workers on purpose: the KV pages one writes, the other reads.
ENV_DTYPE = "BATON_DTYPE"
ENV_KV_CACHE_DTYPE = "BATON_KV_CACHE_DTYPE"
ENV_TENSOR_PARALLEL_SIZE = "BATON_TENSOR_PARALLEL_SIZE"
# Shared by every service: the gateway and tokenizer read the model's context from config.json too.
ENV_HF_OVERRIDES = "BATON_HF_OVERRIDES"
DEFAULT_SHUTDOWN_GRACE_S = 5.0


class ConfigError(ValueError):
    """A setting is missing or out of range; the message names the flag and its variable.
    The service's entry point prints it on one line and exits 2."""


def env_int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    """`env[name]` as an int; `default` when unset or empty."""
    return _env_number(env, name, default, int, "an integer")


def env_float(env: Mapping[str, str], name: str, default: float) -> float:
    """`env[name]` as a float; `default` when unset or empty."""
    return _env_number(env, name, default, float, "a number")


def env_flag(env: Mapping[str, str], name: str) -> bool:
    """Whether `env[name]` turns a flag on: set to anything but "" or "0"."""
    return env.get(name, "") not in ("", "0")


def _env_number(env: Mapping[str, str], name: str, default, convert, kind: str):
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        return convert(value)
    except ValueError:
        raise ConfigError(f"${name} must be {kind}, got {value!r}") from None


def new_parser(name: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"python -m services.{name}", description=f"Baton's {name} service (gRPC).")


def add_bind_flags(parser: argparse.ArgumentParser, env: Mapping[str, str], *, env_host: str, env_port: str,
                   model_help: str | None = "model directory") -> None:
    """--model, --host and --port, each defaulting to its variable; no --model when `model_help`
    is None (a service that serves any model's pages and loads none: kvstore)."""
    if model_help is not None:
        parser.add_argument("--model", default=env.get(ENV_MODEL), help=f"{model_help} (${ENV_MODEL})")
    parser.add_argument("--host", default=env.get(env_host, "127.0.0.1"), help=f"bind host (${env_host})")
    parser.add_argument("--port", type=int, default=env_int(env, env_port, 0),
                        help=f"bind port, 0 for any free one (${env_port})")


def add_shutdown_flag(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """--shutdown-grace-s: after SIGTERM, how long in-flight calls may finish (health says
    NOT_SERVING at once, so routers send no new ones) before they are cut."""
    parser.add_argument("--shutdown-grace-s", type=float, default=env_float(env, ENV_SHUTDOWN_GRACE,
                                                                              DEFAULT_SHUTDOWN_GRACE_S),
                        help=f"after SIGTERM, how long in-flight requests may finish before they are cut: keep it "
                             f"under the orchestrator's own (Kubernetes' terminationGracePeriodSeconds, compose's "
                             f"stop_grace_period) (${ENV_SHUTDOWN_GRACE})")


def add_scheduling_flag(parser: argparse.ArgumentParser, env: Mapping[str, str], *, env_var: str) -> None:
    """--scheduling-policy of a worker's engine (engine/config.py): vLLM's fcfs or priority."""
    parser.add_argument("--scheduling-policy", default=env.get(env_var) or "fcfs",
                        help=f"fcfs: requests are scheduled as they come; priority: by each request's "
                             f"`priority` (lower first, then as they came), the least urgent preempted first "
                             f"(${env_var})")


def add_dtype_flag(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """--dtype of a worker's engine: what it computes in and keeps its KV pages in; and --kv-cache-dtype."""
    parser.add_argument("--dtype", default=env.get(ENV_DTYPE) or None,
                        help=f"what the model computes in and the KV pages hold: {', '.join(DTYPES)}, or auto (the "
                             f"checkpoint's own); default float32 on a CPU, the fast one there, and auto on a GPU (a "
                             f"bfloat16 checkpoint in bfloat16, as vLLM's default); prefill and decode workers must "
                             f"agree (${ENV_DTYPE})")
    parser.add_argument("--kv-cache-dtype", default=env.get(ENV_KV_CACHE_DTYPE) or "auto",
                        help=f"what the KV pages hold, vLLM's: auto (--dtype), fp8 (= fp8_e4m3) or fp8_e5m2, one "
                             f"byte a number (a quarter of float32's room: four times the tokens), cast without "
                             f"scales; prefill and decode workers must agree (${ENV_KV_CACHE_DTYPE})")


def resolved_dtype(dtype: str | None, model_dir: Path, hf_overrides: Mapping[str, Any] | None = None,
                   device: str = "cpu") -> str:
    """`dtype`, checked; `auto`: the checkpoint's (config.json's torch_dtype, as vLLM's auto reads it, the
    overrides' where they give one) where the engine computes in it, else float32. None: float32 on the
    CPU, auto on a GPU (`device`)."""
    if dtype is None:
        dtype = "float32" if device == "cpu" else "auto"
    if dtype == "auto":
        try:
            config = read_model_config(model_dir, hf_overrides)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"--dtype auto: cannot read {model_dir / 'config.json'} ({e})") from None
        stored = stored_dtype(config)
        return stored if stored in DTYPES else "float32"
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)} or auto, got {dtype!r}")
    return dtype


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


def check_scheduling_policy(policy: str) -> None:
    if policy not in SCHEDULING_POLICIES:
        raise ConfigError(f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")


def add_limit_flags(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """--max-model-len and --max-message-bytes, each defaulting to its (shared) variable, and
    --shutdown-grace-s."""
    add_shutdown_flag(parser, env)
    parser.add_argument("--max-model-len", type=int, default=env_int(env, ENV_MAX_MODEL_LEN, None),
                        help=f"shorten the model's context length (${ENV_MAX_MODEL_LEN})")
    parser.add_argument("--max-message-bytes", type=int,
                        default=env_int(env, ENV_MAX_MESSAGE_BYTES, DEFAULT_MAX_MESSAGE_BYTES),
                        help=f"largest gRPC message sent or received (${ENV_MAX_MESSAGE_BYTES})")
    parser.add_argument("--hf-overrides", metavar="JSON", default=env.get(ENV_HF_OVERRIDES) or None,
                        help=f"config.json keys replaced, as vLLM's: e.g. a rope_scaling to serve past the "
                             f"model's context; every service of a mesh must be given the same (${ENV_HF_OVERRIDES})")


def json_object(given: str | None, source: str) -> dict[str, Any] | None:
    """A flag's JSON object (None when not given); ConfigError naming `source` for anything else."""
    if not given:
        return None
    try:
        parsed = json.loads(given)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source} is not JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"{source} must be a JSON object, got {given!r}")
    return parsed


def hf_overrides(given: str | None) -> dict[str, Any] | None:
    """--hf-overrides' JSON object; ConfigError for anything else."""
    return json_object(given, f"--hf-overrides (or ${ENV_HF_OVERRIDES})")


def add_metrics_flag(parser: argparse.ArgumentParser, env: Mapping[str, str], *, env_metrics_port: str) -> None:
    """--metrics-port, per service like the port: where the worker serves Prometheus' /metrics."""
    parser.add_argument("--metrics-port", type=int, default=env_int(env, env_metrics_port, 0),
                        help=f"port of the Prometheus /metrics endpoint, on --host; 0 for any free one, "
                             f"-1 for none (${env_metrics_port})")


def check_metrics_port(port: int) -> None:
    if not -1 <= port <= 65535:
        raise ConfigError(f"--metrics-port must be in [-1, 65535] (-1: none), got {port}")


def add_registry_flags(parser: argparse.ArgumentParser, env: Mapping[str, str], *, env_instance_id: str) -> None:
    """--redis (the prefix index and instance registry; shared by every service of a mesh on
    purpose) and --instance-id (per service, like host and port)."""
    parser.add_argument("--redis", metavar="URL", default=env.get(ENV_REDIS_URL, ""),
                        help=f"Redis URL (redis://HOST:PORT/DB) to heartbeat into and publish the prefix cache "
                             f"to; empty: none (${ENV_REDIS_URL})")
    parser.add_argument("--instance-id", metavar="ID", default=env.get(env_instance_id, ""),
                        help=f"this worker's id in Redis; default KIND-HOST-PORT once bound (${env_instance_id})")


def add_long_prefill_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0, metavar="N",
                        help="no prompt computes more than N tokens a step, so that a long one leaves room in each "
                             "step for short ones (vLLM's flag; default 0: no cap but the step's own)")


def check_long_prefill(threshold: int) -> None:
    if threshold < 0:
        raise ConfigError(f"--long-prefill-token-threshold must be 0 (no cap) or more, got {threshold}")


def add_seed_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, metavar="N",
                        help="seed the worker's random generator at start, as vLLM's --seed: requests without a "
                             "seed of their own then sample the same tokens run after run, given the same "
                             "requests in the same order (default: not seeded)")


def add_tensor_parallel_flag(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=env_int(env, ENV_TENSOR_PARALLEL_SIZE, 1),
                        metavar="N", help="split the model's heads and MLP width across N processes on this host, "
                                          "as vLLM's (the models README.md's Tensor parallelism lists, on the CPU "
                                          f"so far) (${ENV_TENSOR_PARALLEL_SIZE}; default 1)")


def check_tensor_parallel_size(size: int) -> None:
    if size < 1:
        raise ConfigError(f"--tensor-parallel-size must be 1 or more, got {size}")


def add_tracing_flag(parser: argparse.ArgumentParser) -> None:
    """--otlp-endpoint (or vLLM's name for it, --otlp-traces-endpoint): where OpenTelemetry spans go.
    Without it the standard variables decide (`OTEL_EXPORTER_OTLP_ENDPOINT` and the rest:
    services/common/tracing.py)."""
    parser.add_argument("--otlp-endpoint", "--otlp-traces-endpoint", dest="otlp_endpoint", metavar="URL", default="",
                        help="send trace spans to this OTLP gRPC collector (http://HOST:4317); default: "
                             "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing")


ENV_PROFILER_DIR = "BATON_PROFILER_DIR"


def add_profiler_flag(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """--profiler-dir: where the torch profiler's traces go (vLLM's VLLM_TORCH_PROFILER_DIR); without it
    the gateway's /start_profile is refused: a client may not have a worker write files unasked."""
    parser.add_argument("--profiler-dir", metavar="DIR", default=env.get(ENV_PROFILER_DIR, ""),
                        help="write torch profiler traces here when the gateway's /start_profile and /stop_profile "
                             f"ask; default: none, profiling refused (${ENV_PROFILER_DIR})")


def check_registry(redis_url: str, registry_ttl_s: float, index_ttl_s: float) -> None:
    if redis_url and not redis_url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"--redis must be a redis://, rediss:// or unix:// URL (or ${ENV_REDIS_URL}), "
                          f"got {redis_url!r}")
    if registry_ttl_s <= 0 or index_ttl_s <= 0:
        raise ConfigError(f"registry_ttl_s and index_ttl_s must be > 0, got {registry_ttl_s}, {index_ttl_s}")


def model_arg(args: argparse.Namespace) -> Path:
    """The parsed --model as a path; ConfigError when neither the flag nor the variable gave one."""
    if not args.model:
        raise ConfigError(f"no model: pass --model DIR or set ${ENV_MODEL}")
    return Path(args.model).expanduser()


def check_model_dir(model_dir: Path | str, required_file: str) -> Path:
    """`model_dir` as a Path, once it holds `required_file`."""
    model_dir = Path(model_dir)
    if not (model_dir / required_file).is_file():
        raise ConfigError(f"--model {model_dir}: no {required_file} there (set --model or ${ENV_MODEL})")
    return model_dir


def check_bind(host: str, port: int, env_host: str) -> None:
    if not host:
        raise ConfigError(f"--host must not be empty (or ${env_host})")
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {port}")


def check_positive(flag: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{flag} must be >= 1, got {value}")


def check_limits(max_model_len: int | None, max_message_bytes: int, grace_s: float) -> None:
    if max_model_len is not None:
        check_positive("--max-model-len", max_model_len)
    check_positive("--max-message-bytes", max_message_bytes)
    if not grace_s >= 0:  # NaN too
        raise ConfigError(f"--shutdown-grace-s must be >= 0, got {grace_s}")
