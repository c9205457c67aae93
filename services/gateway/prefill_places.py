"""Where a prompt is prefilled: on a prefill worker, or on its decode worker itself when the part of it
the decode worker does not hold is short (conditional disaggregation, as Dynamo does it); and how
many prompts went to each place."""
from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import Counter

from services.gateway.workers import Worker, WorkerPool

PREFILL_PLACES = Counter("baton_gateway_prefills_total",
                         "Prompts by where they were prefilled: on a prefill worker, or on the decode worker itself",
                         ["place"])
PREFILLED_ON = {"decode": PREFILL_PLACES.labels("decode"), "prefill": PREFILL_PLACES.labels("prefill")}


def prefills_locally(prompt: Sequence[int], decode_worker: Worker, num_cached: int, prefill: WorkerPool | None,
                     local_prefill_max_tokens: int) -> bool:
    """Conditional disaggregation: a prompt whose part the decode worker does not hold
    (`num_cached` tokens it does, per the prefix index) is this short is cheaper to prefill
    in the decode worker's running batch than on a prefill worker plus a KV transfer, as
    long as the decode worker is not already prefilling that much (its decode steps would
    stall). This short: `local_prefill_max_tokens`; `prefill`: the prefill workers
    (None: colocated, every prompt prefilled on its decode worker)."""
    if prefill is None:
        return True
    limit = local_prefill_max_tokens
    uncached = len(prompt) - num_cached
    return uncached <= limit and decode_worker.queued_tokens + uncached <= limit
