"""gRPC core's I/O path for a Baton service: imported first by every service's `__main__` (and
given to bench/hop_floor.py's processes), before anything imports grpc, which reads
GRPC_EXPERIMENTS once, as it starts.

grpcio 1.85 moves a connection's bytes on its EventEngine: a poller thread of its own reads
the socket and hands each event to a worker thread, which completes the call on the
completion queue that grpc.aio's own poller thread reads, which then wakes the event loop.
Each hand-off is a thread waking, and in a service idle between requests, a core waking
too. With the EventEngine's client and listener turned off (`-event_engine_client`,
`-event_engine_listener`: gRPC's documented switches for its experiments) the thread that
reads the completion queue polls the sockets itself: fewer hand-offs on every message in and
out. bench/mesh_overhead.py, four runs each: the mesh's overhead per request 2.35-2.51 ms
against 2.73-2.76 ms, 2.09-2.15 round trips against 2.21-2.31 (the unit, a round trip into
the gateway, got faster too: 1.12-1.20 ms against 1.20-1.25). Turning more of the
EventEngine off (its callback completion queue, its other endpoints) added nothing.

An operator's own GRPC_EXPERIMENTS is kept. The names are grpcio 1.85's (pinned);
tests/services/test_grpc_env.py checks that the pinned grpcio still knows them.
"""
import os

VARIABLE = "GRPC_EXPERIMENTS"
EXPERIMENTS = "-event_engine_client,-event_engine_listener"

os.environ.setdefault(VARIABLE, EXPERIMENTS)
