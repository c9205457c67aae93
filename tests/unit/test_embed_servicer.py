"""The bound a worker checks a per-token answer against before computing it (services/common/
embed_servicer.py): never below the answer's real size, so an answer it lets through is never
refused by gRPC's message limit in the sending, and not far above it."""
from __future__ import annotations

import random

import pytest

from protos import embed_pb2
from services.common.embed_servicer import per_token_answer_bytes


@pytest.mark.parametrize(("num_tokens", "width", "labels"), [
    (1, 1, ()), (7, 3, ("negative", "neutral", "positive")), (300, 64, ()), (2, 40_000, ()), (5, 1, ("LABEL_0",)),
])
def test_the_bound_holds_the_answer_and_little_more(num_tokens, width, labels):
    rows = [[random.uniform(-1e6, 1e6) for _ in range(width)] for _ in range(num_tokens)]
    answer = embed_pb2.EmbedResponse(tokens=[embed_pb2.Vector(values=row) for row in rows], labels=labels)
    bound = per_token_answer_bytes(num_tokens, width, labels)
    assert answer.ByteSize() <= bound <= answer.ByteSize() + 12 * num_tokens + 6 * len(labels)
