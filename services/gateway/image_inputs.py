"""A chat message's images and videos, read from a data: URL, an http(s) URL, or a file:// one under
--allowed-local-media-path, and made by the model's image processor (image_processing.py) or video processor
(video_processing.py, video_frames.py) into what the workers take: each prompt's within --limit-mm-per-prompt and a
message's size, a conversation's kept by their bytes (--mm-processor-cache-gb)."""
from __future__ import annotations

import asyncio
import base64
import binascii
import io
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import httpx
from PIL import Image, UnidentifiedImageError
from prometheus_client import Counter, Histogram

from protos import common_pb2
from services.common.metrics.service import LATENCY_BUCKETS
from services.common.mm_limits import VIDEO_KWARGS, checked_media_io_kwargs, checked_processor_kwargs
from services.gateway.chat_messages import ImageEmbedsPart, ImagePart, VideoPart
from services.gateway.errors import APIError
from services.gateway.given_embeddings import EmbeddedImage, GivenImages, ProcessedImage
from services.gateway.image_cache import ProcessedImageCache
from services.gateway.image_processing import ImageProcessing
from services.gateway.video_frames import processed_video

if TYPE_CHECKING:
    from services.gateway.image_embeds import ImageEmbedsReader
    from services.gateway.video_processing import VideoProcessing

# An image given as its encoder's rows: the HTTP API's image_embeds part, or the gRPC API's.
ImageGivenAsRows = ImageEmbedsPart | common_pb2.ChatImageEmbeds

MAX_IMAGE_BYTES = 32 * 2**20  # an image's encoded bytes, fetched or given
MAX_VIDEO_BYTES = 256 * 2**20  # a video's, fetched
# Of a message to a worker, what a prompt's images leave for the rest of the request (its prompt's token ids).
MESSAGE_HEADROOM_BYTES = 2**20
FETCH_TIMEOUT_S = 10.0
VIDEO_FETCH_TIMEOUT_S = 30.0  # vLLM's VLLM_VIDEO_FETCH_TIMEOUT

# Where a request's time before its prompt goes with media in it (the ledger's `ingress`): fetched, decoded, resized.
MEDIA_READ = Histogram("baton_gateway_media_read_seconds", "Reading a prompt's images and videos (fetched, decoded, "
                       "resized, hashed), by whether it holds a video", ["kind"], buckets=LATENCY_BUCKETS)
VIDEO_FRAMES = Counter("baton_gateway_video_frames_total", "Frames of videos read, as sampled and padded to pairs")


