"""Where a pool's workers are: the sources that say (names resolved again, the instance registry),
and `follow`, which keeps a pool on what they say.

A pool follows where its workers are (`follow`): the names it was given, resolved again (a
compose service or a Kubernetes headless service resolves to one address per replica, and
replicas come and go as the pool is scaled), and with discovery the workers of its kind that
heartbeat in the Redis instance registry. Each new address joins (out of routing until its
health check says SERVING); each gone one leaves routing at once, its channel closed once its
requests are done. A source that cannot answer (a name that does not resolve, Redis away)
leaves the pool as it is.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence

from services.gateway.workers import WorkerPool

log = logging.getLogger("baton.gateway")

REGISTRY_TIMEOUT_S = 1.0


def expand_addresses(addresses: Sequence[str]) -> list[str]:
    """Each "host:port", with a host name that resolves to several addresses (a compose
    service with replicas) expanded to one "ip:port" per address; others as given."""
    expanded: list[str] = []
    for address in addresses:
        expanded += _addresses_of(address) or [address]  # one that does not resolve: the channel reports it
    return list(dict.fromkeys(expanded))


def needs_resolving(addresses: Sequence[str]) -> bool:
    """Whether any of `addresses` names its host (rather than giving an IP address)."""
    for address in addresses:
        try:
            ipaddress.ip_address(address.rpartition(":")[0].strip("[]"))
        except ValueError:
            return True
    return False


# Where a pool's workers are now: their addresses, or None when it cannot tell (it is left as it is).
WorkerSource = Callable[[], Awaitable["list[str] | None"]]


async def follow(pool: WorkerPool, sources: Sequence[WorkerSource], every_s: float) -> None:
    """Keep `pool` on the addresses `sources` give together (one per worker), asking them every `every_s` seconds
    until cancelled; while any cannot tell, the pool stays as it is."""
    while True:
        found = [await source() for source in sources]
        if all(addresses is not None for addresses in found):
            addresses = [address for addresses in found for address in addresses]
            if needs_resolving(addresses) and len(addresses) > 1:
                addresses = await asyncio.to_thread(one_per_worker, addresses)
            pool.update(addresses)
        await asyncio.sleep(every_s)


def one_per_worker(addresses: Sequence[str]) -> list[str]:
    """`addresses` less each IP address that one of their names resolves to alone, with its port: a
    worker given by name (`--prefill localhost:50052`) that the registry lists by its address
    (`127.0.0.1:50052`) is one worker, known by its name as the pool first knew it."""
    aliases = set()
    for address in addresses:
        if needs_resolving([address]):
            ips = _ips_of(address)
            if ips is not None and len(ips) == 1:
                aliases.add(f"{ips[0]}:{address.rpartition(':')[2]}")
    return [address for address in addresses if address not in aliases]


def resolved_names(names: Sequence[str]) -> WorkerSource:
    """What `names` resolve to now; None while one does not (a DNS hiccup must not empty a pool)."""
    def resolve() -> list[str] | None:
        found = [_addresses_of(name) for name in names]
        return None if None in found else [address for addresses in found for address in addresses]

    async def source() -> list[str] | None:
        return await asyncio.to_thread(resolve) if needs_resolving(names) else list(names)
    return source


def registered_workers(registry, kind: str, model_key: str) -> WorkerSource:
    """The workers of `kind` serving model `model_key` (its fingerprint, hex) that heartbeat in
    `registry` (an InstanceRegistry); None while Redis does not answer."""
    async def source() -> list[str] | None:
        try:
            async with asyncio.timeout(REGISTRY_TIMEOUT_S):
                live = await registry.instances(kind)
        except Exception as e:  # Redis away: the pool stays as it is, as routing does
            log.debug("cannot list %s instances: %s", kind, e)
            return None
        return [info.address for info in live if info.model_key == model_key]
    return source


def _addresses_of(address: str) -> list[str] | None:
    """One "ip:port" per address `address`'s host name resolves to when there are several, else
    `address` as given; None when it does not resolve."""
    ips = _ips_of(address)
    if ips is None:
        return None
    port = address.rpartition(":")[2]
    return [address] if len(ips) == 1 else [f"{ip}:{port}" for ip in sorted(ips)]


def _ips_of(address: str) -> list[str] | None:
    """The IPv4 addresses `address`'s host resolves to; None when it does not resolve."""
    host, _, port = address.rpartition(":")
    try:
        # IPv4 only: "localhost" must stay one worker, not ::1 and 127.0.0.1 as two.
        infos = socket.getaddrinfo(host, int(port), family=socket.AF_INET, type=socket.SOCK_STREAM)
    except (socket.gaierror, ValueError):
        return None
    return list(dict.fromkeys(info[4][0] for info in infos)) or None
