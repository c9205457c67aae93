"""The Embeddings service of a prefill or decode worker (protos/embed.proto): a token sequence's
embedding, computed by the worker's engine in its batches (SamplingParams.embed: the last hidden
state at the sequence's last token), cut to `dimensions` and normalized here, or a sequence
classifier's probabilities over its labels from it. A call cancelled
before its embedding is out aborts its request in the engine."""
from __future__ import annotations

import grpc
import torch

from engine.sampling_params import SamplingParams
from protos import embed_pb2, embed_pb2_grpc
from services.common.engine_loop import EngineDeadError, EngineLoop, RequestRefusedError, finished

SERVICE_NAME = embed_pb2.DESCRIPTOR.services_by_name["Embeddings"].full_name


class EmbeddingsServicer(embed_pb2_grpc.EmbeddingsServicer):
    def __init__(self) -> None:
        self.engine_loop: EngineLoop | None = None  # once the engine is loaded and warm

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
        hidden_size = model_config.hidden_size
        if request.dimensions > hidden_size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"dimensions must be at most the model's hidden size, {hidden_size}; "
                                f"got {request.dimensions}")
        params = SamplingParams(max_tokens=1, temperature=0.0, embed=True, lora_name=request.lora_name or None)
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
        if request.classify:
            return embed_pb2.EmbedResponse(probs=_probabilities(model.classify(torch.tensor(out.embedding))),
                                           labels=model_config.labels)
        return embed_pb2.EmbedResponse(embedding=_shaped(out.embedding, request.dimensions, request.normalize))


def _shaped(embedding: list[float], dimensions: int, normalize: bool) -> list[float]:
    vector = torch.tensor(embedding[:dimensions] if dimensions else embedding, dtype=torch.float32)
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.tolist()


def _probabilities(logits: torch.Tensor) -> list[float]:
    """A classifier's logits made probabilities as vLLM makes them: softmax over the labels, sigmoid
    for a single one (a score)."""
    return (logits.sigmoid() if logits.numel() == 1 else logits.softmax(dim=0)).tolist()
