"""Gemma 4's images (transformers' Gemma4Model.get_image_features), one image at a time, of any size in whole squares
of k x k patches (k: pooling_kernel_size):

- patches flattened row by row (each patch's pixels row by row, channel by channel), their pixels rescaled from
  [0, 1] to [-1, 1], projected, plus a learnt embedding of the patch's column and one of its row;
- pre-norm and post-norm layers (four RMS norms each) of bidirectional attention, q, k and v normed per head (v
  without a weight), q·k unscaled, 2D RoPE (the first half of a head turned by the patch's column, the second by its
  row), and a GELU-gated MLP; each linear layer's input and output clamped where the tower was trained so;
- each k x k square's states averaged, row-major, times sqrt(hidden_size), standardized where the tower is;
- RMS-normed without a weight and projected into the text model's embedding space (`embed_vision`).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.parameters import empty_param
from engine.vision.loading import put_tensor
from engine.vision.vision_config import VisionConfig

TOWER, EMBEDDER = "vision_tower.", "embed_vision."
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
# Each linear layer's place in a tower layer, by its checkpoint's names.
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
gelu_tanh = functools.partial(F.gelu, approximate="tanh")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma 4's: in float32, weighed in float32 (or not at all), cast back."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return (normed if weight is None else normed * weight.float()).to(x.dtype)


class ClampedLinear(nn.Module):
    """A linear layer without a bias, its input and output clamped to learnt bounds where the tower has them."""

    def __init__(self, in_features: int, out_features: int, clamped: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_param(out_features, in_features, dtype=dtype)
        self.bounds = empty_param(4, dtype=torch.float32) if clamped else None  # input min, max; output min, max

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bounds is None:
            return F.linear(x, self.weight)
        low, high, out_low, out_high = self.bounds.tolist()
        return F.linear(x.clamp(low, high), self.weight).clamp(out_low, out_high)

    def load(self, tensors: dict[str, torch.Tensor], name: str) -> None:
        put_tensor(self.weight, tensors, name + ".linear.weight")
        if self.bounds is not None:
            bounds = [tensors[f"{name}.{bound}"].float().reshape(1) for bound in
                      ("input_min", "input_max", "output_min", "output_max")]
            self.bounds.copy_(torch.cat(bounds))


def turned(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [P, heads, D] turned by 2D RoPE: each half of a head by its own axis, pairs half that half apart."""
    halves = []
    for part, c, s in zip(x.chunk(2, dim=-1), cos, sin, strict=True):
        quarter = part.shape[-1] // 2
        rotated = torch.cat((-part[..., quarter:], part[..., :quarter]), dim=-1)
        halves.append(part * c[:, None] + rotated * s[:, None])
    return torch.cat(halves, dim=-1)


