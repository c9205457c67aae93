"""The first token's PrefillTimings, from the call's arrival and the engine thread's stamps.

`queue_seconds` runs from the call's arrival until the engine's first step
with the request began (validation, reading from the host tier, waiting out the step in
progress or for a batch slot), `host_tier_read_seconds` is the part spent reading from
the host tier and `admit_seconds` the part in the engine's `add_request`; `prefill_seconds`
from then until the end of the step that sampled the first token. The engine thread stamps
the last two: with them, what a caller of an in-process engine waits for its first token
(the hand-offs between this call and the engine thread are not in them).
"""
from __future__ import annotations


def first_token_timings(times, arrival_ns: int, arrival: float, computed: float,
                        host_tier_read_seconds: float) -> dict[str, float]:
    """PrefillTimings' fields for the first token, by the engine thread's stamps: queue (of which
    the host tier's read and admit, its `add_request`) and prefill; for a request no step ran (it
    finished outside one), all of it is queue."""
    admit = prefill = 0.0
    if times is not None and times.admit_ns is not None:
        admit = (times.admit_ns[1] - times.admit_ns[0]) / 1e9
    if times is None or times.first_step_start_ns is None:
        queue = computed - arrival
    else:
        first_token_ns = times.prefill_chunks[-1].end_ns if times.prefill_chunks else times.first_step_end_ns
        queue = (times.first_step_start_ns - arrival_ns) / 1e9
        prefill = (first_token_ns - times.first_step_start_ns) / 1e9
    return {"queue_seconds": queue, "admit_seconds": admit, "prefill_seconds": prefill,
            "host_tier_read_seconds": host_tier_read_seconds}
