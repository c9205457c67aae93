"""SGLang's `GET /get_server_info` (and `/server_info`, its newer name): what the mesh serves and how,
named as SGLang names it for one server, with each prefill and decode worker's scheduler in
`internal_states` (SGLang's list, one entry per data-parallel scheduler; here one per worker, with its
kind, address, limits and what it holds now). Tools read it to find out that an SGLang server answers
and what its limits are: sglang.bench_serving reads `avg_spec_accept_length`, scripts
`max_total_num_tokens` and `max_running_requests`. `GET /get_load` is SGLang's load probe, one
entry per worker (its `dp_rank` its place in the list): requests running and waiting, and the tokens
their KV takes; `GET /load` is vLLM's, `{"server_load": N}`: the requests the gateway holds now.

The mesh's limits are its decode workers', where generation runs and KV is held for it:
`max_total_num_tokens` and `max_running_requests` are summed over them; `chunked_prefill_size` is the
step of the first prefill worker (of a decode worker, colocated). A worker that does not answer is
listed with its error, and counts for nothing.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from protos import scheduler_pb2, scheduler_pb2_grpc
from services.common.converters import MEMORY_KINDS
from services.gateway.generation_pause import GenerationPause
from services.gateway.weight_updates import WeightUpdates
from services.gateway.workers import Worker, WorkerPool

DESCRIBE_TIMEOUT_S = 5.0
# SGLang's --speculative-algorithm names of a decode worker's speculative method (its own where SGLang has none).
SGLANG_ALGORITHMS = {"ngram": "NGRAM", "draft_model": "STANDALONE", "eagle": "EAGLE", "eagle3": "EAGLE3",
                     "mtp": "NEXTN"}


Described = tuple[str, Worker, scheduler_pb2.SchedulerInfo | BaseException]


async def _described(pools: Sequence[WorkerPool]) -> list[Described]:
    """Each worker's kind, itself and its scheduler's answer (or why there is none), asked all at once."""
    workers = [(pool.kind, worker) for pool in pools for worker in pool.workers]
    infos = await asyncio.gather(*(scheduler_pb2_grpc.SchedulerStub(worker.channel).Describe(
        scheduler_pb2.DescribeRequest(), timeout=DESCRIBE_TIMEOUT_S) for _, worker in workers), return_exceptions=True)
    return [(kind, worker, info) for (kind, worker), info in zip(workers, infos, strict=True)]


def _error(error: BaseException) -> str:
    return error.details() if isinstance(error, grpc.aio.AioRpcError) else repr(error)


def _state(kind: str, worker: Worker, info: scheduler_pb2.SchedulerInfo | BaseException) -> dict[str, Any]:
    state: dict[str, Any] = {"kind": kind, "address": worker.address, "is_serving": worker.is_serving,
                             "num_in_flight": worker.num_in_flight}
    if isinstance(info, BaseException):
        return {**state, "error": _error(info)}
    state.update(model_path=info.model, dtype=info.dtype, kv_cache_dtype=info.kv_cache_dtype,
                 page_size=info.block_size, max_total_num_tokens=info.num_kv_blocks * info.block_size,
                 num_free_tokens=info.num_free_blocks * info.block_size, max_running_requests=info.max_num_seqs,
                 chunked_prefill_size=info.max_num_batched_tokens, context_length=info.max_model_len,
                 schedule_policy=info.scheduling_policy, disable_radix_cache=not info.enable_prefix_caching,
                 num_running_reqs=info.num_running, num_waiting_reqs=info.num_waiting, is_paused=info.is_paused,
                 num_preemptions=info.num_preemptions,
                 released_memory=[MEMORY_KINDS[kind] for kind in info.released_memory])
    if info.num_speculative_tokens:
        # SGLang's: tokens a verifying step yields, the one the target samples itself included; its algorithm's name.
        state.update(speculative_algorithm=SGLANG_ALGORITHMS.get(info.speculative_method, info.speculative_method),
                     speculative_num_draft_tokens=info.num_speculative_tokens,
                     avg_spec_accept_length=(1 + info.num_accepted_tokens / info.num_drafts) if info.num_drafts
                     else None)
    return state


async def server_info(state, pools: Sequence[WorkerPool], weights: WeightUpdates,
                      generation: GenerationPause, version: str) -> dict[str, Any]:
    """`state`: the gateway's (http_app.GatewayState)."""
    states = [_state(kind, worker, info) for kind, worker, info in await _described(pools)]
    answered = [s for s in states if "error" not in s]
    decoding = [s for s in answered if s["kind"] == "decode"]
    stepping = [s for s in answered if s["kind"] == "prefill"] or decoding
    first = (stepping or [{}])[0]
    return {
        "model_path": state.model_name, "tokenizer_path": state.model_name, "served_model_name": state.model_name,
        "context_length": state.max_model_len, "version": version, "weight_version": weights.weight_version,
        "disaggregation_mode": "prefill-decode" if state.pipeline.prefill is not None else "null",
        "page_size": first.get("page_size"), "dtype": first.get("dtype"), "kv_cache_dtype": first.get("kv_cache_dtype"),
        "schedule_policy": first.get("schedule_policy"), "chunked_prefill_size": first.get("chunked_prefill_size"),
        "max_total_num_tokens": sum(s["max_total_num_tokens"] for s in decoding),
        "max_running_requests": sum(s["max_running_requests"] for s in decoding),
        "generation_paused": generation.mode,
        "internal_states": states,
    }


async def loads(pools: Sequence[WorkerPool]) -> list[dict[str, Any]]:
    answer = []
    for rank, (kind, worker, info) in enumerate(await _described(pools)):
        load: dict[str, Any] = {"dp_rank": rank, "kind": kind, "address": worker.address}
        if isinstance(info, BaseException):
            load["error"] = _error(info)
        else:
            load.update(num_reqs=info.num_running + info.num_waiting, num_waiting_reqs=info.num_waiting,
                        num_tokens=(info.num_kv_blocks - info.num_free_blocks) * info.block_size)
        answer.append(load)
    return answer


def add_server_info_routes(app: FastAPI, state, pools: Sequence[WorkerPool], weights: WeightUpdates,
                           generation: GenerationPause, version: str) -> None:
    async def get_server_info(request: Request) -> JSONResponse:
        return JSONResponse(await server_info(state, pools, weights, generation, version))

    async def get_load(request: Request) -> JSONResponse:
        return JSONResponse(await loads(pools))

    async def server_load(request: Request) -> JSONResponse:
        return JSONResponse({"server_load": state.pipeline.num_requests})

    for path in ("/get_server_info", "/server_info"):
        app.add_route(path, get_server_info, methods=["GET"])
    app.add_route("/get_load", get_load, methods=["GET"])
    app.add_route("/load", server_load, methods=["GET"])
