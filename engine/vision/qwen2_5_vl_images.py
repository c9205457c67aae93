"""Qwen2.5-VL's images (transformers' Qwen2_5_VisionTransformerPretrainedModel): an image of any size in whole
28-pixel squares, its 14-pixel patches (an image's one frame standing for the two a patch spans) taken square by
square, four to a square; pre-norm layers of attention with 2D rotary positions and a gated MLP, most of them
attending within windows of squares, a few over the whole image; then each square's four patches merged into one
row of the text model's width. The rows come out row-major over the squares: the order of the image's run of
tokens. Images are encoded one at a time (transformers keeps each image's attention to itself all the same). A
video's frames are taken two at a time, a pair's patches spanning both; each pair is encoded as an image is (its
patches attend within it, at the same 2D positions), the pairs' rows one after another."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.parameters import empty_param
from engine.vision.loading import put_tensor
from engine.vision.pixtral import rms_norm, rotated
from engine.vision.vision_config import VisionConfig

TOWER = "visual."
EPS = 1e-6


def square_major(grid: torch.Tensor, merge: int) -> torch.Tensor:
    """grid [rows, cols, ...] as [rows * cols, ...]: square by square (row-major), each square's patches row-major."""
    rows, cols = grid.shape[:2]
    squares = grid.reshape(rows // merge, merge, cols // merge, merge, *grid.shape[2:])
    return squares.transpose(1, 2).reshape(rows * cols, *grid.shape[2:])


def rope_angles(rows: int, cols: int, head_dim: int, theta: float, merge: int, device: torch.device) -> torch.Tensor:
    """Each patch's angles [rows * cols, head_dim], square-major: its row turns the first quarter of a head's
    frequencies, its column the second (and again for the second half)."""
    spatial = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=device) / spatial))
    row, col = torch.meshgrid(torch.arange(rows, device=device), torch.arange(cols, device=device), indexing="ij")
    positions = square_major(torch.stack([row, col], dim=-1), merge).float()  # [P, 2]
    angles = torch.cat([positions[:, :1] * inv_freq, positions[:, 1:] * inv_freq], dim=-1)
    return torch.cat([angles, angles], dim=-1)


