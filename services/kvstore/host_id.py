"""Which host a process runs on, so two workers can tell whether they share memory.

The boot id changes on every reboot and differs between machines (and between
containers on separate kernels); the hostname alone may repeat across a cluster, and
the boot id alone is shared by containers on one host that do *not* share /dev/shm
unless configured to, which the hostname (per container by default) then tells apart.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Mapping

ENV_HOST_ID = "BATON_HOST_ID"  # overrides the computed id (tests: pretend to be elsewhere)
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def host_id(env: Mapping[str, str] | None = None) -> str:
    """`$BATON_HOST_ID` when set, else `<boot id>/<hostname>` (the hostname alone without /proc)."""
    env = os.environ if env is None else env
    override = env.get(ENV_HOST_ID)
    if override:
        return override
    try:
        with open(_BOOT_ID) as f:
            boot_id = f.read().strip()
    except OSError:
        return socket.gethostname()
    return f"{boot_id}/{socket.gethostname()}"
