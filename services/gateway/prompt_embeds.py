"""vLLM's `prompt_embeds` on /v1/completions (the gateway's --enable-prompt-embeds): the base64 of a
`torch.save`d tensor, [tokens, hidden_size] or [1, tokens, hidden_size], of float32, bfloat16 or
float16 values, read by `torch.load`'s weights-only unpickler (tensors and plain containers, no
code), checked here and sent to the workers as common.proto's PromptEmbeds. Imported only by a
gateway that serves them: torch is a second of start-up and a few hundred MB the others do without."""
from __future__ import annotations

import base64
import binascii
import io
import pickle

import torch

from protos import common_pb2
from services.gateway.errors import APIError

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class PromptEmbedsReader:
    """Reads a request's prompt_embeds for a model of `hidden_size` (rows that wide; `width`: what that is)."""

    def __init__(self, hidden_size: int, width: str = "the model's hidden size"):
        self.hidden_size = hidden_size
        self.width = width

    def read(self, encoded: str, param: str = "prompt_embeds") -> common_pb2.PromptEmbeds:
        """The tensor `encoded` holds, as the workers take it; APIError (400) naming `param` for anything
        else."""
        tensor = loaded_tensor(encoded, param)
        if tensor.dim() == 3 and tensor.shape[0] == 1:
            tensor = tensor[0]
        if tensor.dtype not in DTYPES or tensor.dim() != 2 or not tensor.shape[0] \
                or tensor.shape[1] != self.hidden_size:
            raise APIError(400, f"{param} must be a [tokens, {self.hidden_size}] tensor ({self.width}) "
                                f"of {', '.join(DTYPES.values())}, got {str(tensor.dtype).removeprefix('torch.')} "
                                f"of shape {list(tensor.shape)}", param=param)
        if not bool(torch.isfinite(tensor).all()):
            raise APIError(400, f"{param} holds a value that is not finite (inf or NaN)", param=param)
        return common_pb2.PromptEmbeds(data=tensor.contiguous().view(torch.uint8).numpy().tobytes(),
                                       num_rows=tensor.shape[0], hidden_size=tensor.shape[1],
                                       dtype=DTYPES[tensor.dtype])


def loaded_tensor(encoded: str, param: str) -> torch.Tensor:
    """The tensor the base64 of a torch.save'd one holds (dense); APIError (400) naming `param` for anything else."""
    try:
        saved = base64.b64decode(encoded, validate=True)
        tensor = torch.load(io.BytesIO(saved), map_location="cpu", weights_only=True)
    except (binascii.Error, ValueError, EOFError, RuntimeError, pickle.UnpicklingError) as e:
        raise APIError(400, f"{param} must be the base64 of a tensor saved by torch.save: {e}", param=param) from None
    if not isinstance(tensor, torch.Tensor):
        raise APIError(400, f"{param} must hold a tensor, not a {type(tensor).__name__}", param=param)
    return tensor.to_dense() if tensor.is_sparse else tensor
