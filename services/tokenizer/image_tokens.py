"""How a multimodal model's prompt holds an image (Gemma 3's processor): the chat template writes a mark
where each image goes, which becomes the mark, a run of one placeholder token per row of the image's
encoding, and an end mark (blank lines around them), as transformers' processor expands it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ImageTokens:
    begin: str  # the template's mark of an image: Gemma 3's "<start_of_image>"
    token: str  # each row's placeholder: "<image_soft_token>"
    end: str  # "<end_of_image>"
    tokens_per_image: int

    @classmethod
    def read(cls, tokenizer_config: dict[str, Any], processor_config: dict[str, Any],
             model_config: dict[str, Any]) -> ImageTokens | None:
        """From tokenizer_config.json's boi/image/eoi tokens (top-level or among its extra special tokens)
        and processor_config.json's image_seq_length (or config.json's mm_tokens_per_image); None for a
        model without them."""
        extra = tokenizer_config.get("extra_special_tokens")
        named = {**(extra if isinstance(extra, dict) else {}), **tokenizer_config}
        marks = [named.get(name) for name in ("boi_token", "image_token", "eoi_token")]
        count = processor_config.get("image_seq_length") or model_config.get("mm_tokens_per_image")
        if not all(isinstance(mark, str) and mark for mark in marks) or not count:
            return None
        return cls(*marks, tokens_per_image=int(count))

    def expanded(self, text: str, num_images: int) -> str:
        """`text` (a rendered chat) with each image's mark made its whole run; ValueError unless it has a
        mark for each of `num_images`."""
        marks = text.count(self.begin)
        if marks != num_images:
            raise ValueError(f"the chat template wrote {marks} image mark(s) ({self.begin}) for {num_images} "
                             "image(s)")
        return text.replace(self.begin, f"\n\n{self.begin}{self.token * self.tokens_per_image}{self.end}\n\n")
