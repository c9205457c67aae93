"""Qwen3-VL's images (transformers' Qwen3VLVisionModel): an image of any size in whole 32-pixel squares, its
16-pixel patches taken square by square (an image's one frame standing for the two a patch spans), its learnt
positions (a square grid) resampled bilinearly to the image's grid, pre-norm layers of full attention with 2D
rotary positions and a tanh-GELU MLP; each square's four patches merged into one row of the text model's width,
and merged so too from a few of its layers (DeepStack): rows the text model adds to its first layers' outputs at
the image's tokens. An image's rows come as [tokens, text hidden x (1 + those layers)], the input's first. A
video's frame pairs are each encoded as an image is, their rows one after another.

Qwen2-VL's tower (Qwen2VisionTransformerPretrainedModel) is the same without learnt positions or DeepStack, its
MLP's activation quick-GELU, its tensors named as transformers names them there."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.parameters import empty_param
from engine.vision.loading import put_tensor
from engine.vision.pixtral import rotated
from engine.vision.qwen2_5_vl_images import TOWER, QwenImageEncoder, attended, rope_angles, square_major
from engine.vision.vision_config import QWEN2_VL, QWEN3_VL, VisionConfig

EPS = 1e-6


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "quick_gelu": quick_gelu}
# Each family's tensor names: a block's MLP, and the last merger's norm and layers.
NAMES = {QWEN3_VL: {"fc1": "mlp.linear_fc1", "fc2": "mlp.linear_fc2", "norm": "norm", "merge1": "linear_fc1",
                    "merge2": "linear_fc2"},
         QWEN2_VL: {"fc1": "mlp.fc1", "fc2": "mlp.fc2", "norm": "ln_q", "merge1": "mlp.0", "merge2": "mlp.2"}}


class Qwen3VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.num_heads, self.act = config.num_heads, ACTIVATIONS[config.hidden_act]
        shapes = {"norm1_weight": (hidden,), "norm1_bias": (hidden,), "norm2_weight": (hidden,),
                  "norm2_bias": (hidden,),
                  "qkv_weight": (3 * hidden, hidden), "qkv_bias": (3 * hidden,), "proj_weight": (hidden, hidden),
                  "proj_bias": (hidden,), "fc1_weight": (inner, hidden), "fc1_bias": (inner,),
                  "fc2_weight": (hidden, inner), "fc2_bias": (hidden,)}
        for name, shape in shapes.items():
            setattr(self, name, empty_param(*shape, dtype=dtype))

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = h.shape[-1]
        x = F.layer_norm(h, (hidden,), self.norm1_weight, self.norm1_bias, EPS)
        q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).unflatten(-1, (3, self.num_heads, -1)).unbind(1)
        q, k = (rotated(t.float(), cos, sin).to(t.dtype) for t in (q, k))  # in float32, as transformers turns them
        h = h + F.linear(attended(q, k, v, None).flatten(1), self.proj_weight, self.proj_bias)
        x = F.layer_norm(h, (hidden,), self.norm2_weight, self.norm2_bias, EPS)
        return h + F.linear(self.act(F.linear(x, self.fc1_weight, self.fc1_bias)), self.fc2_weight, self.fc2_bias)


class Qwen3PatchMerger(nn.Module):
    """A square's four patches into one row: normed before they are put side by side (the last layer's merger) or
    after (DeepStack's), then a GELU MLP."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype, norm_after: bool) -> None:
        super().__init__()
        merged = config.hidden_size * config.spatial_merge_size ** 2
        self.norm_after = norm_after
        width = merged if norm_after else config.hidden_size
        self.norm_weight, self.norm_bias = empty_param(width, dtype=dtype), empty_param(width, dtype=dtype)
        self.fc1_weight, self.fc1_bias = empty_param(merged, merged, dtype=dtype), empty_param(merged, dtype=dtype)
        self.fc2_weight = empty_param(config.out_hidden_size, merged, dtype=dtype)
        self.fc2_bias = empty_param(config.out_hidden_size, dtype=dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        width = self.norm_weight.shape[0]
        if self.norm_after:
            h = h.reshape(-1, width)
        x = F.layer_norm(h, (width,), self.norm_weight, self.norm_bias, EPS).reshape(-1, self.fc1_weight.shape[1])
        return F.linear(F.gelu(F.linear(x, self.fc1_weight, self.fc1_bias)), self.fc2_weight, self.fc2_bias)

    def load_weights(self, tensors: dict[str, torch.Tensor], prefix: str, names: dict[str, str] = NAMES[QWEN3_VL]
                     ) -> None:
        for kind in ("weight", "bias"):
            put_tensor(getattr(self, f"norm_{kind}"), tensors, f"{prefix}{names['norm']}.{kind}")
            put_tensor(getattr(self, f"fc1_{kind}"), tensors, f"{prefix}{names['merge1']}.{kind}")
            put_tensor(getattr(self, f"fc2_{kind}"), tensors, f"{prefix}{names['merge2']}.{kind}")


class Qwen3VLImageEncoder(QwenImageEncoder):
    def __init__(self, config: VisionConfig, text_hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, patch = config.hidden_size, config.patch_size
        self.config = config
        self.patch_weight = empty_param(hidden, config.num_channels, config.temporal_patch_size, patch, patch,
                                        dtype=dtype)
        # Qwen3-VL's patches have a bias and learnt positions, Qwen2-VL's neither.
        self.patch_bias = empty_param(hidden, dtype=dtype) if config.num_position_embeddings else None
        self.positions = empty_param(config.num_position_embeddings, hidden, dtype=dtype) \
            if config.num_position_embeddings else None
        self.blocks = nn.ModuleList(Qwen3VisionBlock(config, dtype) for _ in range(config.num_layers))
        self.merger = Qwen3PatchMerger(config, dtype, norm_after=False)
        self.deepstack = nn.ModuleList(Qwen3PatchMerger(config, dtype, norm_after=True)
                                       for _ in config.deepstack_layers)

    def encoded(self, patches: torch.Tensor) -> torch.Tensor:
        config, merge = self.config, self.config.spatial_merge_size
        rows, cols = patches.shape[1:]
        if self.positions is not None:
            side = round(config.num_position_embeddings ** 0.5)
            grid = self.positions.float().T.reshape(1, -1, side, side)
            patches = patches + F.interpolate(grid, size=(rows, cols), mode="bilinear", align_corners=True)[0].to(
                patches.dtype)
        h = square_major(patches.permute(1, 2, 0), merge)
        angles = rope_angles(rows, cols, config.hidden_size // config.num_heads, config.rope_theta, merge, h.device)
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        stacked = []
        for i, block in enumerate(self.blocks):
            h = block(h, cos, sin)
            if i in config.deepstack_layers:
                stacked.append(self.deepstack[config.deepstack_layers.index(i)](h))
        return torch.cat([self.merger(h), *stacked], dim=-1)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """`tensors` by `checkpoint_name`."""
        def put(target: torch.Tensor, *names: str) -> None:
            self.put(target, tensors, *names)

        names = NAMES[self.config.family]
        put(self.patch_weight, "patch_embed.proj.weight")
        if self.positions is not None:
            put(self.patch_bias, "patch_embed.proj.bias")
            put(self.positions, "pos_embed.weight")
        for i, block in enumerate(self.blocks):
            p = f"blocks.{i}."
            for kind in ("weight", "bias"):
                put(getattr(block, f"norm1_{kind}"), p + f"norm1.{kind}")
                put(getattr(block, f"norm2_{kind}"), p + f"norm2.{kind}")
                put(getattr(block, f"qkv_{kind}"), p + f"attn.qkv.{kind}")
                put(getattr(block, f"proj_{kind}"), p + f"attn.proj.{kind}")
                put(getattr(block, f"fc1_{kind}"), p + f"{names['fc1']}.{kind}")
                put(getattr(block, f"fc2_{kind}"), p + f"{names['fc2']}.{kind}")
        self.merger.load_weights(tensors, TOWER + "merger.", names)
        for i, merger in enumerate(self.deepstack):
            merger.load_weights(tensors, TOWER + f"deepstack_merger_list.{i}.")
