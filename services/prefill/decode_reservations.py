"""Reserving pages on decode workers from prefill, for targets that name no reservation.

The Reserve call is made once the prompt's first token is out, so its round trip
costs the first token nothing (the page write waits for it instead). A reservation
that is not handed on (the call failed or was cancelled) is aborted again once its
Reserve has answered, so it never waits out its lease.
"""
from __future__ import annotations

import asyncio

import grpc

from protos import decode_pb2, decode_pb2_grpc
from services.common.channel import make_channel

RESERVE_TIMEOUT_S = 10.0
ABORT_TIMEOUT_S = 5.0


class DecodeReservations:
    """Channels to decode workers, one per address, kept for the service's life."""

    def __init__(self, max_message_bytes: int | None = None) -> None:
        self.max_message_bytes = max_message_bytes
        self._stubs: dict[str, tuple[grpc.aio.Channel, decode_pb2_grpc.DecodeStub]] = {}
        self._aborts: set[asyncio.Future] = set()

    def _stub(self, address: str) -> decode_pb2_grpc.DecodeStub:
        if address not in self._stubs:
            channel = make_channel(address) if self.max_message_bytes is None \
                else make_channel(address, self.max_message_bytes)
            self._stubs[address] = (channel, decode_pb2_grpc.DecodeStub(channel))
        return self._stubs[address][1]

    def reserve(self, address: str, request_id: str, num_tokens: int) -> asyncio.Future:
        """The Reserve call, started now; await it for the `decode_pb2.Reservation`."""
        return asyncio.ensure_future(self._stub(address).Reserve(
            decode_pb2.ReserveRequest(request_id=request_id, num_tokens=num_tokens), timeout=RESERVE_TIMEOUT_S))

    def abort_after(self, reservation: asyncio.Future, address: str, request_id: str) -> None:
        """Abort `request_id` on the decode worker once its Reserve has answered. Not
        sooner, and the Reserve is not cancelled: one cancelled in flight may still land
        after an Abort that found nothing, and hold its pages until the lease expires."""
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
