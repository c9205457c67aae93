"""Reading a vision tower's tensors from its checkpoint's names."""
from __future__ import annotations

import torch


def put_tensor(target: torch.Tensor, tensors: dict[str, torch.Tensor], *names: str) -> None:
    """Copy the checkpoint's `names` (concatenated: q, k and v fused as they load) into `target`; KeyError for
    a missing one, ValueError for a wrong shape."""
    tensor = torch.cat([tensors[name] for name in names])
    if target.shape != tensor.shape:
        raise ValueError(f"vision tensor {names[0]!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    target.copy_(tensor)
