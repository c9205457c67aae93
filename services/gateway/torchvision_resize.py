"""An image resized as transformers' torchvision image processors resize it (Llama 4's, Step-3.7's), by torch's own
kernels: torch is handed in, imported only by a gateway serving those models' images."""
from __future__ import annotations


def torchvision_resized(torch, pixels, height: int, width: int):
    """uint8 [height, width, 3] of `pixels` (uint8 [1, 3, H, W]): torchvision's antialiased bilinear resize of a
    uint8 image on the CPU, torch's own uint8 kernel (none where the size is the same)."""
    if tuple(pixels.shape[2:]) != (height, width):
        pixels = torch.nn.functional.interpolate(pixels, size=[height, width], mode="bilinear", align_corners=False,
                                                 antialias=True)
    return pixels[0].permute(1, 2, 0)
