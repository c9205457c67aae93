"""SGLang's native embeddings, `POST /encode`: `text` or `input_ids` (one prompt, or a batch), each
computed as `/v1/embeddings` computes it (embeddings_api.py: the last token's hidden state,
L2-normalized, as SGLang's embedding models give it; `dimensions` keeps its first N numbers) and
answered as SGLang does: `{"embedding", "meta_info": {"id", "prompt_tokens", "e2e_latency"}}` for one
prompt, a list of them for a batch. `rid` names each prompt's, `lora_path` a served adapter;
`sampling_params`, which SGLang's clients send along, sample nothing here as there.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from services.gateway.embeddings_api import EmbeddingRequest, embeddings
from services.gateway.http_body import parsed_body
from services.gateway.http_responses import ClientDisconnected, unless_disconnected
from services.gateway.sglang_protocol import SGLangInput


class EncodeRequest(SGLangInput):
    """POST /encode's body (SGLang's EmbeddingReqInput, the fields served here)."""

    dimensions: Annotated[int, Field(ge=1)] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    log_metrics: bool = True


def add_sglang_encode_route(app: FastAPI, state, check_model: Callable[[str], str | None]) -> None:
    """`state`: the gateway's (http_app.GatewayState); `check_model`: a name's LoRA adapter, or a 404."""
    pipeline = state.pipeline

    async def encode(request: Request) -> JSONResponse:
        started = time.perf_counter()
        body = await parsed_body(request, EncodeRequest)
        lora = check_model(body.lora_path) if body.lora_path is not None else None
        prompts = body.prompts()
        rids = body.rids(len(prompts), "embd")

        async def embedded(prompt: str | list[int], rid: str) -> dict[str, Any]:
            asked = EmbeddingRequest(model=state.model_name, input=prompt, dimensions=body.dimensions)
            [reply], num_tokens = await embeddings(pipeline, asked, lora, rid, state.max_model_len)
            return {"embedding": list(reply.embedding), "meta_info": {
                "id": rid, "prompt_tokens": num_tokens, "e2e_latency": round(time.perf_counter() - started, 6)}}
        try:
            answers = await unless_disconnected(request, asyncio.gather(*map(embedded, prompts, rids)))
        except ClientDisconnected:
            return JSONResponse({}, status_code=499)  # nobody reads it
        pipeline.pooling.observe("encode", len(answers), sum(a["meta_info"]["prompt_tokens"] for a in answers),
                                 time.perf_counter() - started)
        return JSONResponse(answers if body.is_batch else answers[0])

    app.add_route("/encode", encode, methods=["POST", "PUT"])  # SGLang's server takes either
