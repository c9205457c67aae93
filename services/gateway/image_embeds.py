"""vLLM's image_embeds parts (the gateway's --enable-mm-embeds): an image given as its encoder's rows, which the
workers take in place of its tokens' embeddings without encoding anything, so that an encoder elsewhere (vLLM's
disaggregated encoder) or a client's cache can do that work. Gemma 3's: the base64 of a torch.save'd [256, hidden]
tensor (the tower, pooling and projector's rows), placed as an image of its tower's size; Qwen2-VL's,
Qwen2.5-VL's and Qwen3-VL's: an object of that [tokens, hidden] tensor (Qwen3-VL's with each DeepStack layer's rows
beside, [tokens, hidden x (1 + layers)], as vLLM takes them) and of its image's `image_grid_thw` (one frame, its
height and width in patches), which places its tokens and their RoPE positions. Other models' images are
refused. Imported only by a gateway that takes them: torch."""
from __future__ import annotations

from dataclasses import dataclass

from protos import common_pb2
from services.gateway.chat_messages import ImageEmbedsPart
from services.gateway.errors import APIError
from services.gateway.given_embeddings import EmbeddedImage, checked_embeddings
from services.gateway.image_processing import ImageProcessing
from services.gateway.prompt_embeds import PromptEmbedsReader, loaded_tensor


@dataclass(frozen=True)
class ImageEmbedsReader:
    processing: ImageProcessing  # the model's image processor's: its tower's size, or its patches' (Qwen-VL's)
    rows: PromptEmbedsReader  # the text model's width

    def read(self, part: ImageEmbedsPart | common_pb2.ChatImageEmbeds, param: str) -> EmbeddedImage:
        """The image `part` gives (the HTTP API's part, or the gRPC API's rows); APIError (400) naming `param` for
        one that is not as the model takes it (the workers check its rows against its tokens)."""
        takes_grid = self.processing.max_pixels is not None  # Qwen-VL's: the grid places its tokens
        if isinstance(part, common_pb2.ChatImageEmbeds):
            rows = checked_embeddings(part.rows, param)
            if rows.hidden_size != self.rows.hidden_size:
                raise APIError(400, f"{param}: rows of {self.rows.hidden_size} values ({self.rows.width}), got "
                                    f"{rows.hidden_size}", param=param)
            return self._placed(rows, list(part.image_grid_thw) if takes_grid else None, param)
        given = part.image_embeds
        if takes_grid:
            if not isinstance(given, dict) or set(given) != {"image_embeds", "image_grid_thw"}:
                raise APIError(400, f"{param}: this model's image_embeds are an object of image_embeds and "
                                    "image_grid_thw (each the base64 of a torch.save'd tensor)", param=param)
            grid = loaded_tensor(given["image_grid_thw"], param).reshape(-1).tolist()
            return self._placed(self.rows.read(given["image_embeds"], param), grid, param)
        if not isinstance(given, str):
            raise APIError(400, f"{param}: this model's image_embeds are the base64 of a torch.save'd tensor",
                           param=param)
        return self._placed(self.rows.read(given, param), None, param)

    def _placed(self, rows: common_pb2.PromptEmbeds, grid: list[int] | None, param: str) -> EmbeddedImage:
        """`rows` as the image of `grid` (Qwen-VL's) or of the tower's size (Gemma 3's)."""
        processing = self.processing
        if grid is not None:
            if len(grid) != 3 or grid[0] != 1 or min(grid) < 1:
                raise APIError(400, f"{param}: image_grid_thw must be one image's [1, height, width] in patches, "
                                    f"got {grid}", param=param)
            patch = processing.pixels_per_token // processing.merge_size
            return EmbeddedImage.of(rows, grid[1] * patch, grid[2] * patch)
        if processing.pan_and_scan is None:  # Gemma 3's the only other processor of one size
            raise APIError(400, f"{param}: image_embeds are taken for Gemma 3's and Qwen2-VL's, Qwen2.5-VL's and "
                                "Qwen3-VL's images only", param=param)
        return EmbeddedImage.of(rows, processing.height, processing.width)
