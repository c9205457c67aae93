"""vLLM's LoRA flags, as the gateway and every worker take them: the adapters served beside the model
(--lora-modules), their run-time loading (--allow-runtime-lora-updating) and a worker's limits on them."""
from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path

from services.common.settings import ConfigError, check_positive

ENV_LORA_MODULES = "BATON_LORA_MODULES"
ENV_ALLOW_RUNTIME_LORA_UPDATING = "BATON_ALLOW_RUNTIME_LORA_UPDATING"


def add_lora_flag(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """--lora-modules, vLLM's: the LoRA adapters served beside the model, by the workers and the gateway alike;
    and --allow-runtime-lora-updating."""
    parser.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                        default=(env.get(ENV_LORA_MODULES) or "").split(),
                        help=f"LoRA adapters (PEFT directories) served beside the model, each under NAME, which a "
                             f"request names as its model; the gateway and every prefill and decode worker take "
                             f"the same ones (${ENV_LORA_MODULES}, separated by spaces)")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        default=env.get(ENV_ALLOW_RUNTIME_LORA_UPDATING, "").lower() in ("1", "true", "yes"),
                        help=f"load and unload LoRA adapters while running (vLLM's /v1/load_lora_adapter and "
                             f"/v1/unload_lora_adapter, from paths on the workers' hosts): on the gateway and every "
                             f"worker alike; off by default, as in vLLM (${ENV_ALLOW_RUNTIME_LORA_UPDATING}=1)")


def add_lora_limit_flags(parser: argparse.ArgumentParser) -> None:
    """--max-loras, --max-lora-rank and --max-cpu-loras of a worker's engine, vLLM's (without a default limit here)."""
    parser.add_argument("--max-loras", type=int, metavar="N",
                        help="most LoRA adapters one step's batch computes with (requests for another wait for "
                             "the next step); default: no limit")
    parser.add_argument("--max-lora-rank", type=int, metavar="R",
                        help="refuse a LoRA adapter of a higher rank, at start or at a run-time load; default: any")
    parser.add_argument("--max-cpu-loras", type=int, metavar="N",
                        help="most served LoRA adapters whose weights stay in memory: the least recently asked for "
                             "is let go, and read again from its directory when asked for (at least --max-loras); "
                             "default: all of them")


def check_lora_limits(max_loras: int | None, max_lora_rank: int | None, max_cpu_loras: int | None = None) -> None:
    for flag, value in (("--max-loras", max_loras), ("--max-lora-rank", max_lora_rank),
                        ("--max-cpu-loras", max_cpu_loras)):
        if value is not None:
            check_positive(flag, value)
    if max_cpu_loras is not None and max_loras is not None and max_cpu_loras < max_loras:
        raise ConfigError(f"--max-cpu-loras ({max_cpu_loras}) must be at least --max-loras ({max_loras}), as vLLM's")


def lora_modules(specs: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """`--lora-modules` as (name, path) pairs; ConfigError for a spec that is not NAME=PATH, a name
    given twice, or a path that is not a directory."""
    pairs = []
    for spec in specs:
        name, is_pair, path = spec.partition("=")
        if not is_pair or not name.strip() or not path.strip():
            raise ConfigError(f"--lora-modules takes NAME=PATH, got {spec!r}")
        if not Path(path.strip()).is_dir():
            raise ConfigError(f"--lora-modules: {path.strip()!r} ({name.strip()}) is not a directory")
        pairs.append((name.strip(), path.strip()))
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ConfigError(f"--lora-modules names each adapter once, got {names}")
    return tuple(pairs)
