"""A chat message as the OpenAI API sends it (`ChatMessage`: text, and image and video parts for a model that takes
them), and as chat templates read it: the chat API's, the Responses API's, /tokenize's and the gRPC
API's messages alike."""
from __future__ import annotations

import json
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from services.tokenizer.content_format import IMAGE_PART, VIDEO_PART


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: str
    detail: str | None = None  # OpenAI's; an image is read at the model's one resolution here


class MediaPart(BaseModel):
    """An image or video part, which vLLM's `uuid` may name in the processed-image cache in place of its bytes; one
    that gives only its uuid (its URL null) is the image or video sent before under it."""

    model_config = ConfigDict(extra="ignore")
    uuid: str | None = None

    @model_validator(mode="after")
    def _given_or_named(self):
        if getattr(self, self.type) is None and self.uuid is None:
            raise ValueError(f"{self.type} part: give its {self.type}, or the uuid of one sent before")
        return self


class ImagePart(MediaPart):
    """OpenAI's image part: its pixels read from `image_url.url` (image_inputs.py), where the model takes images."""

    type: Literal["image_url"]
    image_url: ImageURL | None = None


class VideoURL(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: str


class VideoPart(MediaPart):
    """vLLM's video part: its frames read from `video_url.url` (image_inputs.py), where the model takes videos
    (Qwen-VL's)."""

    type: Literal["video_url"]
    video_url: VideoURL | None = None


class ImageEmbedsPart(MediaPart):
    """vLLM's image given as its encoder's rows (the gateway's --enable-mm-embeds; image_embeds.py): the base64 of
    a torch.save'd [tokens, hidden] tensor, or, for Qwen-VL, an object of it and of its image_grid_thw's."""

    type: Literal["image_embeds"]
    image_embeds: str | dict[str, str] | None = None


PART_TYPES = {"text": TextPart, "image_url": ImagePart, "video_url": VideoPart, "image_embeds": ImageEmbedsPart}
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
CHAT_ROLES = frozenset(get_args(ChatRole))  # the gRPC API's chat messages are held to them too


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: ChatRole
    content: str | list[TextPart | ImagePart | VideoPart | ImageEmbedsPart | dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's, earlier in the conversation
    tool_call_id: str | None = None  # a tool message answers this call
    # An assistant's thinking, as this API returned it (`reasoning`; `reasoning_content`, vLLM's and
    # DeepSeek's older name): templates that show it read `reasoning_content`.
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _text_or_images(self):
        for part in self.content if isinstance(self.content, list) else ():
            if not isinstance(part, (TextPart, ImagePart, VideoPart, ImageEmbedsPart)):
                kind = PART_TYPES.get(part.get("type"))
                if kind is not None:  # a part of a kind served, left a plain dict by what is wrong in it
                    try:
                        kind.model_validate(part)
                    except ValidationError as e:
                        raise ValueError("; ".join(error["msg"].removeprefix("Value error, ")
                                                   for error in e.errors())) from None
                raise ValueError(f"content parts of type {part.get('type')!r} are not supported (text, "
                                 "image_url, video_url and image_embeds only)")
        return self

    @property
    def media_sources(self) -> list[str | ImagePart | ImageEmbedsPart | VideoPart]:
        """Its images and videos, in the order of its parts: each image's URL (its part, where a uuid names it), or
        its part given as its encoder's rows; each video's part."""
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url if isinstance(part, ImagePart) and part.uuid is None else part
                for part in self.content if isinstance(part, (ImagePart, VideoPart, ImageEmbedsPart))]

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates read it: its text (or its text parts, which the template's
        content format joins or keeps), and its tool calls with their arguments as objects (templates
        write them with `tojson`; OpenAI sends them as JSON text)."""
        content = [{"type": "text", "text": part.text} if isinstance(part, TextPart) else
                   dict(VIDEO_PART) if isinstance(part, VideoPart) else dict(IMAGE_PART)
                   for part in self.content] if isinstance(self.content, list) else self.text
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [with_parsed_arguments(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return message

    @property
    def text(self) -> str:
        """The message's text; content given as parts is joined, as chat templates expect."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content if isinstance(part, TextPart))


def with_parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}