def windows(rows: int, cols: int, merge: int, window: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows the patches attend within: window by window, its patches' indexes (square-major), padded
    to the largest window's count [W, L], and which of them are patches, not padding [W, L]."""
    square_rows, square_cols = rows // merge, cols // merge
    window_cols = -(-square_cols // window)
    square = torch.arange(square_rows * square_cols, device=device)
    of_square = (square // square_cols // window) * window_cols + (square % square_cols) // window
    of_patch = of_square.repeat_interleave(merge * merge)
    order = torch.argsort(of_patch, stable=True)
    counts = torch.bincount(of_patch)
    counts = counts[counts > 0]
    slot = torch.arange(int(counts.max()), device=device)
    valid = slot < counts[:, None]
    index = torch.zeros(valid.shape, dtype=torch.int64, device=device)
    index[valid] = order
    return index, valid


def attended(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             within: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """Attention of q, k, v [P, heads, dim]: over all patches (`within` None), or within each window."""
    if within is None:
        return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)
    index, valid = within
    by_window = [x[index].transpose(1, 2) for x in (q, k, v)]  # [W, heads, L, dim]
    out = F.scaled_dot_product_attention(*by_window, attn_mask=valid[:, None, None, :]).transpose(1, 2)
    result = torch.empty_like(q)
    result[index[valid]] = out[valid]
    return result


class QwenVisionBlock(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.num_heads = config.num_heads
        self.norm1, self.norm2 = empty_param(hidden, dtype=dtype), empty_param(hidden, dtype=dtype)
        self.qkv_weight = empty_param(3 * hidden, hidden, dtype=dtype)
        self.qkv_bias = empty_param(3 * hidden, dtype=dtype)
        self.proj_weight, self.proj_bias = empty_param(hidden, hidden, dtype=dtype), empty_param(hidden, dtype=dtype)
        self.gate_up_weight = empty_param(2 * inner, hidden, dtype=dtype)
        self.gate_up_bias = empty_param(2 * inner, dtype=dtype)
        self.down_weight, self.down_bias = empty_param(hidden, inner, dtype=dtype), empty_param(hidden, dtype=dtype)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                within: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        x = rms_norm(h, self.norm1, EPS)
        q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).unflatten(-1, (3, self.num_heads, -1)).unbind(1)
        # Turned in float32, as transformers turns them.
        q, k = (rotated(t.float(), cos, sin).to(t.dtype) for t in (q, k))
        h = h + F.linear(attended(q, k, v, within).flatten(1), self.proj_weight, self.proj_bias)
        gate, up = F.linear(rms_norm(h, self.norm2, EPS), self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, self.down_weight, self.down_bias)


class QwenImageEncoder(nn.Module):
    """What Qwen's image encoders share: their tensors under `visual.` (as released; under `model.visual.` as
    transformers 5 saves them), images encoded one at a time (their sizes differ), and a video's frame pairs
    each encoded as an image is."""

    config: VisionConfig
    patch_weight: torch.Tensor  # [hidden, channels, temporal_patch_size, patch, patch]
    patch_bias: torch.Tensor | None  # Qwen3-VL's

    def encode(self, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each image's (or video's) rows."""
        return [self(image) for image in pixels]

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [C, height, width], or a video's [C, frames, height, width] (frames in whole pairs), each side a
        multiple of patch_size x spatial_merge_size → its rows [pairs x rows x cols of squares, text hidden size
        (x (1 + DeepStack's layers))], a pair's row-major after another's."""
        return torch.cat([self.encoded(patches) for patches in self.patches(pixels)])

    def patches(self, pixels: torch.Tensor) -> torch.Tensor:
        """Each frame pair's patches [pairs, hidden, rows, cols]: an image's one frame standing for the two a patch
        spans (the kernel's frames summed take them at once)."""
        stride = self.config.patch_size
        if pixels.dim() == 3:
            kernel = self.patch_weight.sum(dim=2)
            return F.conv2d(pixels[None].to(kernel.dtype), kernel, self.patch_bias, stride=stride)
        kernel = self.patch_weight
        strides = (self.config.temporal_patch_size, stride, stride)
        return F.conv3d(pixels[None].to(kernel.dtype), kernel, self.patch_bias, stride=strides)[0].transpose(0, 1)

    def encoded(self, patches: torch.Tensor) -> torch.Tensor:
        """One image's (or frame pair's) rows of its patches [hidden, rows, cols]."""
        raise NotImplementedError

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        """Its name for checkpoint tensor `name`; None for another."""
        name = name.removeprefix("model.")
        return name if name.startswith(TOWER) else None

    @staticmethod
    def put(target: torch.Tensor, tensors: dict[str, torch.Tensor], *names: str) -> None:
        """`target` from the tower's tensors `names` (under `visual.`), concatenated."""
        put_tensor(target, tensors, *(TOWER + name for name in names))


class Qwen2_5_VLImageEncoder(QwenImageEncoder):
    def __init__(self, config: VisionConfig, text_hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, merge, patch = config.hidden_size, config.spatial_merge_size, config.patch_size
        self.config = config
        self.patch_weight = empty_param(hidden, config.num_channels, config.temporal_patch_size, patch, patch,
                                        dtype=dtype)
        self.patch_bias = None
        self.blocks = nn.ModuleList(QwenVisionBlock(config, dtype) for _ in range(config.num_layers))
        merged = hidden * merge * merge
        self.merge_norm = empty_param(hidden, dtype=dtype)
        self.merge1_weight = empty_param(merged, merged, dtype=dtype)
        self.merge1_bias = empty_param(merged, dtype=dtype)
        self.merge2_weight = empty_param(text_hidden_size, merged, dtype=dtype)
        self.merge2_bias = empty_param(text_hidden_size, dtype=dtype)

    def encoded(self, patches: torch.Tensor) -> torch.Tensor:
        config, merge = self.config, self.config.spatial_merge_size
        rows, cols = patches.shape[1:]
        h = square_major(patches.permute(1, 2, 0), merge)
        angles = rope_angles(rows, cols, config.hidden_size // config.num_heads, config.rope_theta, merge, h.device)
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        within = windows(rows, cols, merge, config.window_size // config.pixels_per_row, h.device)
        for i, block in enumerate(self.blocks):
            h = block(h, cos, sin, None if i in config.full_attention_layers else within)
        squares = rms_norm(h, self.merge_norm, EPS).reshape(-1, config.hidden_size * merge * merge)
        return F.linear(F.gelu(F.linear(squares, self.merge1_weight, self.merge1_bias)), self.merge2_weight,
                        self.merge2_bias)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """`tensors` by `checkpoint_name` (each block's gate and up fused as they load)."""
        def put(target: torch.Tensor, *names: str) -> None:
            self.put(target, tensors, *names)

        put(self.patch_weight, "patch_embed.proj.weight")
        for i, block in enumerate(self.blocks):
            p = f"blocks.{i}."
            put(block.norm1, p + "norm1.weight")
            put(block.norm2, p + "norm2.weight")
            for kind in ("weight", "bias"):
                put(getattr(block, f"qkv_{kind}"), p + f"attn.qkv.{kind}")
                put(getattr(block, f"proj_{kind}"), p + f"attn.proj.{kind}")
                put(getattr(block, f"gate_up_{kind}"), p + f"mlp.gate_proj.{kind}", p + f"mlp.up_proj.{kind}")
                put(getattr(block, f"down_{kind}"), p + f"mlp.down_proj.{kind}")
        put(self.merge_norm, "merger.ln_q.weight")
        for kind in ("weight", "bias"):
            put(getattr(self, f"merge1_{kind}"), f"merger.mlp.0.{kind}")
            put(getattr(self, f"merge2_{kind}"), f"merger.mlp.2.{kind}")