@dataclass(frozen=True)
class ChatImages:
    """What reads a chat's images for a model that takes them."""

    processing: ImageProcessing
    allowed_local_path: Path | None = None  # file:// images are read under it (--allowed-local-media-path)
    # The hosts http(s) images are fetched from, and redirected to (vLLM's --allowed-media-domains, against
    # server-side request forgery: a request's URL naming the cloud's metadata service, or an internal one);
    # None: any.
    allowed_domains: frozenset[str] | None = None
    limit: int | None = None  # a prompt's most images (--limit-mm-per-prompt); None: any
    cache: ProcessedImageCache | None = None  # None: each image made again (--mm-processor-cache-gb 0)
    # The most bytes of pixels a prompt's images may take: they travel in one gRPC message to each worker
    # (--max-message-bytes); None: no bound here.
    max_bytes: int | None = None
    embeds: ImageEmbedsReader | None = None  # what reads images given as their encoder's rows (--enable-mm-embeds)
    videos: VideoProcessing | None = None  # what reads videos (Qwen-VL's); None: the model takes none
    video_limit: int | None = None  # a prompt's most videos; None: any

    async def read(self, sources: Sequence[str | ImagePart | ImageGivenAsRows | VideoPart], param: str = "messages",
                   processor_kwargs: Mapping[str, Any] | None = None,
                   media_io_kwargs: Mapping[str, Any] | None = None) -> GivenImages:
        """The images of their URLs (or given as their encoder's rows) and the videos of theirs, in order, read by
        the processor's settings with `processor_kwargs` (a request's mm_processor_kwargs, as vLLM takes them) and
        `media_io_kwargs` (a request's, vLLM's: a video's num_frames, an image's rgba_background_color) over them;
        APIError (400) naming `param` for one that cannot be read, or for more than the limit, and naming
        mm_processor_kwargs or media_io_kwargs for settings not served."""
        num_videos = sum(isinstance(source, VideoPart) for source in sources)
        num_images = len(sources) - num_videos
        if num_videos and self.videos is None:
            raise APIError(400, f"{param}: this model takes no videos here (Qwen-VL's do, unless "
                                "--limit-mm-per-prompt gives them 0)", param=param)
        if self.video_limit is not None and num_videos > self.video_limit:
            raise APIError(400, f"{num_videos} videos in one prompt, more than this server's limit of "
                                f"{self.video_limit} (--limit-mm-per-prompt)", param=param)
        if self.limit == 0:  # its workers load no image encoder (--enable-mm-embeds with a limit of 0)
            if any(isinstance(source, (str, ImagePart)) for source in sources):
                raise APIError(400, f"{param}: this server takes images only as their encoder's rows (image_embeds "
                                    "parts; --limit-mm-per-prompt 0 with --enable-mm-embeds)", param=param)
        elif self.limit is not None and num_images > self.limit:
            raise APIError(400, f"{num_images} images in one prompt, more than this server's limit of {self.limit} "
                                "(--limit-mm-per-prompt)", param=param)
        processing, videos = self.processing, self.videos
        if media_io_kwargs:
            try:
                media_io = checked_media_io_kwargs(dict(media_io_kwargs), "media_io_kwargs")
            except ValueError as e:
                raise APIError(400, str(e), param="media_io_kwargs") from None
            processing = processing.with_media_io(media_io)
            if videos is not None and "video" in media_io:
                videos = videos.with_overrides(media_io["video"])
        if processor_kwargs:
            try:
                kwargs = checked_processor_kwargs(dict(processor_kwargs), "mm_processor_kwargs")
                processing = processing.with_kwargs(kwargs)
            except ValueError as e:
                raise APIError(400, str(e), param="mm_processor_kwargs") from None
            if videos is not None:
                videos = videos.with_request_kwargs(kwargs)
            elif video_kwargs := sorted(set(VIDEO_KWARGS) & set(kwargs)):
                raise APIError(400, f"mm_processor_kwargs: this model takes no videos here, nor "
                                    f"{', '.join(video_kwargs)}", param="mm_processor_kwargs")
        if self.embeds is None and any(isinstance(source, ImageGivenAsRows) for source in sources):
            raise APIError(400, f"{param}: image_embeds parts are taken only by a gateway started with "
                                "--enable-mm-embeds", param=param)
        # A data: URL as it is (its text names its bytes), another's bytes fetched or read here.
        start = time.perf_counter()
        # Fetched at once (each URL's round trips its own); one named by its uuid not at all where the cache holds it.
        read = await asyncio.gather(*(self._named(source, param, processing, videos) if _is_named(source) else
                                      self._fetched(source, param) for source in sources))
        # Off the event loop, in turn (the cache's order of use is the prompt's): decoding and resizing a photo takes
        # tens of milliseconds (PIL lets go of the GIL), hashing its pixels a few more, and a data: URL's base64 3 ms
        # a megabyte (rows given: torch.load's).
        images = await asyncio.to_thread(lambda: GivenImages(tuple(
            self._made(source, processing, videos, param) for source in read)))
        MEDIA_READ.labels("video" if num_videos else "image").observe(time.perf_counter() - start)
        VIDEO_FRAMES.inc(sum(image.size.frames for image in images.images))
        size = images.num_bytes
        if self.max_bytes is not None and size > self.max_bytes:
            raise APIError(413, f"the prompt's images take {size / 2**20:.1f} MiB as the model's image processor "
                                f"resizes them, more than a message to a worker carries ({self.max_bytes / 2**20:.1f} "
                                "MiB, --max-message-bytes): send fewer or smaller images, or bound them by "
                                "mm_processor_kwargs (Qwen-VL's max_pixels)", param=param)
        return images

    async def _named(self, part: ImagePart | VideoPart | ImageGivenAsRows, param: str, processing: ImageProcessing,
                     videos: VideoProcessing | None) -> Named:
        """A part named by its uuid (vLLM's): what the cache holds under it, made by the same settings, or else its
        URL's data as `_fetched` reads it (its rows, the gRPC API's image_embeds' too: a uuid names them in either
        API); APIError (400) for a part that gives only its uuid and is not cached."""
        is_grpc_rows = isinstance(part, common_pb2.ChatImageEmbeds)
        kind = "image_embeds" if is_grpc_rows else part.type.removesuffix("_url")
        settings = ""  # the model's own, or rows given: taken as they are
        if kind == "video":
            settings = repr(videos)
        elif kind == "image" and processing is not self.processing:
            settings = repr(processing)
        key = b"\0".join((b"uuid", kind.encode(), settings.encode(), part.uuid.encode()))
        held = self.cache.cached(key) if self.cache is not None else None
        if held is not None:
            return Named(key, None, held)
        if kind == "image_embeds" and (part.HasField("rows") if is_grpc_rows else part.image_embeds is not None):
            return Named(key, part)
        url = part.video_url if kind == "video" else getattr(part, "image_url", None)
        if url is None:
            off = "" if self.cache is not None else " (this server caches none: --mm-processor-cache-gb 0)"
            what = "image given as rows" if kind == "image_embeds" else kind
            raise APIError(400, f"{param}: no {what} is cached under uuid {part.uuid!r} (read by these settings) here: "
                                f"send it with its {'rows' if is_grpc_rows else part.type}{off}", param=param)
        return Named(key, await self._fetched(VideoPart(type="video_url", video_url=url) if kind == "video"
                                              else url.url, param))

    def _made(self, source: str | bytes | ImageGivenAsRows | Video | Named, processing: ImageProcessing,
              videos: VideoProcessing | None, param: str) -> ProcessedImage | EmbeddedImage:
        """What the workers take of a prompt's image or video as it was read (`_fetched`, `_named`)."""
        key = None
        if isinstance(source, Named):
            if source.held is not None:
                return source.held
            key, source = source.key, source.source
        if isinstance(source, ImageGivenAsRows):
            if key is None or self.cache is None:
                return self.embeds.read(source, param)
            return self.cache.processed(key, lambda: self.embeds.read(source, param))
        if isinstance(source, Video):
            return self._video(source, videos, param, key)
        return self._processed(source, processing, param, key)

    async def _fetched(self, source: str | ImageGivenAsRows | VideoPart, param: str
                       ) -> str | bytes | ImageGivenAsRows | Video:
        """An http(s) or file:// URL's bytes, fetched or read; a data: URL (or rows) as it is."""
        if isinstance(source, VideoPart):
            url = source.video_url.url
            return Video(url if is_data_url(url) else await _media_bytes(
                url, self.allowed_local_path, self.allowed_domains, param, "video", MAX_VIDEO_BYTES,
                VIDEO_FETCH_TIMEOUT_S))
        if isinstance(source, str) and not is_data_url(source):
            return await _media_bytes(source, self.allowed_local_path, self.allowed_domains, param)
        return source

    def _video(self, video: Video, videos: VideoProcessing, param: str, key: bytes | None = None) -> ProcessedImage:
        """A video's frames as the model's video processor (`videos`: its settings, a request's over them) makes
        them, from the cache where it holds them (by its bytes and those settings, or by `key`: its uuid's)."""
        def make() -> ProcessedImage:
            data = data_url_bytes(video.source, param) if isinstance(video.source, str) else video.source
            return processed_video(videos, data, self.max_bytes, param)

        if self.cache is None:
            return make()
        source = video.source.encode() if isinstance(video.source, str) else video.source
        return self.cache.processed(key or repr(videos).encode() + source, make)

    def _processed(self, source: str | bytes, processing: ImageProcessing, param: str,
                   key: bytes | None = None) -> ProcessedImage:
        """The image of a data: URL (`source` a str) or of encoded bytes, from the cache where it holds it (by
        the URL's text, and the settings it was read by: a hit decodes no base64; or by `key`: its uuid's)."""
        def make() -> ProcessedImage:
            data = data_url_bytes(source, param) if isinstance(source, str) else source
            return processing.processed(read_image(data, param), self.max_bytes)

        if self.cache is None:
            return make()
        settings = b"" if processing is self.processing else repr(processing).encode()
        return self.cache.processed(key or settings + (source.encode() if isinstance(source, str) else source), make)


