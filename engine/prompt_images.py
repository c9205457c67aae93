"""A prompt's images (Gemma 3's, Mistral 3's, Qwen-VL's) and videos (Qwen-VL's): each as its model's
processor resized it (`ImageInput`), its runs of image tokens in the prompt (Gemma 3's one run, a span its rows attend
bidirectionally in; Mistral 3's a run a row of its grid; Qwen-VL's one run, placed by multimodal RoPE), and the
rows its encoder makes for them, made when a step first computes them (a decode worker's request, only after a
preemption)."""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from engine.block_hash import embeddings_digest, image_digest, images_digest
from engine.step_times import ImageEncode
from engine.vision.vision_config import PIXTRAL, QWENS

if TYPE_CHECKING:
    from engine import sequence
    from engine.llm_engine import LLMEngine
    from engine.vision.vision_config import VisionConfig


@dataclass(frozen=True, eq=False)
class ImageInput:
    """An image (or a video's frames) resized by its model's processor, and what its pixels are normalized by: a
    quarter of the float pixels' bytes, normalized only when it is encoded (as transformers' processors normalize:
    rescaled in float64, cast to float32, less the mean, over the std, channels first)."""

    rgb: torch.Tensor  # uint8 [height, width, channels]; a video's [frames, height, width, channels]
    rescale_factor: float
    mean: tuple[float, ...]
    std: tuple[float, ...]
    given_digest: str = ""  # its `digest` as its sender made it (the gateway's): not hashed again
    # Of the image before it (Gemma 3's pan-and-scan crop, Llama 4's global tile): not counted an image of its own.
    crop: bool = False
    # A video's frames a second as sampled (Qwen2.5-VL's temporal positions: a frame pair spans 2 / fps seconds).
    fps: float = 0.0

    @property
    def shape(self) -> tuple[int, ...]:
        """[height, width, channels], a video's frames' too."""
        return tuple(self.rgb.shape[-3:])

    @property
    def frames(self) -> int:
        """A video's frames; 0 for an image."""
        return self.rgb.shape[0] if self.rgb.dim() == 4 else 0

    def pixels(self, in_bfloat16: bool = False) -> torch.Tensor:
        """float32 [channels, height, width] (a video's [channels, frames, height, width]); or bfloat16, rescaled
        and normalized in bfloat16 as Llama 4's processor does (VisionConfig.normalizes_in_bfloat16)."""
        if in_bfloat16:
            rescaled = self.rgb.to(torch.bfloat16) * self.rescale_factor
        else:
            rescaled = (self.rgb.double() * self.rescale_factor).float()
        mean, std = torch.tensor(self.mean, dtype=rescaled.dtype), torch.tensor(self.std, dtype=rescaled.dtype)
        normalized = (rescaled - mean) / std
        return normalized.movedim(-1, 0).contiguous()

    @cached_property
    def digest(self) -> str:
        """What names it (engine/block_hash.py's `image_digest`): given, or made once where the image is first
        read (a worker does so off its engine thread: services/common/prompt_embeds.py)."""
        if self.given_digest:
            return self.given_digest
        return image_digest(memoryview(self.rgb.contiguous().numpy().reshape(-1)), tuple(self.rgb.shape),
                            self.rescale_factor, self.mean, self.std, self.fps)


@dataclass(frozen=True, eq=False)
class ImageRows:
    """An image given as its encoder's rows (vLLM's image_embeds): taken in place of its tokens' embeddings as an
    encoded image's are, never encoded here. `shape` is the size that places its tokens (Qwen-VL's grid of patches
    in pixels, and its RoPE positions; Gemma 3's tower's square)."""

    rows: torch.Tensor  # [tokens, text hidden size]
    shape: tuple[int, int, int]  # [height, width, channels]
    given_digest: str = ""  # its `digest` as its sender made it (the gateway's): not hashed again
    crop: bool = False
    frames, fps = 0, 0.0  # an image's: a video is not taken as rows here

    @cached_property
    def digest(self) -> str:
        if self.given_digest:
            return self.given_digest
        rows = self.rows.contiguous()
        return embeddings_digest(str(rows.dtype).removeprefix("torch."), [*rows.shape, *self.shape],
                                 rows.view(torch.uint8).numpy().tobytes())


@dataclass(frozen=True, eq=False)
class WithheldImage:
    """An image whose pixels were not sent (a decode worker's: protos/decode.proto's DecodeRequest): its size,
    which places its tokens (and Qwen-VL's RoPE positions), and what names it. Never encoded: a preempted request
    whose prefix cache no longer holds its tokens ends instead (engine/sequence.py's `withheld_end`)."""

    shape: tuple[int, int, int]  # [height, width, channels]
    digest: str
    crop: bool = False
    frames: int = 0  # a video's, and its frames a second (its tokens' positions)
    fps: float = 0.0


