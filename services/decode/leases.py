"""Reservations held under a lease: pages prefill will fill, freed if Decode never claims them.

Lives on the event loop (single-threaded): grant, claim, revoke and expiry never race.
"""
from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Lease:
    reservation_id: str
    request_id: str
    block_ids: frozenset[int]  # the reserved pages: the only ones a transfer may write
    timer: asyncio.TimerHandle | None  # None while the leases are held


class LeaseTable:
    """`on_expire(lease)` is called (on the loop) for a lease nobody claimed in `lease_s`."""

    def __init__(self, lease_s: float, on_expire: Callable[[Lease], None]) -> None:
        self.lease_s = lease_s
        self._on_expire = on_expire
        self._by_reservation: dict[str, Lease] = {}
        self._by_request: dict[str, str] = {}
        self.is_held = False  # no lease runs out: generation is paused, so prefill may not be filling them

    def __len__(self) -> int:
        return len(self._by_reservation)

    def grant(self, request_id: str, block_ids: list[int]) -> str:
        """Start the lease on `block_ids`, already reserved under `request_id`; returns the reservation id."""
        reservation_id = secrets.token_hex(8)
        lease = Lease(reservation_id, request_id, frozenset(block_ids), None)
        if not self.is_held:
            lease.timer = self._timer(reservation_id)
        self._by_reservation[reservation_id] = lease
        self._by_request[request_id] = reservation_id
        return reservation_id

    def hold(self) -> None:
        """Stop every lease's clock (generation paused: the prefill filling its pages waits too)."""
        self.is_held = True
        for lease in self._by_reservation.values():
            if lease.timer is not None:
                lease.timer.cancel()
                lease.timer = None

    def release(self) -> None:
        """Start every lease's clock again, from a whole lease each."""
        self.is_held = False
        for lease in self._by_reservation.values():
            lease.timer = self._timer(lease.reservation_id)

    def _timer(self, reservation_id: str) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(self.lease_s, self._expire, reservation_id)

    def get(self, reservation_id: str) -> Lease | None:
        """The live lease (pages still reserved, not yet claimed by Decode), or None."""
        return self._by_reservation.get(reservation_id)

    def renew(self, lease: Lease) -> None:
        """A whole lease again from now: its pages are being written (a prompt's, while the rest of it
        computes), so the prefill filling them is alive."""
        if lease.timer is not None:
            lease.timer.cancel()
            lease.timer = self._timer(lease.reservation_id)

    def claim(self, reservation_id: str, request_id: str) -> Lease | None:
        """End the lease because Decode took the pages; None if unknown, expired or someone else's."""
        lease = self._by_reservation.get(reservation_id)
        if lease is None or lease.request_id != request_id:
            return None
        self._drop(lease)
        return lease

    def revoke(self, request_id: str) -> Lease | None:
        """End the lease of `request_id` (Abort); the caller frees the pages. None if none."""
        reservation_id = self._by_request.get(request_id)
        if reservation_id is None:
            return None
        lease = self._by_reservation[reservation_id]
        self._drop(lease)
        return lease

    def close(self) -> None:
        for lease in list(self._by_reservation.values()):
            self._drop(lease)

    def _drop(self, lease: Lease) -> None:
        if lease.timer is not None:
            lease.timer.cancel()
        del self._by_reservation[lease.reservation_id]
        del self._by_request[lease.request_id]

    def _expire(self, reservation_id: str) -> None:
        lease = self._by_reservation.get(reservation_id)
        if lease is not None:
            self._drop(lease)
            self._on_expire(lease)
