"""Protobuf ↔ engine types for the decode service (only here and in the servicer)."""
from __future__ import annotations

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.spec_decode_stats import SpecDecodeStats
from protos import decode_pb2
from services.common.converters import FINISH_REASONS, prompt_logprobs_to_proto, top_logprobs


def chunk_from_output(out: RequestOutput, params: SamplingParams) -> decode_pb2.DecodeChunk:
    chunk = decode_pb2.DecodeChunk(token_ids=out.new_token_ids,
                                   finish_reason=FINISH_REASONS[out.finish_reason if out.finished else None])
    if params.logprobs is not None:
        chunk.logprobs.extend(top_logprobs(t, lp, params.logprobs, params.logprob_token_ids)
                              for t, lp in zip(out.new_token_ids, out.new_logprobs))
    if out.spec_decode is not None:  # its last output, when the engine keeps them per request
        chunk.spec_decode.CopyFrom(spec_decode_to_proto(out.spec_decode))
    if out.prompt_logprobs is not None:  # a local prefill's first output, asked for
        chunk.prompt_logprobs.extend(prompt_logprobs_to_proto(out.prompt_token_ids, out.prompt_logprobs,
                                                              params.prompt_logprobs, params.logprob_token_ids))
    return chunk


def spec_decode_to_proto(stats: SpecDecodeStats) -> decode_pb2.SpecDecodeStats:
    made = decode_pb2.SpecDecodeStats(num_spec_tokens=stats.num_spec_tokens, rows=[
        decode_pb2.SpecDecodeRow(num_drafted=k, num_steps=row) for k, row in sorted(stats.rows.items())])
    for drafted, accepted in stats.per_step or ():
        made.per_step_drafted.append(drafted)
        made.per_step_accepted.append(accepted)
    return made
