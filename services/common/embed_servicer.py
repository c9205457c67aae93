"""The Embeddings service of a prefill or decode worker (protos/embed.proto): a token sequence's
embedding, computed by the worker's engine in its batches (SamplingParams.embed: the last hidden
state at the sequence's last token), cut to `dimensions` and normalized here, or a sequence
classifier's probabilities over its labels from it; with `per_token`, each prompt token's
(SamplingParams.embed_tokens). A call cancelled before its embedding is out aborts its request in
the engine."""
from __future__ import annotations

from collections.abc import Sequence

import grpc
import torch

from engine.sampling_params import SamplingParams
from protos import embed_pb2, embed_pb2_grpc
from services.common.engine_errors import EngineDeadError
from services.common.engine_loop import EngineLoop
from services.common.limits import DEFAULT_MAX_MESSAGE_BYTES
from services.common.request_outputs import RequestRefusedError, finished

SERVICE_NAME = embed_pb2.DESCRIPTOR.services_by_name["Embeddings"].full_name


class EmbeddingsServicer(embed_pb2_grpc.EmbeddingsServicer):
    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.engine_loop: EngineLoop | None = None  # once the engine is loaded and warm
        self.max_message_bytes = max_message_bytes  # what a per-token answer must fit in

    async def Embed(self, request: embed_pb2.EmbedRequest, context) -> embed_pb2.EmbedResponse:
        engine_loop = self.engine_loop
        if engine_loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        if not request.token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "token_ids must not be empty")
        model_config = engine_loop.engine.model_config
        model = engine_loop.engine.runner.model
        if request.classify and getattr(model, "classifier", None) is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "the model has no classification head (a *ForSequenceClassification checkpoint has "
                                "one)")
        if request.per_token and request.classify and engine_loop.engine.is_encoder:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "the model's classification head pools its [CLS] token: it classifies sequences, "
                                "not tokens")
        hidden_size = model_config.hidden_size
        if request.dimensions > hidden_size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"dimensions must be at most the model's hidden size, {hidden_size}; "
                                f"got {request.dimensions}")
        if request.per_token:
            labels = model_config.labels if request.classify else ()
            width = len(labels) if request.classify else request.dimensions or hidden_size
            size = per_token_answer_bytes(len(request.token_ids), width, labels)
            if size > self.max_message_bytes:  # refused before computing, not failed in the sending
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"an answer of {len(request.token_ids)} tokens of {width} numbers each is "
                                    f"up to {size} bytes, over the largest gRPC message of {self.max_message_bytes} "
                                    "(--max-message-bytes): a shorter input fits")
        params = SamplingParams(max_tokens=1, temperature=0.0, embed=True, embed_tokens=request.per_token,
                                lora_name=request.lora_name or None)
        try:
            outputs = engine_loop.add_request(request.request_id, list(request.token_ids), params)
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        is_done = False
        try:
            out = await finished(outputs)
            is_done = True
        except RequestRefusedError as e:
            is_done = True  # nothing was added
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDeadError as e:  # queued behind the step that failed: it never ran
            is_done = True
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except Exception as e:  # the step computing it failed
            is_done = True
            await context.abort(grpc.StatusCode.INTERNAL, f"the engine failed: {e}")
        finally:
            if not is_done:  # the caller went away (or the call was cancelled) before the embedding
                engine_loop.abort_soon(request.request_id)
        if out.embedding is None:
            await context.abort(grpc.StatusCode.ABORTED, f"request {request.request_id!r} was aborted")
        if request.per_token:
            rows = out.token_embeddings  # [P, H]
            rows = _probabilities(model.classify(rows)) if request.classify else \
                _shaped(rows, request.dimensions, request.normalize)
            return embed_pb2.EmbedResponse(tokens=[embed_pb2.Vector(values=row) for row in rows.tolist()],
                                           labels=labels)
        if request.classify:
            probs = _probabilities(model.classify(torch.tensor(out.embedding)))
            return embed_pb2.EmbedResponse(probs=probs.tolist(), labels=model_config.labels)
        embedding = _shaped(torch.tensor(out.embedding, dtype=torch.float32), request.dimensions, request.normalize)
        return embed_pb2.EmbedResponse(embedding=embedding.tolist())


def per_token_answer_bytes(num_tokens: int, width: int, labels: Sequence[str] = ()) -> int:
    """At most the bytes of an EmbedResponse of `num_tokens` Vectors of `width` floats and `labels`:
    each float 4, each Vector's packed field 1 tag and up to 5 of length, each Vector and label in
    the response as much again."""
    return num_tokens * (4 * width + 12) + sum(len(label.encode()) + 6 for label in labels)


def _shaped(embeddings: torch.Tensor, dimensions: int, normalize: bool) -> torch.Tensor:
    """Embeddings ([H], or [P, H] one a token) cut to their first `dimensions` (0: all), then normalized."""
    if dimensions:
        embeddings = embeddings[..., :dimensions]
    return torch.nn.functional.normalize(embeddings, dim=-1) if normalize else embeddings


def _probabilities(logits: torch.Tensor) -> torch.Tensor:
    """A classifier's logits ([L], or [P, L] one a token) made probabilities as vLLM makes them:
    softmax over the labels, sigmoid for a single one (a score)."""
    return logits.sigmoid() if logits.shape[-1] == 1 else logits.softmax(dim=-1)