@dataclass(frozen=True)
class Video:
    """A video part's data: URL, or its bytes as fetched."""

    source: str | bytes


@dataclass(frozen=True)
class Named:
    """An image or video a request named by its uuid: its key in the cache, and what the cache held under it, or
    else its part's data as read."""

    key: bytes
    source: str | bytes | Video | ImageGivenAsRows | None
    held: ProcessedImage | EmbeddedImage | None = None


def _is_named(source: object) -> bool:
    if isinstance(source, common_pb2.ChatImageEmbeds):
        return bool(source.uuid)
    return isinstance(source, (ImagePart, VideoPart, ImageEmbedsPart)) and source.uuid is not None


def read_image(data: bytes, param: str) -> Image.Image:
    """The image `data` encodes (PNG, JPEG, ...); APIError (400) for bytes that are not one."""
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise APIError(400, f"{param}: not an image this server reads: {e}", param=param) from None
    return image


def is_data_url(url: str) -> bool:
    return url[:5].lower() == "data:"


def data_url_bytes(url: str, param: str) -> bytes:
    """The bytes a base64 data: URL holds; APIError (400) for another."""
    header, _, encoded = url.partition(",")
    if not header.endswith(";base64"):
        raise APIError(400, f"{param}: a data URL's image must be base64 (data:image/...;base64,...)", param=param)
    try:
        return base64.b64decode(encoded, validate=True)
    except binascii.Error as e:
        raise APIError(400, f"{param}: the data URL is not base64: {e}", param=param) from None


