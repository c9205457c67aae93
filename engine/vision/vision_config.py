"""A multimodal checkpoint's image side, from config.json: its vision tower's shape, and how an image's
embedding rows sit in the prompt, under which token."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GEMMA3, PIXTRAL, QWEN2_VL, QWEN2_5_VL, QWEN3_VL = "gemma3", "pixtral", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"
LLAMA4 = "llama4"
GEMMA4 = "gemma4"
STEP3P7 = "step3p7"
# Images of any size in whole squares, one run of tokens, placed by multimodal RoPE.
QWENS = (QWEN2_VL, QWEN2_5_VL, QWEN3_VL)


@dataclass(frozen=True)
class VisionConfig:
    # GEMMA3: a SigLIP tower pooled to a fixed size; PIXTRAL: Mistral 3's tower, any size; QWEN2_5_VL: Qwen2.5-VL's
    # windowed tower, any size, its rows placed by multimodal RoPE (ModelConfig.mrope_section); QWEN3_VL: Qwen3-VL's,
    # learnt positions resampled to the image, its rows placed so and added to the text model's first layers' too;
    # QWEN2_VL: Qwen2-VL's, Qwen3-VL's without those (engine/vision/qwen3_vl_images.py); LLAMA4: Llama 4's tower over
    # square tiles of a fixed size, each tile's patches pixel-shuffled 2x2 into its rows; GEMMA4: Gemma 4's tower over
    # an image of any size in whole squares of spatial_merge_size x spatial_merge_size patches, each averaged to a row;
    # STEP3P7: Step-3.7's tower over square views (an image's global one, its local crops), learnt positions resampled
    # to each, its patch grid downsampled 4x4 into rows by two strided convolutions.
    family: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    # GEMMA3: the tower's square input; PIXTRAL: the most pixels on a side; QWENS: 0; LLAMA4: a tile's side
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    image_token_id: int  # the prompt's placeholder of each row
    # QWENS: a video's placeholder (Qwen2-VL's and Qwen2.5-VL's frames' rows one run, frame pair by frame pair;
    # Qwen3-VL's a run a frame pair, each after its time in text); -1: none
    video_token_id: int = -1
    tokens_per_image: int = 0  # GEMMA3: the rows an image becomes (mm_tokens_per_image); LLAMA4: a tile
    num_channels: int = 3
    # PIXTRAL, QWENS, LLAMA4: patches merged into one row (a side's count; LLAMA4's pixel shuffle), the tower's RoPE
    # base; PIXTRAL: its
    # projector's activation, biases and RMSNorm epsilon (the text model's).
    spatial_merge_size: int = 1
    rope_theta: float = 10_000.0
    projector_act: str = "gelu"
    projector_bias: bool = False
    projector_norm_eps: float = 1e-5
    # QWENS: frames a patch spans (an image its one frame repeated) and its rows' width; QWEN2_5_VL: the pixels on
    # a side of the windows most layers attend within, the layers that attend over the whole image.
    temporal_patch_size: int = 1
    window_size: int = 0
    full_attention_layers: tuple[int, ...] = ()
    out_hidden_size: int = 0
    # QWEN2_5_VL: how far a video's temporal positions step a second of it (its frame pairs' times spaced so)
    tokens_per_second: float = 0.0
    # QWEN3_VL: its learnt positions (a square grid of them), and the tower layers whose states, merged, are added
    # to the text model's first layers' outputs at the image's tokens (DeepStack), one layer each in turn.
    num_position_embeddings: int = 0
    deepstack_layers: tuple[int, ...] = ()
    # LLAMA4: the widths of its adapter's MLP after the pixel shuffle (in, out); `out_hidden_size` its rows' width
    # into the projector.
    projector_input_dim: int = 0
    projector_output_dim: int = 0
    # GEMMA4: its attention's KV heads and head size, its learnt positions a side (num_position_embeddings), its
    # linear layers' inputs and outputs clamped (use_clipped_linears), its rows standardized (standardize).
    num_kv_heads: int = 0
    head_dim: int = 0
    clipped_linears: bool = False
    standardize: bool = False

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def bidirectional(self) -> bool:
        """Whether an image's tokens attend to each other both ways (Gemma 3's do, Gemma 4's in its sliding-window
        layers; Mistral 3's causally)."""
        return self.family in (GEMMA3, GEMMA4)

    @property
    def normalizes_in_bfloat16(self) -> bool:
        """Whether its image processor rescales and normalizes pixels in bfloat16 (Llama 4's does), not float32."""
        return self.family == LLAMA4

    @property
    def pixels_per_row(self) -> int:
        """PIXTRAL, QWENS: the pixels one image token stands for on a side."""
        return self.patch_size * self.spatial_merge_size

    @property
    def takes_videos(self) -> bool:
        return self.video_token_id >= 0

    def token_grid(self, height: int, width: int, frames: int = 0) -> tuple[int, int]:
        """An image of `height` x `width` pixels (as its image processor resized it), or a video of `frames` such
        frames, as runs of image tokens in the prompt: how many runs, and how many tokens each. A Qwen2-VL or
        Qwen2.5-VL video's is one run, a frame pair's grid after another; Qwen3-VL's a run a frame pair. Gemma 3's
        and Qwen-VL's images are one run; Mistral 3's a
        run a row, each row ended by a break token (the last by an end token), as transformers' PixtralProcessor
        writes them; Llama 4's a run a tile of the image's canvas of tiles, row by row (an image of more than one
        tile followed by another image, its global tile, a run of its own)."""
        if self.family == GEMMA3:
            return 1, self.tokens_per_image
        if self.family in (GEMMA4, STEP3P7):  # one run, a row a square of patches
            return 1, (height // self.pixels_per_row) * (width // self.pixels_per_row)
        if self.family == LLAMA4:
            return (height // self.image_size) * (width // self.image_size), self.tokens_per_image
        if self.family in QWENS:  # one run, row-major
            pairs = max(frames // self.temporal_patch_size, 1)
            squares = (height // self.pixels_per_row) * (width // self.pixels_per_row)
            return (pairs, squares) if self.family == QWEN3_VL else (1, pairs * squares)
        return height // self.pixels_per_row, width // self.pixels_per_row

    def shape_error(self, height: int, width: int) -> str | None:
        """Why the tower cannot take an image of this size as it stands (resized by the model's image
        processor), or None."""
        if self.family == GEMMA3:
            side = self.image_size
            return None if (height, width) == (side, side) else f"must be {side}x{side} pixels"
        if self.family == LLAMA4:
            side = self.image_size
            return None if height > 0 and width > 0 and not height % side and not width % side else \
                f"must be a canvas of whole {side}x{side}-pixel tiles"
        step = self.pixels_per_row
        if self.family == GEMMA4:
            most = self.num_position_embeddings * self.patch_size  # a patch's learnt positions go no further
            return None if 0 < height <= most and 0 < width <= most and not height % step and not width % step else \
                f"must have sides of whole multiples of {step} pixels, at most {most}"
        if self.family in (*QWENS, STEP3P7):
            return None if height > 0 and width > 0 and not height % step and not width % step else \
                f"must have sides of whole multiples of {step} pixels"
        most = -(-self.image_size // step) * step  # the processor rounds a side up to a whole row's pixels
        if not (0 < height <= most and 0 < width <= most) or height % step or width % step:
            return f"must have sides of at most {most} pixels (its processor's longest_edge), each a multiple of {step}"
        return None


# Gemma3Config's and SiglipVisionConfig's, where config.json leaves them out.
GEMMA3_IMAGE_DEFAULTS = {"mm_tokens_per_image": 256, "image_token_index": 262_144}
SIGLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "image_size": 224, "patch_size": 16, "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh",
                   "num_channels": 3}
# Gemma4VisionConfig's and Gemma4Config's, where config.json leaves them out.
GEMMA4_VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 16,
                          "num_attention_heads": 12, "num_key_value_heads": 12, "head_dim": 64,
                          "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "pooling_kernel_size": 3,
                          "patch_size": 16, "position_embedding_size": 10 * 1024, "use_clipped_linears": False,
                          "standardize": False}
GEMMA4_IMAGE_TOKEN = 258_880
# Mistral3Config's and its PixtralVisionConfig's (Mistral Small 3.1's), where config.json leaves them out.
MISTRAL3_IMAGE_DEFAULTS = {"image_token_index": 10, "spatial_merge_size": 2, "vision_feature_layer": -1,
                           "projector_hidden_act": "gelu", "multimodal_projector_bias": False}
PIXTRAL_DEFAULTS = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
                    "image_size": 1540, "patch_size": 14, "hidden_act": "gelu", "num_channels": 3}


def gemma3_vision_config(cfg: dict[str, Any]) -> VisionConfig:
    """Gemma 3's (Gemma3ForConditionalGeneration's config.json): a SigLIP tower whose patches are
    average-pooled to mm_tokens_per_image rows. ValueError for a shape it cannot pool so."""
    vision = {**SIGLIP_DEFAULTS, **(cfg.get("vision_config") or {})}
    image = {**GEMMA3_IMAGE_DEFAULTS, **{k: cfg[k] for k in GEMMA3_IMAGE_DEFAULTS if k in cfg}}
    config = VisionConfig(
        family=GEMMA3, hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
        num_layers=int(vision["num_hidden_layers"]), num_heads=int(vision["num_attention_heads"]),
        image_size=int(vision["image_size"]), patch_size=int(vision["patch_size"]),
        layer_norm_eps=float(vision["layer_norm_eps"]), hidden_act=vision["hidden_act"],
        tokens_per_image=int(image["mm_tokens_per_image"]), image_token_id=int(image["image_token_index"]),
        num_channels=int(vision["num_channels"]))
    side = round(config.tokens_per_image ** 0.5)
    if side * side != config.tokens_per_image or config.patches_per_side % side:
        raise ValueError(f"mm_tokens_per_image {config.tokens_per_image} does not pool a "
                         f"{config.patches_per_side}x{config.patches_per_side} grid of patches")
    if config.hidden_act != "gelu_pytorch_tanh":
        raise ValueError(f"vision_config.hidden_act {config.hidden_act!r} is not served (gelu_pytorch_tanh only)")
    return config


def gemma4_vision_config(cfg: dict[str, Any]) -> VisionConfig:
    """Gemma 4's (Gemma4ForConditionalGeneration's config.json): a tower over an image of any size in whole squares of
    pooling_kernel_size x pooling_kernel_size patches, each square averaged into one row. ValueError for settings not
    served."""
    vision = {**GEMMA4_VISION_DEFAULTS, **(cfg.get("vision_config") or {})}
    rope = vision.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision_config's rope_type {rope['rope_type']!r} is not served (axial only)")
    if vision["hidden_activation"] != "gelu_pytorch_tanh":
        raise ValueError(f"vision_config.hidden_activation {vision['hidden_activation']!r} is not served "
                         "(gelu_pytorch_tanh only)")
    config = VisionConfig(
        family=GEMMA4, hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
        num_layers=int(vision["num_hidden_layers"]), num_heads=int(vision["num_attention_heads"]), image_size=0,
        patch_size=int(vision["patch_size"]), layer_norm_eps=float(vision["rms_norm_eps"]),
        hidden_act=vision["hidden_activation"], image_token_id=int(cfg.get("image_token_id", GEMMA4_IMAGE_TOKEN)),
        spatial_merge_size=int(vision["pooling_kernel_size"]), rope_theta=float(rope.get("rope_theta", 100.0)),
        num_position_embeddings=int(vision["position_embedding_size"]),
        num_kv_heads=int(vision["num_key_value_heads"]), head_dim=int(vision["head_dim"]),
        clipped_linears=bool(vision["use_clipped_linears"]), standardize=bool(vision["standardize"]))
    if config.head_dim % 4 or config.num_heads % config.num_kv_heads:
        raise ValueError(f"vision_config's head_dim must be a multiple of 4 (2D RoPE, each axis half a head) and its "
                         f"KV heads divide its heads, got {config.head_dim} and {config.num_kv_heads}")
    return config


def mistral3_vision_config(cfg: dict[str, Any]) -> VisionConfig:
    """Mistral 3's (Mistral3ForConditionalGeneration's config.json: Mistral Small 3.1/3.2, Magistral Small,
    Ministral 3): a Pixtral tower over an image of any size, its patches merged spatial_merge_size x
    spatial_merge_size into one row each. ValueError for settings not served."""
    vision = {**PIXTRAL_DEFAULTS, **(cfg.get("vision_config") or {})}
    image = {**MISTRAL3_IMAGE_DEFAULTS, **{k: cfg[k] for k in MISTRAL3_IMAGE_DEFAULTS if k in cfg}}
    rope = vision.get("rope_parameters") or {}
    text = cfg.get("text_config") or {}
    config = VisionConfig(
        family=PIXTRAL, hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
        num_layers=int(vision["num_hidden_layers"]), num_heads=int(vision["num_attention_heads"]),
        image_size=int(vision["image_size"]), patch_size=int(vision["patch_size"]), layer_norm_eps=1e-5,
        hidden_act=vision["hidden_act"], image_token_id=int(image["image_token_index"]),
        num_channels=int(vision["num_channels"]), spatial_merge_size=int(image["spatial_merge_size"]),
        rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", 10_000.0))),
        projector_act=image["projector_hidden_act"], projector_bias=bool(image["multimodal_projector_bias"]),
        projector_norm_eps=float(text.get("rms_norm_eps", 1e-5)))
    if image["vision_feature_layer"] != -1:
        raise ValueError(f"vision_feature_layer {image['vision_feature_layer']!r} is not served (-1, the tower's "
                         "last layer, only)")
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision_config's rope_type {rope['rope_type']!r} is not served (axial only)")
    head_dim = config.hidden_size // config.num_heads
    if head_dim % 4 or int(vision.get("head_dim", head_dim)) != head_dim:
        raise ValueError(f"vision_config's head_dim must be hidden_size / num_attention_heads and a multiple of 4 "
                         f"(2D RoPE), got {vision.get('head_dim', head_dim)}")
    for name, act in (("vision_config.hidden_act", config.hidden_act), ("projector_hidden_act", config.projector_act)):
        if act not in ("gelu", "silu"):
            raise ValueError(f"{name} {act!r} is not served (gelu or silu)")
    return config


# Qwen2_5_VLVisionConfig's and Qwen2_5_VLConfig's, where config.json leaves them out.
QWEN2_5_VL_DEFAULTS = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "in_channels": 3,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                       "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu"}


def qwen2_5_vl_vision_config(cfg: dict[str, Any]) -> VisionConfig:
    """Qwen2.5-VL's (Qwen2_5_VLForConditionalGeneration's config.json): a windowed tower over an image of any
    size in whole 28-pixel squares, each square's four patches merged into one row. ValueError for settings
    not served."""
    vision = {**QWEN2_5_VL_DEFAULTS, **(cfg.get("vision_config") or {})}
    rope = vision.get("rope_parameters") or {}
    text = cfg.get("text_config") or cfg
    config = VisionConfig(
        family=QWEN2_5_VL, hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
        num_layers=int(vision["depth"]), num_heads=int(vision["num_heads"]), image_size=0,
        patch_size=int(vision["patch_size"]), layer_norm_eps=1e-6, hidden_act=vision["hidden_act"],
        image_token_id=int(cfg.get("image_token_id", 151_655)),
        num_channels=int(vision.get("in_channels", vision.get("in_chans", 3))),
        spatial_merge_size=int(vision["spatial_merge_size"]), rope_theta=float(rope.get("rope_theta", 10_000.0)),
        temporal_patch_size=int(vision["temporal_patch_size"]), window_size=int(vision["window_size"]),
        full_attention_layers=tuple(int(i) for i in vision["fullatt_block_indexes"]),
        out_hidden_size=int(vision.get("out_hidden_size", text.get("hidden_size", 0))),
        video_token_id=int(cfg.get("video_token_id", 151_656)),
        tokens_per_second=float(vision.get("tokens_per_second", 4)))
    if config.hidden_act != "silu":
        raise ValueError(f"vision_config.hidden_act {config.hidden_act!r} is not served (silu only)")
    if (config.hidden_size // config.num_heads) % 4:
        raise ValueError("vision_config's head size must be a multiple of 4 (2D RoPE)")
    if config.window_size % config.pixels_per_row:
        raise ValueError(f"vision_config.window_size {config.window_size} must be a multiple of "
                         f"{config.pixels_per_row}")
    return config


# Qwen3VLVisionConfig's, where config.json leaves them out.
QWEN3_VL_DEFAULTS = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
                     "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                     "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
                     "hidden_act": "gelu_pytorch_tanh"}


def qwen3_5_vision_config(cfg: dict[str, Any]) -> VisionConfig:
    """Qwen3.5's (Qwen3_5ForConditionalGeneration's config.json): Qwen3-VL's tower without DeepStack."""
    vision = {**(cfg.get("vision_config") or {}), "deepstack_visual_indexes": []}
    return qwen3_vl_vision_config({**cfg, "vision_config": vision})


def qwen3_vl_vision_config(cfg: dict[str, Any]) -> VisionConfig:
    """Qwen3-VL's (Qwen3VLForConditionalGeneration's config.json): a tower over an image of any size in whole
    32-pixel squares, learnt positions resampled to its grid, each square's four patches merged into one row, and
    rows merged from some of its layers (DeepStack). ValueError for settings not served."""
    vision = {**QWEN3_VL_DEFAULTS, **(cfg.get("vision_config") or {})}
    rope = vision.get("rope_parameters") or {}
    config = VisionConfig(
        family=QWEN3_VL, hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
        num_layers=int(vision["depth"]), num_heads=int(vision["num_heads"]), image_size=0,
        patch_size=int(vision["patch_size"]), layer_norm_eps=1e-6, hidden_act=vision["hidden_act"],
        image_token_id=int(cfg.get("image_token_id", 151_655)), num_channels=int(vision["in_channels"]),
        spatial_merge_size=int(vision["spatial_merge_size"]), rope_theta=float(rope.get("rope_theta", 10_000.0)),
        temporal_patch_size=int(vision["temporal_patch_size"]),
        out_hidden_size=int(vision.get("out_hidden_size", (cfg.get("text_config") or cfg).get("hidden_size", 0))),
        num_position_embeddings=int(vision["num_position_embeddings"]),
        deepstack_layers=tuple(int(i) for i in vision["deepstack_visual_indexes"]),
        video_token_id=int(cfg.get("video_token_id", 151_656)))
    if config.hidden_act != "gelu_pytorch_tanh":
        raise ValueError(f"vision_config.hidden_act {config.hidden_act!r} is not served (gelu_pytorch_tanh only)")
    if (config.hidden_size // config.num_heads) % 4:
        raise ValueError("vision_config's head size must be a multiple of 4 (2D RoPE)")
    side = round(config.num_position_embeddings ** 0.5)
    if side * side != config.num_position_embeddings:
        raise ValueError(f"vision_config.num_position_embeddings {config.num_position_embeddings} is not a square")
    return config


# Qwen2VLVisionConfig's, where config.json leaves them out: its width is embed_dim, its rows' hidden_size.
QWEN2_VL_DEFAULTS = {"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "mlp_ratio": 4, "num_heads": 16,
                     "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                     "hidden_act": "quick_gelu"}


def qwen2_vl_vision_config(cfg: dict[str, Any]) -> VisionConfig:
    """Qwen2-VL's (Qwen2VLForConditionalGeneration's config.json): a tower of full attention over an image of any
    size in whole 28-pixel squares, each square's four patches merged into one row. ValueError for settings not
    served."""
    vision = {**QWEN2_VL_DEFAULTS, **(cfg.get("vision_config") or {})}
    rope = vision.get("rope_parameters") or {}
    width = int(vision["embed_dim"])
    config = VisionConfig(
        family=QWEN2_VL, hidden_size=width, intermediate_size=int(width * vision["mlp_ratio"]),
        num_layers=int(vision["depth"]), num_heads=int(vision["num_heads"]), image_size=0,
        patch_size=int(vision["patch_size"]), layer_norm_eps=1e-6, hidden_act=vision["hidden_act"],
        image_token_id=int(cfg.get("image_token_id", 151_655)),
        num_channels=int(vision.get("in_channels", vision.get("in_chans", 3))),
        spatial_merge_size=int(vision["spatial_merge_size"]), rope_theta=float(rope.get("rope_theta", 10_000.0)),
        temporal_patch_size=int(vision["temporal_patch_size"]), out_hidden_size=int(vision["hidden_size"]),
        video_token_id=int(cfg.get("video_token_id", 151_656)))
    if config.hidden_act != "quick_gelu":
        raise ValueError(f"vision_config.hidden_act {config.hidden_act!r} is not served (quick_gelu only)")
    if (config.hidden_size // config.num_heads) % 4:
        raise ValueError("vision_config's head size must be a multiple of 4 (2D RoPE)")
    return config


# Llama4VisionConfig's and Llama4Config's, where config.json leaves them out.
LLAMA4_VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 5632, "num_hidden_layers": 34,
                          "num_attention_heads": 16, "num_channels": 3, "image_size": 448, "patch_size": 14,
                          "vision_output_dim": 7680, "pixel_shuffle_ratio": 0.5, "projector_input_dim": 4096,
                          "projector_output_dim": 4096, "hidden_act": "gelu"}


def llama4_vision_config(cfg: dict[str, Any]) -> VisionConfig:
    """Llama 4's (Llama4ForConditionalGeneration's config.json: Scout, Maverick): a tower over square tiles of
    image_size pixels, patches by an unfolded linear map, 2D RoPE, each tile's patch states pixel-shuffled (2x2 of
    them into one, at pixel_shuffle_ratio 0.5) through an MLP, then projected: (image_size / patch_size)^2 x
    ratio^2 rows a tile. Its activations are GELU and its projector has no bias whatever config.json says, as
    transformers builds it. ValueError for settings not served."""
    vision = {**LLAMA4_VISION_DEFAULTS, **(cfg.get("vision_config") or {})}
    rope = vision.get("rope_parameters") or {}
    ratio = float(vision["pixel_shuffle_ratio"])
    merge = round(1 / ratio) if ratio > 0 else 0
    patches = int(vision["image_size"]) // int(vision["patch_size"])
    config = VisionConfig(
        family=LLAMA4, hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
        num_layers=int(vision["num_hidden_layers"]), num_heads=int(vision["num_attention_heads"]),
        image_size=int(vision["image_size"]), patch_size=int(vision["patch_size"]), layer_norm_eps=1e-5,
        hidden_act=vision["hidden_act"], image_token_id=int(cfg.get("image_token_index", 200_092)),
        tokens_per_image=(patches // merge) ** 2 if merge else 0, num_channels=int(vision["num_channels"]),
        spatial_merge_size=merge, rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", 10_000.0))),
        out_hidden_size=int(vision["vision_output_dim"]), projector_input_dim=int(vision["projector_input_dim"]),
        projector_output_dim=int(vision["projector_output_dim"]))
    if merge < 1 or merge * ratio != 1 or patches % merge or patches * config.patch_size != config.image_size:
        raise ValueError(f"vision_config: pixel_shuffle_ratio {ratio} must be 1/n for an n dividing the "
                         f"{patches} patches on a tile's side (image_size / patch_size, whole)")
    if config.intermediate_size != config.hidden_size * merge * merge:
        raise ValueError("vision_config.intermediate_size must be hidden_size x (1 / pixel_shuffle_ratio)^2: the "
                         "adapter's MLP takes the pixel-shuffled states")
    if config.projector_input_dim != config.projector_output_dim or \
            config.out_hidden_size != config.projector_output_dim:
        raise ValueError("vision_config: projector_input_dim, projector_output_dim and vision_output_dim must be "
                         "equal (the adapter's second layer and the projector take the first's output)")
    if (config.hidden_size // config.num_heads) % 4:
        raise ValueError("vision_config's head size must be a multiple of 4 (2D RoPE)")
    return config


# Step3p7VisionConfig's and Step3p7Config's, where config.json leaves them out (the released config's older names of
# its width, depth, heads and layer scales read too).
STEP3P7_VISION_DEFAULTS = {"hidden_size": 1536, "num_hidden_layers": 47, "num_attention_heads": 16, "num_channels": 3,
                           "image_size": 728, "patch_size": 14, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5,
                           "mlp_ratio": 8960 / 1536}
STEP3P7_VISION_ALIASES = {"width": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads"}
STEP3P7_IMAGE_TOKEN = 151_679


def step3p7_vision_config(cfg: dict[str, Any]) -> VisionConfig:
    """Step-3.7's (Step3p7ForConditionalGeneration's config.json): a tower over square views of an image (a global
    one of image_size pixels, local crops of the image processor's patch_size), each patch's learnt position
    resampled to the view, 2D RoPE, LayerNorm layers whose branches are scaled by learnt layer scales, its patch grid
    downsampled by two 3x3 convolutions of stride 2 into a row per 4x4 patches, then projected. ValueError for
    settings not served."""
    given = cfg.get("vision_config") or {}
    vision = {**STEP3P7_VISION_DEFAULTS, **{STEP3P7_VISION_ALIASES.get(k, k): v for k, v in given.items()}}
    rope = vision.get("rope_parameters") or {}
    hidden = int(vision["hidden_size"])
    config = VisionConfig(
        family=STEP3P7, hidden_size=hidden, intermediate_size=int(hidden * float(vision["mlp_ratio"])),
        num_layers=int(vision["num_hidden_layers"]), num_heads=int(vision["num_attention_heads"]),
        image_size=int(vision["image_size"]), patch_size=int(vision["patch_size"]),
        layer_norm_eps=float(vision["layer_norm_eps"]), hidden_act=vision["hidden_act"],
        image_token_id=int(cfg.get("image_token_id", STEP3P7_IMAGE_TOKEN)), num_channels=int(vision["num_channels"]),
        spatial_merge_size=4, rope_theta=float(rope.get("rope_theta", 10_000.0)),
        projector_bias=bool(cfg.get("projector_bias", False)))
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision_config's rope_type {rope['rope_type']!r} is not served (axial only)")
    if config.hidden_act != "quick_gelu":
        raise ValueError(f"vision_config.hidden_act {config.hidden_act!r} is not served (quick_gelu only)")
    if (hidden // config.num_heads) % 4 or hidden % config.num_heads:
        raise ValueError("vision_config's head size must be a whole multiple of 4 (2D RoPE, each axis half a head)")
    return config