def digest_of(images: Sequence[ImageInput | WithheldImage]) -> str:
    """What names them in a cache salt (engine/block_hash.py's `images_digest`)."""
    return images_digest([image.digest for image in images])


def image_runs(prompt_token_ids: list[int], vision: VisionConfig) -> list[tuple[int, int, int]]:
    """Each run of consecutive image tokens (or of a video's), as positions [start, end) and the token."""
    runs: list[tuple[int, int, int]] = []
    marks = (vision.image_token_id, vision.video_token_id)
    for position, token in enumerate(prompt_token_ids):
        if token not in marks:
            continue
        if runs and runs[-1][1] == position and runs[-1][2] == token:
            runs[-1] = (runs[-1][0], position + 1, token)
        else:
            runs.append((position, position + 1, token))
    return runs


@dataclass(frozen=True, eq=False)
class PlacedImage:
    """An image and the runs of image tokens its rows take, in order (Gemma 3's and Qwen-VL's one run; Mistral
    3's one a row of its grid)."""

    runs: tuple[tuple[int, int], ...]
    image: ImageInput | WithheldImage

    @property
    def start(self) -> int:
        return self.runs[0][0]

    @property
    def end(self) -> int:
        return self.runs[-1][1]


def _runs_by_image(vision: VisionConfig, runs: list[tuple[int, int, int]],
                   images: Sequence[ImageInput | WithheldImage]) -> list[tuple[tuple[int, int], ...]]:
    """`runs` dealt out to `images` (and videos) in order, each taking as many as its grid has rows (ValueError
    for a prompt whose runs do not fit them)."""
    grids = [vision.token_grid(*image.shape[:2], image.frames) for image in images]
    wanted = sum(rows for rows, _ in grids)
    if len(runs) != wanted:
        what = "image and video" if vision.takes_videos else "image"
        raise ValueError(f"the prompt holds {len(runs)} run(s) of {what} tokens (id {vision.image_token_id}"
                         + (f", {vision.video_token_id}" if vision.takes_videos else "") + f") for {len(images)} "
                         f"{what}(s)" + (f", which take {wanted} (one a row of each image's grid)"
                                         if vision.family == PIXTRAL else ""))
    dealt, taken = [], iter(runs)
    for image, (rows, cols) in zip(images, grids, strict=True):
        its_runs = tuple(next(taken) for _ in range(rows))
        kind, token = ("a video", vision.video_token_id) if image.frames else ("an image", vision.image_token_id)
        for start, end, mark in its_runs:
            if mark != token:
                raise ValueError(f"{kind} is placed by tokens {token}, the prompt has {mark} at position {start}")
            if end - start != cols:
                raise ValueError(f"{kind} {'takes' if rows == 1 else 'row takes'} {cols} image tokens, the prompt "
                                 f"has {end - start} at position {start}")
        dealt.append(tuple((start, end) for start, end, _ in its_runs))
    return dealt


@dataclass(frozen=True, eq=False)
class MRoPEPositions:
    """Multimodal RoPE's positions of a prompt with images (Qwen-VL's): each prompt token's time, height and
    width positions [3, P] (a text token's three one number, counting on from the position before it; an image's
    tokens at its first one, plus their row and column), and what every later token's position is past its index."""

    prompt: torch.Tensor
    delta: int


def multimodal_positions(chunks: Sequence[tuple[sequence.Sequence, int]], positions: torch.Tensor) -> torch.Tensor:
    """A step's rows' multimodal RoPE positions [3, T], of its `chunks` ((sequence, its rows) in row order) and
    their token positions [T]: a token's own three past its prompt (or without images) its position plus its
    sequence's delta; its prompt's from the sequence's table. Per step a list and one tensor, and a copy a prompt
    chunk: a decode step costs about what one of 1D positions does."""
    deltas: list[int] = []
    prompt_rows: list[tuple[int, torch.Tensor]] = []
    for seq, n in chunks:
        rope, start = seq.rope_positions, seq.num_computed_tokens
        if rope is not None and start < rope.prompt.shape[1]:
            prompt_rows.append((len(deltas), rope.prompt[:, start:start + n]))
        deltas += [rope.delta if rope is not None else 0] * n
    rows = (positions + torch.tensor(deltas, dtype=positions.dtype, device=positions.device)).expand(3, -1).clone()
    for first, table in prompt_rows:
        rows[:, first:first + table.shape[1]] = table.to(rows.device)
    return rows


