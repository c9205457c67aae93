"""What a decode worker's KV pool can hold of one request, learnt from its Describe as it turns SERVING.

A pool smaller than the model's context cannot hold every request the context allows. Its decode
worker refuses one that needs more (engine/admission.py: prompt + max_tokens over the pool), but only
at its Decode: after a prefill worker has computed the prompt, reserved pages, written them, and after
a streamed reply's first token went out. Known here, such a request is refused (400) before any of
that, in the decode worker's own words, and routing prefers a decode worker whose pool holds it. A request
that gave no max_tokens is cut to what the pool leaves instead, as SGLang caps max_new_tokens by its pool.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc

from engine.sampling_params import SamplingParams as EngineSamplingParams
from protos import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.gateway.request_errors import InvalidRequestError
from services.gateway.workers import Worker

log = logging.getLogger("baton.gateway")

DESCRIBE_TIMEOUT_S = 5.0


async def learn_kv_capacity(worker: Worker) -> None:
    """Sets `worker.kv_capacity_tokens` from its Describe (a WorkerPool `before_serving` call). A worker
    that does not answer stays in routing, its pool unknown: its own check still refuses what it cannot hold."""
    try:
        info = await scheduler_pb2_grpc.SchedulerStub(worker.channel).Describe(scheduler_pb2.DescribeRequest(),
                                                                              timeout=DESCRIBE_TIMEOUT_S)
    except grpc.aio.AioRpcError as e:
        log.warning("decode worker %s did not describe its KV pool (%s); requests too large for it are refused "
                    "by the worker itself, after their prefill", worker.address, e.code().name)
        return
    capacity = info.num_kv_blocks * info.block_size
    # A pool holding the whole context holds every request the context check lets through.
    worker.kv_capacity_tokens = capacity if capacity < info.max_model_len else None


def kv_tokens_needed(prompt: Sequence[int], params: common_pb2.SamplingParams, is_max_tokens_given: bool) -> int:
    """The fewest tokens of KV a request can be served in: its prompt and every token it may generate, or,
    where it gave no max_tokens (the context check filled in what the context leaves), its prompt and one."""
    if not is_max_tokens_given:
        return len(prompt) + 1
    return len(prompt) + (params.max_tokens if params.HasField("max_tokens") else EngineSamplingParams.max_tokens)


def fit_kv_pool(worker: Worker, prompt: Sequence[int], params: common_pb2.SamplingParams,
                is_max_tokens_given: bool) -> None:
    """Where `worker`'s pool is known to hold fewer tokens than the request may need: a request that gave no
    max_tokens is cut to what the pool leaves after its prompt (as SGLang caps max_new_tokens by its pool);
    one that did, or whose prompt leaves no room, is refused (InvalidRequestError, in the decode worker's own
    words: routing picked `worker` among those that hold it, so none known does)."""
    capacity = worker.kv_capacity_tokens
    if capacity is None:
        return
    max_tokens = params.max_tokens if params.HasField("max_tokens") else EngineSamplingParams.max_tokens
    if len(prompt) + max_tokens <= capacity:
        return
    needed = kv_tokens_needed(prompt, params, is_max_tokens_given)
    if needed > capacity:
        raise InvalidRequestError(f"request needs up to {needed} tokens of KV, more than the pool's {capacity}")
    params.max_tokens = capacity - len(prompt)
    if params.min_tokens > params.max_tokens:
        raise InvalidRequestError(f"min_tokens ({params.min_tokens}) must not be more than the {params.max_tokens} "
                                  f"tokens the KV pool ({capacity}) leaves after the prompt", param="min_tokens")