class Gemma4VisionLayer(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, heads, kv_heads, dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.eps, self.num_heads, self.num_kv_heads, self.head_dim = config.layer_norm_eps, heads, kv_heads, dim
        clamped = config.clipped_linears
        inner = config.intermediate_size
        shapes = {"q_proj": (hidden, heads * dim), "k_proj": (hidden, kv_heads * dim),
                  "v_proj": (hidden, kv_heads * dim), "o_proj": (heads * dim, hidden), "gate_proj": (hidden, inner),
                  "up_proj": (hidden, inner), "down_proj": (inner, hidden)}
        self.projections = nn.ModuleDict({name: ClampedLinear(*shapes[name], clamped, dtype) for name in PROJECTIONS})
        self.norms = nn.ParameterDict({name: empty_param(hidden, dtype=dtype) for name in NORMS})
        self.q_norm = empty_param(dim, dtype=dtype)
        self.k_norm = empty_param(dim, dtype=dtype)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # h [P, hidden]
        proj, norms, eps = self.projections, self.norms, self.eps
        x = rms_norm(h, norms["input_layernorm"], eps)
        q = rms_norm(proj["q_proj"](x).unflatten(-1, (self.num_heads, self.head_dim)), self.q_norm, eps)
        k = rms_norm(proj["k_proj"](x).unflatten(-1, (self.num_kv_heads, self.head_dim)), self.k_norm, eps)
        v = rms_norm(proj["v_proj"](x).unflatten(-1, (self.num_kv_heads, self.head_dim)), None, eps)
        q, k = turned(q, cos, sin).transpose(0, 1), turned(k, cos, sin).transpose(0, 1)
        attended = F.scaled_dot_product_attention(q[None], k[None], v.transpose(0, 1)[None], scale=1.0,
                                                  enable_gqa=True)[0]  # [heads, P, dim]
        h = h + rms_norm(proj["o_proj"](attended.transpose(0, 1).flatten(1)),
                         norms["post_attention_layernorm"], eps)
        x = rms_norm(h, norms["pre_feedforward_layernorm"], eps)
        made = proj["down_proj"](gelu_tanh(proj["gate_proj"](x)) * proj["up_proj"](x))
        return h + rms_norm(made, norms["post_feedforward_layernorm"], eps)


class Gemma4ImageEncoder(nn.Module):
    def __init__(self, config: VisionConfig, text_hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, patch = config.hidden_size, config.patch_size
        self.config = config
        self.input_proj = empty_param(hidden, config.num_channels * patch * patch, dtype=dtype)
        self.position_table = empty_param(2, config.num_position_embeddings, hidden, dtype=dtype)  # columns, rows
        self.layers = nn.ModuleList(Gemma4VisionLayer(config, dtype) for _ in range(config.num_layers))
        self.std_bias = empty_param(hidden, dtype=torch.float32) if config.standardize else None
        self.std_scale = empty_param(hidden, dtype=torch.float32) if config.standardize else None
        self.projection = empty_param(text_hidden_size, hidden, dtype=dtype)
        head_quarter = config.head_dim // 4
        self.register_buffer("inv_freq", 1.0 / config.rope_theta ** (
            torch.arange(0, 2 * head_quarter, 2, dtype=torch.float32) / (2 * head_quarter)), persistent=False)

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [C, height, width] in [0, 1], each side a whole number of k x k squares of patches →
        [squares, text hidden size], row-major."""
        config, patch, k = self.config, self.config.patch_size, self.config.spatial_merge_size
        channels, rows, cols = pixels.shape[0], pixels.shape[1] // patch, pixels.shape[2] // patch
        patches = pixels.reshape(channels, rows, patch, cols, patch).permute(1, 3, 2, 4, 0).reshape(rows * cols, -1)
        row, col = (index.flatten() for index in torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij"))
        h = F.linear((2 * (patches - 0.5)).to(self.input_proj.dtype), self.input_proj)
        h = h + self.position_table[0][col] + self.position_table[1][row]
        cos, sin = self._axes(col, row, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        grid = h.float().T.reshape(1, -1, rows, cols)
        pooled = F.avg_pool2d(grid, k, k).flatten(2)[0].T * config.hidden_size ** 0.5  # [squares, hidden], float32
        if self.std_bias is not None:
            pooled = (pooled - self.std_bias) * self.std_scale
        pooled = pooled.to(h.dtype)
        return F.linear(rms_norm(pooled, None, config.layer_norm_eps), self.projection)

    def _axes(self, col: torch.Tensor, row: torch.Tensor, dtype: torch.dtype
              ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """Each patch's cos and sin [P, head_dim / 2] for the half of a head its column turns, and the half its row
        does."""
        angles = [torch.cat([position[:, None].float() * self.inv_freq] * 2, dim=-1) for position in (col, row)]
        return tuple(a.cos().to(dtype) for a in angles), tuple(a.sin().to(dtype) for a in angles)

    def encode(self, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each image's rows, one image at a time (their sizes differ)."""
        return [self(image) for image in pixels]

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        """Its name for checkpoint tensor `name` (under `model.vision_tower.` and `model.embed_vision.`, as released
        and as transformers 5 saves it); None for another."""
        name = name.removeprefix("model.")
        return name if name.startswith((TOWER, EMBEDDER)) else None

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """`tensors` by `checkpoint_name`; KeyError for a missing one, ValueError for a wrong shape."""
        put_tensor(self.input_proj, tensors, TOWER + "patch_embedder.input_proj.weight")
        put_tensor(self.position_table, tensors, TOWER + "patch_embedder.position_embedding_table")
        for i, layer in enumerate(self.layers):
            p = f"{TOWER}encoder.layers.{i}."
            for name, projection in layer.projections.items():
                projection.load(tensors, f"{p}{PROJECTIONS[name]}.{name}")
            for name, norm in layer.norms.items():
                put_tensor(norm, tensors, p + name + ".weight")
            put_tensor(layer.q_norm, tensors, p + "self_attn.q_norm.weight")
            put_tensor(layer.k_norm, tensors, p + "self_attn.k_norm.weight")
        if self.std_bias is not None:
            put_tensor(self.std_bias, tensors, TOWER + "std_bias")
            put_tensor(self.std_scale, tensors, TOWER + "std_scale")
        put_tensor(self.projection, tensors, EMBEDDER + "embedding_projection.weight")
