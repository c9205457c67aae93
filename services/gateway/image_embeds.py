"""vLLM's image_embeds parts (the gateway's --enable-mm-embeds): an image given as its encoder's rows, which the
workers take in place of its tokens' embeddings without encoding anything, so that an encoder elsewhere (vLLM's
disaggregated encoder) or a client's cache can do that work. Gemma 3's: the base64 of a torch.save'd [256, hidden]
tensor (the tower, pooling and projector's rows), placed as an image of its tower's size; Qwen2-VL's and
Qwen2.5-VL's: an object of that [tokens, hidden] tensor and of its image's `image_grid_thw` (one frame, its height
and width in patches), which places its tokens and their RoPE positions. Other models' images are refused. Imported
only by a gateway that takes them: torch."""
from __future__ import annotations

from dataclasses import dataclass

from services.gateway.chat_messages import ImageEmbedsPart
from services.gateway.errors import APIError
from services.gateway.given_embeddings import EmbeddedImage
from services.gateway.image_processing import ImageProcessing
from services.gateway.prompt_embeds import PromptEmbedsReader, loaded_tensor


@dataclass(frozen=True)
class ImageEmbedsReader:
    processing: ImageProcessing  # the model's image processor's: its tower's size, or its patches' (Qwen-VL's)
    rows: PromptEmbedsReader  # the text model's width

    def read(self, part: ImageEmbedsPart, param: str) -> EmbeddedImage:
        """The image `part` gives; APIError (400) naming `param` for one that is not as the model takes it (the
        workers check its rows against its tokens)."""
        given = part.image_embeds
        processing = self.processing
        if processing.max_pixels is not None:  # Qwen-VL's: the grid places its tokens
            if not isinstance(given, dict) or set(given) != {"image_embeds", "image_grid_thw"}:
                raise APIError(400, f"{param}: this model's image_embeds are an object of image_embeds and "
                                    "image_grid_thw (each the base64 of a torch.save'd tensor)", param=param)
            grid = loaded_tensor(given["image_grid_thw"], param).reshape(-1).tolist()
            if len(grid) != 3 or grid[0] != 1 or min(grid) < 1:
                raise APIError(400, f"{param}: image_grid_thw must be one image's [1, height, width] in patches, "
                                    f"got {grid}", param=param)
            patch = processing.pixels_per_token // processing.merge_size
            return EmbeddedImage.of(self.rows.read(given["image_embeds"], param), grid[1] * patch, grid[2] * patch)
        if processing.pan_and_scan is None:  # Gemma 3's the only other processor of one size
            raise APIError(400, f"{param}: image_embeds are taken for Gemma 3's and Qwen2-VL's and Qwen2.5-VL's "
                                "images only", param=param)
        if not isinstance(given, str):
            raise APIError(400, f"{param}: this model's image_embeds are the base64 of a torch.save'd tensor",
                           param=param)
        return EmbeddedImage.of(self.rows.read(given, param), processing.height, processing.width)
