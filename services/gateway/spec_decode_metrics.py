"""A request's speculative steps (a decode worker's `SpecDecodeStats`) in vLLM's shape: the reply's
`metrics.speculative_decoding` with `--per-request-spec-decode-metrics summary` (or `detailed`, which
adds each step's drafted and accepted counts in order).

- `acceptance_histogram`: [j] the steps that accepted exactly j drafts (the bonus token left out),
  for j up to `num_spec_tokens`; `acceptance_histogram_by_draft_length`: the same per draft length
  proposed (keys are strings, as JSON's);
- `num_spec_steps`, `num_draft_tokens`, `num_accepted_draft_tokens`: their sums;
- `mean_acceptance_length`: 1 + accepted / steps, the tokens a step made; `draft_acceptance_rate`:
  accepted / drafted (both null for a request that never drafted).
"""
from __future__ import annotations

from typing import Any

from protos import decode_pb2


def speculative_decoding(stats: decode_pb2.SpecDecodeStats, is_detailed: bool) -> dict[str, Any]:
    histogram = [0] * (stats.num_spec_tokens + 1)
    by_length: dict[str, list[int]] = {}
    num_steps = num_drafted = num_accepted = 0
    for row in stats.rows:
        counts = list(row.num_steps)
        by_length[str(row.num_drafted)] = counts
        for accepted, count in enumerate(counts):
            histogram[accepted] += count
            num_steps += count
            num_drafted += row.num_drafted * count
            num_accepted += accepted * count
    made: dict[str, Any] = {
        "mean_acceptance_length": 1 + num_accepted / num_steps if num_steps else None,
        "draft_acceptance_rate": num_accepted / num_drafted if num_drafted else None,
        "acceptance_histogram": histogram, "acceptance_histogram_by_draft_length": by_length,
        "num_spec_steps": num_steps, "num_accepted_draft_tokens": num_accepted, "num_draft_tokens": num_drafted,
        "num_spec_tokens": stats.num_spec_tokens}
    if is_detailed:
        made.update(per_step_accepted=list(stats.per_step_accepted), per_step_drafted=list(stats.per_step_drafted))
    return made
