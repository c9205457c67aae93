"""--device of a prefill or decode worker: where its engine computes and keeps its KV pool.

auto (the default, as vLLM picks its platform) is the first CUDA device where torch sees one,
else the CPU. A decode worker on a CUDA device exports its pool by a CUDA IPC handle instead of
placing it in shared memory (services/kvstore/cuda_pool.py), and a prefill worker on the same
host writes pages into it device to device.
"""
from __future__ import annotations

import argparse
import re
from collections.abc import Mapping

from services.common.settings import ConfigError

ENV_DEVICE = "BATON_DEVICE"
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def add_device_flag(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    parser.add_argument("--device", default=env.get(ENV_DEVICE) or "auto",
                        help=f"where the engine computes and keeps its KV pages: cpu, cuda or cuda:N, or auto (a "
                             f"CUDA device where torch sees one, else the CPU) (${ENV_DEVICE})")


def check_device_name(device: str) -> None:
    if DEVICE.fullmatch(device) is None:
        raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}")


def resolved_device(device: str) -> str:
    """`device`, checked: auto resolved, a CUDA device refused where torch has none or not that one."""
    check_device_name(device)
    if device == "cpu":
        return device
    import torch

    if not torch.cuda.is_available():
        if device == "auto":
            return "cpu"
        raise ConfigError(f"--device {device}: torch sees no CUDA device here")
    if device == "auto":
        return "cuda:0"
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(f"--device {device}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return f"cuda:{index}"