async def _media_bytes(url: str, allowed_local_path: Path | None, allowed_domains: frozenset[str] | None,
                       param: str, kind: str = "image", most_bytes: int = MAX_IMAGE_BYTES,
                       timeout_s: float = FETCH_TIMEOUT_S) -> bytes:
    """The encoded bytes of an http(s) or file:// URL's image (or video: `kind`), at most `most_bytes`, fetched
    within `timeout_s`."""
    scheme = urlparse(url).scheme
    if scheme in ("http", "https"):
        async def check_host(request: httpx.Request) -> None:  # the URL's, and each redirect's
            if allowed_domains is not None and request.url.host not in allowed_domains:
                raise APIError(400, f"{param}: {kind}s are fetched only from the gateway's --allowed-media-domains "
                                    f"({', '.join(sorted(allowed_domains))}), not {request.url.host!r}", param=param)

        try:
            async with httpx.AsyncClient(timeout=timeout_s, follow_redirects=True,
                                         event_hooks={"request": [check_host]}) as client, \
                    client.stream("GET", url) as response:
                response.raise_for_status()
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > most_bytes:
                        raise APIError(400, f"{param}: the {kind} is over {most_bytes} bytes", param=param)
                return bytes(body)
        except httpx.HTTPError as e:
            raise APIError(400, f"{param}: the {kind} could not be fetched: {e}", param=param) from None
    if scheme == "file":
        if allowed_local_path is None:
            raise APIError(400, f"{param}: file:// {kind}s are read only under the gateway's "
                                "--allowed-local-media-path", param=param)
        path = Path(unquote(urlparse(url).path)).resolve()
        if not path.is_relative_to(allowed_local_path.resolve()) or not path.is_file():
            raise APIError(400, f"{param}: {path} is not a file under --allowed-local-media-path", param=param)
        if path.stat().st_size > most_bytes:
            raise APIError(400, f"{param}: the {kind} is over {most_bytes} bytes", param=param)
        return path.read_bytes()
    raise APIError(400, f"{param}: the {kind}'s URL must be data:, http(s): or file:, got {url[:40]!r}", param=param)