def mrope_positions(vision: VisionConfig, num_tokens: int, placed: Sequence[PlacedImage]) -> MRoPEPositions:
    """As Qwen's get_rope_index places a prompt of `num_tokens` with its images and videos: a video's frame pairs
    one time position apart (Qwen2-VL's) or `tokens_per_second` a second of the video apart (Qwen2.5-VL's), and the
    text after it from one past its largest position, as Qwen's own code and vLLM place it (transformers 5 counts on
    from its largest row or column instead, which differs only after a video longer than it is wide); Qwen3-VL's
    frame pairs each a run of its own, placed as an image is (their times are in the text between them)."""
    positions = torch.empty(3, num_tokens, dtype=torch.int64)
    token, position = 0, 0  # the next text token, and its position
    for image in placed:
        rows, cols = (side // vision.pixels_per_row for side in image.image.shape[:2])
        pairs = max(image.image.frames // vision.temporal_patch_size, 1) if len(image.runs) == 1 else 1
        times = (torch.arange(pairs) * _time_step(vision, image.image)).long()
        for start, end in image.runs:
            positions[:, token:start] = torch.arange(position, position + start - token)
            position += start - token
            positions[0, start:end] = position + times.repeat_interleave(rows * cols)
            positions[1, start:end] = position + torch.arange(rows).repeat_interleave(cols).repeat(pairs)
            positions[2, start:end] = position + torch.arange(cols).repeat(rows * pairs)
            token, position = end, position + max(int(times[-1]), rows - 1, cols - 1) + 1
    positions[:, token:] = torch.arange(position, position + num_tokens - token)
    return MRoPEPositions(positions, position + num_tokens - token - num_tokens)


def _time_step(vision: VisionConfig, image: ImageInput | WithheldImage | ImageRows) -> float:
    """How far apart a video's frame pairs' time positions are: Qwen2.5-VL's the seconds a pair spans times its
    tokens_per_second; Qwen2-VL's (and an image's) one."""
    if not image.frames or not vision.tokens_per_second:
        return 1.0
    return vision.tokens_per_second * (vision.temporal_patch_size / image.fps)


def placed_images(vision: VisionConfig | None, prompt_token_ids: list[int],
                  images: Sequence[ImageInput | WithheldImage]
                  ) -> tuple[tuple[PlacedImage, ...], tuple[tuple[int, int], ...], MRoPEPositions | None]:
    """A prompt's images (as `check_images` passed them) with their runs of image tokens, the spans their
    tokens attend bidirectionally in (Gemma 3's runs; none of Mistral 3's), and the prompt's multimodal RoPE
    positions where the model has them (Qwen2.5-VL's and Qwen3-VL's; else None)."""
    if not images:
        return (), (), None
    dealt = _runs_by_image(vision, image_runs(prompt_token_ids, vision), images)
    placed = tuple(PlacedImage(runs, image) for runs, image in zip(dealt, images, strict=True))
    spans = tuple(run for runs in dealt for run in runs) if vision.bidirectional else ()
    rope = mrope_positions(vision, len(prompt_token_ids), placed) if vision.family in QWENS else None
    return placed, spans, rope


def check_images(engine: LLMEngine, prompt_token_ids: list[int], images: Sequence[ImageInput | WithheldImage]
                 ) -> None:
    """ValueError for images the model takes none of, or that the prompt does not place (its runs of image
    tokens, as many and as long as each image's grid of rows), or pixels its tower does not take (a withheld
    image's, its size)."""
    vision, limit = engine.model_config.vision, engine.config.limit_images
    if vision is None:
        raise ValueError(f"{engine.model_config.architecture} takes no images here"
                         + (" (its images are limited to 0 a prompt)" if limit == 0 else ""))
    num_images = sum(not image.crop and not image.frames for image in images)  # a crop goes with its image
    _check_videos(engine, vision, [image for image in images if image.frames])
    if limit == 0:  # no image encoder here: images given as their rows only (--enable-mm-embeds)
        if not all(isinstance(image, (ImageRows, WithheldImage)) for image in images):
            raise ValueError("this worker loads no image encoder (its images are limited to 0 a prompt): images "
                             "come only as their encoder's rows (image_embeds)")
    elif limit is not None and num_images > limit:
        raise ValueError(f"{num_images} images in one prompt, more than its limit of {limit}")
    for image in images:
        shape = image.shape
        if isinstance(image, ImageRows):
            _check_rows(engine, vision, image)
        dtype = image.rgb.dtype if isinstance(image, ImageInput) else torch.uint8  # the others' sizes alone
        if len(shape) != 3 or shape[2] != vision.num_channels or dtype != torch.uint8:
            raise ValueError(f"an image must be uint8 [height, width, {vision.num_channels}] (resized by the model's "
                             f"image processor), got {dtype} of shape {list(shape)}")
        error = vision.shape_error(*shape[:2])
        if error is not None:
            raise ValueError(f"an image {error} (resized by the model's image processor), got {shape[0]}x{shape[1]}")
        if isinstance(image, (WithheldImage, ImageRows)):
            continue
        if len(image.mean) != vision.num_channels or len(image.std) != vision.num_channels or 0 in image.std:
            raise ValueError(f"an image's mean and std must give a number for each of its {vision.num_channels} "
                             "channels, std not 0")
    _runs_by_image(vision, image_runs(prompt_token_ids, vision), images)


def _check_videos(engine: LLMEngine, vision: VisionConfig, videos: Sequence[ImageInput | WithheldImage]) -> None:
    """ValueError for videos the model takes none of, more than the limit, or frames its tower does not take in
    pairs."""
    if not videos:
        return
    if not vision.takes_videos:
        raise ValueError(f"{engine.model_config.architecture} takes no videos here (Qwen-VL's do)")
    if engine.config.limit_images == 0:
        raise ValueError("this worker loads no image encoder (its images are limited to 0 a prompt), which its videos "
                         "need")
    limit = engine.config.limit_videos
    if limit is not None and len(videos) > limit:
        raise ValueError(f"{len(videos)} videos in one prompt, more than its limit of {limit}")
    for video in videos:
        if video.frames % vision.temporal_patch_size:
            raise ValueError(f"a video's frames come in whole groups of {vision.temporal_patch_size} (its processor "
                             f"repeats the last), got {video.frames}")
        if vision.tokens_per_second and not video.fps > 0:
            raise ValueError(f"a video needs its frames a second (its tokens' time positions), got {video.fps}")


def _check_rows(engine: LLMEngine, vision: VisionConfig, image: ImageRows) -> None:
    """ValueError for rows that are not as many as its tokens, each of the text model's width (Qwen3-VL's with its
    DeepStack layers' rows beside, as its encoder makes them), in floats."""
    rows, cols = vision.token_grid(*image.shape[:2])
    hidden = engine.model_config.hidden_size * (1 + len(vision.deepstack_layers))
    if not image.rows.is_floating_point() or tuple(image.rows.shape) != (rows * cols, hidden):
        width = "the text model's width" + (" for it and each DeepStack layer" if vision.deepstack_layers else "")
        raise ValueError(f"an image of {image.shape[0]}x{image.shape[1]} given as its encoder's rows needs "
                         f"{rows * cols} rows of {hidden} floats ({width}), got "
                         f"{str(image.rows.dtype).removeprefix('torch.')} of shape {list(image.rows.shape)}")
    if not bool(torch.isfinite(image.rows).all()):
        raise ValueError("an image's rows hold a value that is not finite (inf or NaN)")


def encode_pending_images(encoder: torch.nn.Module | None, seq: sequence.Sequence, start: int, n: int,
                          device: torch.device | str) -> None:
    """Encode those of `seq`'s images that positions [start, start + n) (a step's chunk of its prompt) reach
    into its given embeddings, rows by position. Each once, and only when a step computes its tokens: a
    decode worker's request never, unless preempted; an image wholly in a prefix the cache holds not
    unless a preemption has its tokens computed again; an image later in a chunked prompt with its chunk."""
    due = [placed for placed in seq.pending_images if placed.start < start + n and placed.end > start]
    if not due:
        return
    start_ns = time.time_ns()
    encoded = [placed for placed in due if not isinstance(placed.image, ImageRows)]
    if encoded:
        in_bfloat16 = encoder.config.normalizes_in_bfloat16
        rows = iter(encoder.encode([placed.image.pixels(in_bfloat16).to(device) for placed in encoded]))
    # Given rows as they are, in the dtype of the rows the encoder makes (the text model's).
    features = [placed.image.rows.to(device) if isinstance(placed.image, ImageRows) else next(rows) for placed in due]
    if features[0].is_cuda:  # its time is the kernels', not their launches' (the forward pass waits for them anyway)
        torch.cuda.synchronize(features[0].device)
    seq.step_times.image_encodes.append(ImageEncode(start_ns, time.time_ns(), len(due), sum(
        end - begin for placed in due for begin, end in placed.runs)))
    given = list(seq.given_embeddings)
    for placed, rows in zip(due, features, strict=True):
        offset = 0
        for run_start, run_end in placed.runs:
            given.append((run_start, rows[offset:offset + run_end - run_start]))
            offset += run_end - run_start
    seq.given_embeddings = tuple(given)
    seq.pending_images = tuple(placed for placed in seq.pending_images if all(placed is not d for d in due))
