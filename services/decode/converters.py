"""Protobuf ↔ engine types for the decode service (only here and in the servicer)."""
from __future__ import annotations

from engine.outputs import RequestOutput
from protos import decode_pb2
from services.common.converters import FINISH_REASONS, top_logprobs


def chunk_from_output(out: RequestOutput, num_logprobs: int | None) -> decode_pb2.DecodeChunk:
    chunk = decode_pb2.DecodeChunk(token_ids=out.new_token_ids,
                                   finish_reason=FINISH_REASONS[out.finish_reason if out.finished else None])
    if num_logprobs is not None:
        chunk.logprobs.extend(top_logprobs(t, lp, num_logprobs)
                              for t, lp in zip(out.new_token_ids, out.new_logprobs))
    return chunk
