"""The image encoder of a multimodal checkpoint's family."""
from __future__ import annotations

import torch

from engine.vision.gemma3_images import Gemma3ImageEncoder
from engine.vision.gemma4_images import Gemma4ImageEncoder
from engine.vision.llama4_images import Llama4ImageEncoder
from engine.vision.mistral3_images import Mistral3ImageEncoder
from engine.vision.qwen2_5_vl_images import Qwen2_5_VLImageEncoder
from engine.vision.qwen3_vl_images import Qwen3VLImageEncoder
from engine.vision.step3p7_images import Step3p7ImageEncoder
from engine.vision.vision_config import (
    GEMMA3,
    GEMMA4,
    LLAMA4,
    PIXTRAL,
    QWEN2_5_VL,
    QWEN2_VL,
    QWEN3_VL,
    STEP3P7,
    VisionConfig,
)

ImageEncoder = (Gemma3ImageEncoder | Mistral3ImageEncoder | Qwen2_5_VLImageEncoder | Qwen3VLImageEncoder
                | Llama4ImageEncoder | Gemma4ImageEncoder | Step3p7ImageEncoder)
ENCODERS = {GEMMA3: Gemma3ImageEncoder, PIXTRAL: Mistral3ImageEncoder, QWEN2_5_VL: Qwen2_5_VLImageEncoder,
            QWEN3_VL: Qwen3VLImageEncoder, QWEN2_VL: Qwen3VLImageEncoder,  # Qwen2-VL's: Qwen3-VL's, stripped
            LLAMA4: Llama4ImageEncoder, GEMMA4: Gemma4ImageEncoder, STEP3P7: Step3p7ImageEncoder}


def image_encoder(config: VisionConfig, text_hidden_size: int, dtype: torch.dtype) -> ImageEncoder:
    return ENCODERS[config.family](config, text_hidden_size, dtype)
