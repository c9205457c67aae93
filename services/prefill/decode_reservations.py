"""Reserving pages on decode workers from prefill, for targets that name no reservation.

The Reserve call is made once the prompt's first token is out, so its round trip
costs the first token nothing (the page write waits for it instead). Where the decode
worker has too few pages free, the call waits there up to `wait_s` for running requests
to free theirs (services/decode/reserve_queue.py), as a request waits in vLLM's queue;
the prompt's pages here are held meanwhile. A reservation
that is not handed on (the call failed or was cancelled) has its Reserve cancelled, and
is aborted once that has ended, so it never waits out its lease.
"""
from __future__ import annotations

import asyncio

import grpc

from protos import decode_pb2, decode_pb2_grpc
from services.common.channel import make_channel

RESERVE_TIMEOUT_S = 10.0  # the call's own, beyond its wait
ABORT_TIMEOUT_S = 5.0


class DecodeReservations:
    """Channels to decode workers, one per address, kept for the service's life; a Reserve waits up to
    `wait_s` there for pages (--kv-reserve-wait-s)."""

    def __init__(self, wait_s: float, max_message_bytes: int | None = None) -> None:
        self.wait_s = wait_s
        self.max_message_bytes = max_message_bytes
        self._stubs: dict[str, tuple[grpc.aio.Channel, decode_pb2_grpc.DecodeStub]] = {}
        self._aborts: set[asyncio.Future] = set()

    def _stub(self, address: str) -> decode_pb2_grpc.DecodeStub:
        if address not in self._stubs:
            channel = make_channel(address) if self.max_message_bytes is None \
                else make_channel(address, self.max_message_bytes)
            self._stubs[address] = (channel, decode_pb2_grpc.DecodeStub(channel))
        return self._stubs[address][1]

    def reserve(self, address: str, request_id: str, num_tokens: int, may_wait: bool = True) -> asyncio.Future:
        """The Reserve call, started now; await it for the `decode_pb2.Reservation`. `may_wait`: it waits for
        pages to free (else too few free now is RESOURCE_EXHAUSTED at once)."""
        wait_s = self.wait_s if may_wait else 0.0
        return asyncio.ensure_future(self._stub(address).Reserve(
            decode_pb2.ReserveRequest(request_id=request_id, num_tokens=num_tokens, wait_ms=round(wait_s * 1000)),
            timeout=wait_s + RESERVE_TIMEOUT_S))

    def abort_after(self, reservation: asyncio.Future, address: str, request_id: str) -> None:
        """Abort `request_id` on the decode worker once its Reserve has ended, cancelled first where it
        still waits for pages: it would hold its place in the queue there, and then the pages, for nothing.
        The decode worker gives back what a Reserve cancelled mid-way had been granted (its servicer's
        `_reserve_now`); the Abort, not sent sooner, frees what one that answered meanwhile holds."""
        reservation.cancel()  # nothing to one that has answered
        def abort(_=None) -> None:
            if not reservation.cancelled():
                reservation.exception()  # retrieved: the Prefill call reported it, or nobody waits
            task = asyncio.ensure_future(self._stub(address).Abort(decode_pb2.AbortRequest(request_id=request_id),
                                                                   timeout=ABORT_TIMEOUT_S))
            self._aborts.add(task)
            task.add_done_callback(self._forget)

        reservation.add_done_callback(abort)  # runs at once (soon) when already done

    def _forget(self, task: asyncio.Future) -> None:
        self._aborts.discard(task)
        if not task.cancelled():
            task.exception()  # a failed Abort leaves the lease to expire; nothing to do here

    async def close(self) -> None:
        if self._aborts:
            await asyncio.gather(*self._aborts, return_exceptions=True)
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()
