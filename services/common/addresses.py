"""How a service is named to others: the address it advertises and its instance id.

One place for both, so the instance registry, the prefix index and every metric label
call an instance the same, also where it binds a wildcard host (a container).
"""
from __future__ import annotations

import socket

# Wildcard bind hosts: other machines reach such a worker at its host's address.
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


def advertised_address(host: str, port: int) -> str:
    """host:port as other machines reach it. A wildcard bind advertises the IPv4 address its host
    name resolves to (a container's own address), as the gateway resolves a service name with
    several replicas into their addresses (services/gateway/worker_discovery.py)."""
    if host not in WILDCARD_HOSTS:
        return f"{host}:{port}"
    name = socket.gethostname()
    try:
        return f"{socket.gethostbyname(name)}:{port}"
    except OSError:
        return f"{name}:{port}"


def instance_id(kind: str, address: str, configured: str = "") -> str:
    """`configured` (--instance-id) when given, else KIND-HOST-PORT of the advertised `address`."""
    return configured or f"{kind}-{address.replace(':', '-')}"
