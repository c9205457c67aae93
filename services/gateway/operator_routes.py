"""The routes an operator or an RL loop drives the mesh with, beside the APIs that generate: LoRA
adapters loaded at run time, prefix caches reset, profiles, SGLang's native API and its weight
updates, pauses, memory released and resumed, server info, and request logging (each module's own
docstring says what its routes do)."""
from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI

from services.gateway.generation_pause import GenerationPause, add_generation_pause_routes
from services.gateway.idle_sleep import IdleSleep
from services.gateway.lora_updates import add_lora_update_routes
from services.gateway.memory_release_api import MeshMemory, add_memory_release_routes
from services.gateway.prefix_cache_api import add_prefix_cache_routes
from services.gateway.profile_api import add_profile_routes
from services.gateway.request_log import add_request_log_routes
from services.gateway.server_info import add_server_info_routes
from services.gateway.sglang_api import add_sglang_routes
from services.gateway.weight_updates import WeightUpdates, add_weight_update_routes


def add_operator_routes(app: FastAPI, state, check_model: Callable[[str], str | None], version: str) -> None:
    """`state`: the gateway's (http_app.GatewayState); `check_model`: a named model's LoRA adapter, or a
    404; `version`: Baton's, as /version answers it."""
    if state.lora_updates is not None:
        add_lora_update_routes(app, state.lora_updates)
    pools = [pool for pool in (state.pipeline.prefill, state.pipeline.decode) if pool is not None]
    add_prefix_cache_routes(app, pools)
    add_profile_routes(app, pools)
    generation = GenerationPause(state.pipeline, pools)
    weight_updates = WeightUpdates(state.pipeline, pools, generation)
    add_sglang_routes(app, state, check_model, weight_updates)
    add_weight_update_routes(app, weight_updates)
    add_generation_pause_routes(app, generation)
    memory = MeshMemory(state.pipeline, pools)
    add_memory_release_routes(app, memory)
    if state.sleep_when_idle.ttl_s > 0:
        state.idle_sleep = IdleSleep(memory, state.sleep_when_idle)
    add_server_info_routes(app, state, pools, weight_updates, generation, version)
    add_request_log_routes(app, state.pipeline.request_log)
