"""`KVEventPublisher`: a worker's prefix-cache changes (engine/kv_event_log.py) sent over ZeroMQ as
vLLM sends its KV events, so that a KV-aware router written for vLLM (NVIDIA Dynamo's, llm-d's)
follows a Baton worker unchanged.

The wire is vLLM's: each batch (one engine step's or command's changes) is a PUB message of three
frames, the topic, an 8-byte big-endian sequence number and the msgpack of a `KVEventBatch`
{ts, events, data_parallel_rank}, each event a map tagged by "type": `BlockStored` {block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name}, `BlockRemoved`
{block_hashes, medium} or `AllBlocksCleared`. A subscriber that missed batches (it sees a gap in
the sequence numbers) asks the replay socket, a ROUTER, with the first number it lacks; it is sent
every batch still kept from there, then the number -1 with an empty payload. Baton's first batch is
an `AllBlocksCleared` and a `BlockStored` of everything cached, so a subscriber that starts with the
worker needs nothing else.

The engine thread only queues a batch; this publisher's own thread encodes and sends it (ZeroMQ
sockets belong to the thread that made them). A batch that finds the queue full is dropped and
counted: the router then works from a stale copy, which costs cache hits, never correctness."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from engine.kv_event_log import AllBlocksCleared, KVEvent, RemovedBlocks, StoredBlocks
from services.common.engine_loop import EngineLoop
from services.common.entrypoint import StartError
from services.common.kv_events_config import KVEventsConfig
from services.common.metrics import ServiceMetrics
from services.common.metrics.collector import LabelledCollector

log = logging.getLogger("baton.kv_events")
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class _Event(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class _BlockStored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class _BlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class _AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


class _KVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[_BlockStored | _BlockRemoved | _AllBlocksCleared]
    data_parallel_rank: int | None = None


async def publish_kv_events(config: KVEventsConfig | None, engine_loop: EngineLoop, block_size: int,
                            on_gpu: bool, metrics: ServiceMetrics) -> KVEventPublisher | None:
    """A worker's publisher, handed its engine's changes from now on, and counted in `metrics`; None
    unless the config says to publish."""
    if config is None or not config.publishes:
        return None
    publisher = await asyncio.to_thread(KVEventPublisher, config, block_size, "GPU" if on_gpu else "CPU")
    metrics.registry.register(_PublisherCollector(publisher, metrics.labels))
    await engine_loop.publish_kv_events(publisher.publish)
    log.info("publishing KV events on %s%s", config.endpoint,
             f", replaying them on {config.replay_endpoint}" if config.replay_endpoint else "")
    return publisher


class KVEventPublisher:
    """`medium`: where the worker's pages are, as vLLM names it (GPU, CPU)."""

    def __init__(self, config: KVEventsConfig, block_size: int, medium: str) -> None:
        self.config = config
        self.block_size = block_size
        self.medium = medium
        self.num_dropped = 0  # batches the queue had no room for
        self.num_sent = 0  # batches sent (each one message, one sequence number)
        self._batches: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._bound = threading.Event()
        self._failure: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._bound.wait()
        if self._failure is not None:
            raise StartError(f"--kv-events-config: cannot open {config.endpoint} or its replay endpoint: "
                             f"{self._failure}")

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one batch (called on the engine thread: never blocks)."""
        try:
            self._batches.put_nowait((time.time(), events))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1:
                log.warning("KV events dropped: %d batches wait to be sent", self.config.max_queue_size)

    def close(self) -> None:
        """Send what is queued, then close the sockets."""
        self._batches.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        context = zmq.Context.instance()
        try:
            pub = context.socket(zmq.PUB)
            pub.set_hwm(self.config.hwm)
            _open(pub, self.config.endpoint)
            replay = None
            if self.config.replay_endpoint is not None:
                replay = context.socket(zmq.ROUTER)
                replay.bind(self.config.replay_endpoint)
        except zmq.ZMQError as e:
            self._failure = e
            self._bound.set()
            return
        self._bound.set()
        topic = self.config.topic.encode()
        kept: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        try:
            while True:
                if replay is not None and replay.poll(0):
                    _answer_replay(replay, kept)
                try:
                    batch = self._batches.get(timeout=0.05)
                except queue.Empty:
                    continue
                if batch is None:
                    return
                try:
                    payload = encoder.encode(self._on_wire(*batch))
                    pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                except (zmq.ZMQError, TypeError, OverflowError):  # one batch lost, not the publisher
                    log.exception("a batch of KV events could not be sent")
                    continue
                kept.append((seq, payload))
                seq += 1
                self.num_sent = seq
        finally:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _on_wire(self, ts: float, events: list[KVEvent]) -> _KVEventBatch:
        wire: list[_Event] = []
        for event in events:
            if isinstance(event, StoredBlocks):
                wire.append(_BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids,
                                         self.block_size, event.lora_id, self.medium, event.lora_name))
            elif isinstance(event, RemovedBlocks):
                wire.append(_BlockRemoved(event.block_hashes, self.medium))
            elif isinstance(event, AllBlocksCleared):
                wire.append(_AllBlocksCleared())
        return _KVEventBatch(ts, wire, 0)


class _PublisherCollector(LabelledCollector):
    """The publisher's counts, read when Prometheus scrapes."""

    def __init__(self, publisher: KVEventPublisher, labels) -> None:
        super().__init__(labels)
        self.publisher = publisher

    def collect(self):
        yield self.counter("baton_kv_events_batches_sent", "Batches of KV events published", self.publisher.num_sent)
        yield self.counter("baton_kv_events_batches_dropped", "Batches of KV events dropped, the queue to the "
                           "publisher full (a subscriber's copy of the cache is stale since)",
                           self.publisher.num_dropped)


def _open(socket: zmq.Socket, endpoint: str) -> None:
    """Bind where the endpoint names no host to reach (a wildcard, or ipc/inproc), as vLLM does; else connect."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        socket.bind(endpoint)
    else:
        socket.connect(endpoint)


def _answer_replay(replay: zmq.Socket, kept: deque[tuple[int, bytes]]) -> None:
    frames = replay.recv_multipart()
    if len(frames) != 3:
        log.warning("a KV events replay request of %d frames ignored (3 expected)", len(frames))
        return
    client, _, first = frames
    start = int.from_bytes(first, "big")
    for seq, payload in kept:
        if seq >= start:
            replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
    replay.send_multipart((client, b"", END_OF_REPLAY, b""))
