"""`baton kv-events`: a worker's KV events (--kv-events-config) as a router written for vLLM reads
them, one JSON line per batch ({"seq", "ts", "events", "data_parallel_rank"}), for an operator to
see what a worker tells a KV-aware router. With --replay, what the worker still keeps from batch 0
comes first, and a gap in the sequence numbers (batches the SUB socket missed) is filled from the
replay socket before the batch after it is printed, so every batch is printed once, in order."""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

END_OF_REPLAY = -1
DESCRIPTION = ("Print a prefill or decode worker's KV events (published with --kv-events-config) as JSON lines, "
               "one per batch, in order: what a KV-aware router written for vLLM reads.")


def add_kv_events_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", required=True, help="the worker's PUB endpoint, e.g. tcp://127.0.0.1:5557")
    parser.add_argument("--replay", metavar="ENDPOINT", help="its replay endpoint, e.g. tcp://127.0.0.1:5558: "
                                                             "start from batch 0 and fill gaps")
    parser.add_argument("--topic", default="", help="the topic subscribed to (default: every one)")
    parser.add_argument("--count", type=int, help="stop after this many batches (default: never)")
    parser.add_argument("--idle-timeout", type=float, metavar="S", help="stop after S seconds without a batch")


class Subscriber:
    def __init__(self, endpoint: str, replay: str | None, topic: str = "") -> None:
        import zmq

        self.zmq = zmq
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.replay_endpoint = replay
        self.next_seq = 0 if replay else None  # the next one to print; None: whatever comes first

    def batches(self, idle_timeout_s: float | None = None) -> Iterator[dict[str, Any]]:
        """Every batch, in order, each once."""
        import msgspec

        if self.replay_endpoint is not None:
            time.sleep(0.2)  # connected before asking, so nothing falls between the replay and the stream
            yield from self._replayed(self.next_seq)
        last = time.monotonic()
        while idle_timeout_s is None or time.monotonic() - last < idle_timeout_s:
            if not self.sub.poll(100):
                continue
            _, seq_bytes, payload = self.sub.recv_multipart()
            seq, last = int.from_bytes(seq_bytes, "big"), time.monotonic()
            if self.next_seq is not None and seq < self.next_seq:
                continue  # had it from the replay
            if self.next_seq is not None and seq > self.next_seq and self.replay_endpoint is not None:
                yield from self._replayed(self.next_seq, stop=seq)
            self.next_seq = seq + 1
            yield {"seq": seq, **msgspec.msgpack.decode(payload)}

    def _replayed(self, first: int, stop: int | None = None) -> Iterator[dict[str, Any]]:
        import msgspec

        asker = self.context.socket(self.zmq.DEALER)
        asker.connect(self.replay_endpoint)
        asker.send_multipart((b"", first.to_bytes(8, "big")))
        try:
            while asker.poll(10_000):
                _, seq_bytes, payload = asker.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_OF_REPLAY:
                    return
                if stop is None or seq < stop:
                    self.next_seq = seq + 1
                    yield {"seq": seq, **msgspec.msgpack.decode(payload)}
            raise TimeoutError(f"no answer from the replay socket {self.replay_endpoint}")
        finally:
            asker.close(linger=0)

    def close(self) -> None:
        self.context.destroy(linger=0)


def kv_events_command(args: argparse.Namespace) -> int:
    subscriber = Subscriber(args.endpoint, args.replay, args.topic)
    try:
        for n, batch in enumerate(subscriber.batches(args.idle_timeout), 1):
            print(json.dumps(batch), flush=True)
            if args.count is not None and n >= args.count:
                break
    except KeyboardInterrupt:
        pass
    except TimeoutError as e:
        print(f"baton kv-events: {e}", file=sys.stderr)
        return 1
    finally:
        subscriber.close()
    return 0
