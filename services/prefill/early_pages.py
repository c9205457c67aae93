"""A long prompt's KV pages sent to its decode worker by the gRPC stream while the rest of it computes,
as Mooncake and Dynamo send a prompt's KV layer by layer: the transfer then overlaps the prefill
instead of following it, and the decode worker starts sooner after the first token.

Used for a prompt computed in several chunks (the engine reports each chunk's whole pages:
`ComputedPages`) whose pages go by GRPC_STREAM (another host's decode worker). After its first chunk
the pages are reserved on the decode worker (where the target names no reservation yet), and each
chunk's pages are written as the next computes; the handoff then writes only the pages computed
last. Each chunk written renews the reservation's lease on the decode worker.

The pages written so far count only if the prompt was never preempted since: a preemption frees
them (a copy in flight may then read pages given to another request), so the handoff writes them
all again. (A prompt gets all its pages when admitted, so on a prefill worker only a pause that
retracts running requests, SGLang's pause_generation "retract", preempts one.) Any failure here
(a reservation refused, a write refused) stops the early writes and is reported by the handoff's
own reservation or write, which meets it again.
"""
from __future__ import annotations

import asyncio
import logging

from engine.outputs import ComputedPages
from protos import prefill_pb2
from services.kvstore.transport import PageTransport, TransportKind
from services.prefill.converters import destination_from_proto, reserved_target, transport_from_proto
from services.prefill.decode_reservations import DecodeReservations
from services.prefill.kv_writer import KVWriter

log = logging.getLogger("baton.prefill")


class EarlyPages:
    """`reserve`: starts the Reserve call on the target's decode worker (None where the target names a
    reservation already); `num_blocks`: the pages the handoff writes."""

    def __init__(self, writer: KVWriter, request_id: str, target: prefill_pb2.KVTarget, num_blocks: int,
                 reserve=None) -> None:
        self._writer = writer
        self._request_id = request_id
        self._target = target
        self._num_blocks = num_blocks
        self._reserve = reserve
        self.reservation: asyncio.Future | None = None  # the Reserve call made here, once made
        self._computed: list[int] = []
        self._num_preemptions: int | None = None
        self._more = asyncio.Event()
        self._is_settling = self._is_stale = False
        self._sending: asyncio.Task | None = None
        self.num_sent = 0  # the leading pages written into the reservation
        self.num_bytes = 0

    def computed(self, pages: ComputedPages) -> None:
        """The engine's report after a chunk: from the first, the pages go out as they come."""
        if self._num_preemptions is None:
            self._num_preemptions = pages.num_preemptions
            if self._reserve is not None:
                self.reservation = self._reserve()
            self._sending = asyncio.ensure_future(self._send())
        if pages.num_preemptions != self._num_preemptions:
            self._is_stale = True
        self._computed = pages.block_ids[:self._num_blocks]
        self._more.set()

    async def settle(self, num_preemptions: int) -> int:
        """After the prompt's last chunk: the writes in flight done, how many leading pages are in the
        reservation for the handoff to leave out (0: write them all)."""
        if self._sending is None:
            return 0
        self._is_settling = True
        self._more.set()
        await asyncio.shield(self._sending)
        if self._is_stale or num_preemptions != self._num_preemptions:
            self.num_sent = self.num_bytes = 0
        return self.num_sent

    def cancel(self) -> None:
        """The call ended otherwise: no more writes."""
        if self._sending is not None:
            self._sending.cancel()

    async def _send(self) -> None:
        try:
            target = self._target
            if self.reservation is not None:
                target = reserved_target(target, await asyncio.shield(self.reservation))
            dest = destination_from_proto(target, self._num_blocks)
            transport = self._writer.open(dest, TransportKind.GRPC_STREAM)
            # Settling, the write in flight ends it: the handoff sends the rest in one stream.
            while not (self._is_stale or self._is_settling):
                blocks = self._computed[self.num_sent:]
                if not blocks:
                    await self._more.wait()
                    self._more.clear()
                    continue
                self.num_bytes += await self._writer.write(transport, self._request_id, blocks, dest,
                                                           start=self.num_sent)
                self.num_sent += len(blocks)
        except Exception as e:  # the handoff's own reservation or write meets it again and reports it
            log.debug("request %s: pages sent while computing stopped: %r", self._request_id, e)
            self._is_stale = True  # the handoff writes every page


class EarlySending:
    """Which prompts send their pages early: where the worker does (`is_enabled`), the pages go by the
    gRPC stream (the transport opened on the target's reservation, else the target's, else the one
    its decode worker's pages last went by: a worker's host does not change) and the first token
    will not end the request."""

    def __init__(self, is_enabled: bool, writer: KVWriter, reservations: DecodeReservations,
                 block_size: int) -> None:
        self.is_enabled = is_enabled
        self._writer = writer
        self._reservations = reservations
        self._block_size = block_size
        self._transport_by_decode: dict[str, TransportKind] = {}

    def handed_over(self, decode_address: str, kind: TransportKind) -> None:
        self._transport_by_decode[decode_address] = kind

    def pages_for(self, request_id: str, target: prefill_pb2.KVTarget, num_tokens: int, max_new_tokens: int,
                  transport: PageTransport | None) -> EarlyPages | None:
        """The request's EarlyPages, or None where it sends none early."""
        if not self.is_enabled or max_new_tokens <= 1:
            return None
        try:
            kind = transport.kind if transport is not None else \
                transport_from_proto(target.transport) or self._transport_by_decode.get(target.decode_address)
        except ValueError:  # not a transport: the handoff refuses it
            return None
        if kind is not TransportKind.GRPC_STREAM:
            return None
        reserve = None if target.reservation_id else \
            (lambda: self._reservations.reserve(target.decode_address, request_id, num_tokens,
                                                may_wait=not target.reserve_at_once))
        return EarlyPages(self._writer, request_id, target, -(-num_tokens // self._block_size), reserve)

