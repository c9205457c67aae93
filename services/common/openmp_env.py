"""GNU OpenMP's busy-wait for a worker process: imported before torch, which loads OpenMP,
and OpenMP reads it once, then.

After a parallel region an OpenMP thread spins GOMP_SPINCOUNT times (300,000 by default:
milliseconds) for the next one before it sleeps. Within a forward pass, whose regions are
microseconds apart, the spin saves a wake-up per region; after a step's last region the
spinning thread holds a core while the worker's event loop sends the first token on. With
the engine thread the process's only OpenMP team (services/common/engine_loop.py), the
mesh's overhead per request (bench/mesh_overhead.py) rose by about 0.4 ms with the default
count and did not with 10,000 spins, a fraction of a millisecond here. An operator's own
GOMP_SPINCOUNT is kept.
"""
import os

SPIN_COUNT = 10_000

os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))
