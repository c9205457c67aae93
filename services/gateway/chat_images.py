"""A chat's images and videos, read (image_inputs.py's ChatImages, where the model takes images) as every API that
takes chat messages reads them: the HTTP APIs' generation, /tokenize and count_tokens, and the gRPC API's alike."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from protos import common_pb2
from services.gateway.chat_messages import ChatMessage, ImagePart, ImageURL, VideoPart, VideoURL
from services.gateway.errors import APIError
from services.gateway.given_embeddings import GivenImages
from services.tokenizer.image_tokens import ImageSize


async def chat_images(state, messages: Sequence[ChatMessage], param: str = "messages",
                      processor_kwargs: Mapping[str, Any] | None = None,
                      media_io_kwargs: Mapping[str, Any] | None = None) -> GivenImages | None:
    """The messages' images (their pixels, or rows given as image_embeds parts) and videos, in order (None for
    none), read with a request's `processor_kwargs` and `media_io_kwargs` (vLLM's); APIError (400) naming `param`
    where the model takes none, or one cannot be read. `state`: what has the gateway's `images` and `model_name`
    (http_app.GatewayState, the gRPC API's servicer, whose messages give their images' URLs)."""
    sources = [source for message in messages for source in (
        message.media_sources if isinstance(message, ChatMessage) else grpc_media_sources(message))]
    if not sources:
        return None
    if state.images is None:
        raise APIError(400, f"{state.model_name} takes no images: a message's content is text here", param=param)
    return await state.images.read(sources, param, processor_kwargs, media_io_kwargs)


async def chat_image_sizes(state, messages: Sequence[ChatMessage], processor_kwargs: Mapping[str, Any] | None = None,
                           media_io_kwargs: Mapping[str, Any] | None = None) -> list[ImageSize]:
    """Each of their images' size as the model's image processor resizes it (with `processor_kwargs`), and its
    crops' count: what a count of their tokens needs (some models' images take as many as their size makes)."""
    images = await chat_images(state, messages, processor_kwargs=processor_kwargs, media_io_kwargs=media_io_kwargs)
    return images.sizes if images is not None else []


def grpc_media_sources(message: common_pb2.ChatMessage
                       ) -> list[str | ImagePart | common_pb2.ChatImageEmbeds | VideoPart]:
    """A gRPC API message's images and videos in the order of its parts: each image given as rows at its index, its
    URLs in the other places (the gRPC API checked they fill its image_parts), each video by its URL; an image or
    video its uuid names, as the HTTP API's part with that uuid (its URL "": the uuid alone)."""
    image_uuids = message.image_uuids or [""] * len(message.image_urls)
    urls = iter([ImagePart(type="image_url", image_url=ImageURL(url=url) if url else None, uuid=uuid) if uuid else url
                 for url, uuid in zip(message.image_urls, image_uuids, strict=True)])
    by_index = {embeds.index: embeds for embeds in message.image_embeds}
    images = [by_index[i] if i in by_index else next(urls) for i in range(len(message.image_parts))]
    video_uuids = message.video_uuids or [""] * len(message.video_urls)
    videos = [VideoPart(type="video_url", video_url=VideoURL(url=url) if url else None, uuid=uuid or None)
              for url, uuid in zip(message.video_urls, video_uuids, strict=True)]
    placed = sorted([*zip(message.image_parts, images), *zip(message.video_parts, videos)], key=lambda p: p[0])
    return [source for _, source in placed]
