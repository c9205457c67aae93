"""The short depthwise causal convolution before a hybrid model's recurrent layers (Gated DeltaNet's, Mamba-2's),
continuing from a sequence's window of its last inputs (kept float32; computed in the weights' dtype, as
transformers computes it)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_step(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              dilation: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: x [B, C]; `window` [B, C, (K-1) * dilation] the sequences' last inputs;
    weight [C, K], its taps `dilation` inputs apart. Returns [B, C] (before the activation) and the windows after it."""
    full = torch.cat((window, x[..., None].to(window.dtype)), dim=-1)  # [B, C, (K-1) * dilation + 1]
    out = (full[..., ::dilation].to(weight.dtype) * weight).sum(-1)
    return (out if bias is None else out + bias), full[..., 1:]


def conv_run(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             dilation: int = 1) -> torch.Tensor:
    """T tokens of one sequence: x [T, C]; `window` [C, (K-1) * dilation] its inputs before them (zeros at its start),
    updated in place to the last ones. Returns [T, C] (before the activation)."""
    full = torch.cat((window, x.t().to(window.dtype)), dim=-1)  # [C, (K-1) * dilation + T]
    window.copy_(full[:, full.shape[1] - window.shape[1]:])
    return F.conv1d(full[None].to(weight.dtype), weight[:, None, :], bias, groups=weight.shape[0],
                    dilation=dilation)[0].t()
