"""Mamba-1's selective scan (kernels/selective_scan.py): a run of tokens, and its one-token steps batched, are the
recurrence: the outputs and the state it leaves, from a state carried in."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import selective_scan as scan


@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_a_run_and_its_steps_are_the_recurrence(num_tokens):
    g = torch.Generator().manual_seed(num_tokens)
    channels, size = 24, 8
    x, b, c = (torch.randn(num_tokens, n, generator=g) for n in (channels, size, size))
    dt = F.softplus(torch.randn(num_tokens, channels, generator=g))
    a = -3 * torch.rand(channels, size, generator=g)
    start = torch.randn(channels, size, generator=g)
    state = start.clone()
    made = scan.run(x, dt, a, b, c, state)
    expected, stepped = [], start
    for t in range(num_tokens):
        decayed = stepped * torch.exp(dt[t, :, None] * a) + (dt[t] * x[t])[:, None] * b[t]
        expected.append(decayed @ c[t])
        stepped = decayed
    assert (made - torch.stack(expected)).abs().max().item() < 1e-4
    assert (state - stepped).abs().max().item() < 1e-4
    batched, after = scan.step(x[:1], dt[:1], a, b[:1], c[:1], start[None])  # one token of a batch of one
    assert (batched[0] - expected[0]).abs().max().item() < 1e-5
    assert (after[0] - (start * torch.exp(dt[0, :, None] * a) + (dt[0] * x[0])[:, None] * b[0])).abs().max() < 1e-5
