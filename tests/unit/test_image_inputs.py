"""A chat image's pixels as transformers' Gemma 3 and Pixtral (Mistral 3's) image processors (their PIL
backends) make them."""
from __future__ import annotations

import asyncio
import base64
import io
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from protos import common_pb2
from services.common.prompt_embeds import given_images
from services.gateway.given_embeddings import GivenImages
from services.gateway.image_processing import ImageProcessing
from services.tokenizer.image_tokens import ImageSize

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(("size", "mode"), [((60, 40), "RGB"), ((896, 1200), "RGB"), ((31, 77), "L"),
                                            ((300, 300), "RGBA"), ((112, 112), "P")])
def test_pixels_equal_gemma3s_image_processor(tmp_path, size, mode):
    reference = transformers.Gemma3ImageProcessorPil(size={"height": 112, "width": 96}, image_mean=[0.5, 0.4, 0.3],
                                                     image_std=[0.2, 0.25, 0.3])
    reference.save_pretrained(tmp_path)  # preprocessor_config.json
    ours = ImageProcessing.from_dir(tmp_path)
    rng = np.random.default_rng(sum(size))
    image = Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype(np.uint8)).convert(mode)
    if mode == "RGBA":  # transparency, composited onto white
        image.putalpha(Image.fromarray((rng.random((size[1], size[0])) * 255).astype(np.uint8)))
    expected = reference(images=image, return_tensors="np")["pixel_values"][0]
    # What a worker makes of the image as the gateway sends it (resized RGB, normalized there).
    pixels = given_images(common_pb2.SamplingParams(images=[ours.processed(image).proto()]))[0].pixels().numpy()
    assert pixels.shape == (3, 112, 96)
    np.testing.assert_allclose(pixels, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("size", [(60, 40), (2000, 700), (300, 1700), (5, 9), (56, 56), (1, 3)])
def test_pixels_equal_pixtrals_image_processor(tmp_path, size):
    """Mistral 3's: at most the longest edge, aspect kept, each side rounded up to whole tokens (the processor's
    patch of 14 times its spatial merge of 2, from processor_config.json), bicubic."""
    transformers.PixtralImageProcessorPil(size={"longest_edge": 1540}, patch_size=28).save_pretrained(tmp_path)
    reference = transformers.PixtralImageProcessorPil.from_pretrained(tmp_path)
    (tmp_path / "processor_config.json").write_text('{"processor_class": "PixtralProcessor", "patch_size": 14, '
                                                    '"spatial_merge_size": 2}')
    ours = ImageProcessing.from_dir(tmp_path)
    image = Image.fromarray((np.random.default_rng(sum(size)).random((size[1], size[0], 3)) * 255).astype(np.uint8))
    expected = reference(images=image, return_tensors="np")
    pixels = given_images(common_pb2.SamplingParams(images=[ours.processed(image).proto()]))[0].pixels().numpy()
    assert pixels.shape[1:] == tuple(expected["image_sizes"][0]) and pixels.shape[1] % 28 == pixels.shape[2] % 28 == 0
    np.testing.assert_allclose(pixels, expected["pixel_values"][0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("size", [(60, 40), (3000, 2000), (700, 5000), (9, 20), (1000, 8)])
def test_pixels_equal_qwen2_vls_image_processor(tmp_path, size):
    """Qwen2.5-VL's smart resize: each side to whole 28-pixel squares, the pixels within [min_pixels, max_pixels]
    (here 56x56 and 1280 squares: a large photo scaled down, a small one up), bicubic. Compared through
    transformers' processor's own patches: of the image it resizes, and of the one the gateway resized."""
    reference = transformers.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    reference.save_pretrained(tmp_path)
    ours = ImageProcessing.from_dir(tmp_path)
    image = Image.fromarray((np.random.default_rng(sum(size)).random((size[1], size[0], 3)) * 255).astype(np.uint8))
    expected = reference(images=image, return_tensors="np")
    proto = ours.processed(image).proto()
    resized = Image.frombytes("RGB", (proto.width, proto.height), proto.rgb)
    got = reference(images=resized, do_resize=False, return_tensors="np")
    assert (got["image_grid_thw"] == expected["image_grid_thw"]).all()
    np.testing.assert_allclose(got["pixel_values"], expected["pixel_values"], rtol=0, atol=1e-6)
    pixels = given_images(common_pb2.SamplingParams(images=[proto]))[0].pixels().numpy()
    assert pixels.shape == (3, *(expected["image_grid_thw"][0][1:] * 14))


@pytest.mark.parametrize("size", [(60, 40), (3000, 2000), (700, 5000), (9, 20), (5000, 30), (48, 48), (30, 4000)])
@pytest.mark.parametrize("max_soft_tokens", [None, 140])
def test_pixels_equal_gemma4s_image_processor(tmp_path, size, max_soft_tokens):
    """Gemma 4's: the aspect kept, to the most 16-pixel patches within its budget of soft tokens (each a square of 3x3
    patches; a mm_processor_kwargs' own), up or down, bicubic; rescaled, not normalized. Compared as the patches
    transformers' processor gives its model (the real ones: it pads them to the budget)."""
    transformers.Gemma4ImageProcessorPil(patch_size=16, max_soft_tokens=70, pooling_kernel_size=3).save_pretrained(
        tmp_path)
    reference = transformers.Gemma4ImageProcessorPil.from_pretrained(tmp_path)
    kwargs = {"max_soft_tokens": max_soft_tokens} if max_soft_tokens else {}
    ours = ImageProcessing.from_dir(tmp_path, kwargs)
    image = Image.fromarray((np.random.default_rng(sum(size)).random((size[1], size[0], 3)) * 255).astype(np.uint8))
    expected = reference(images=image, return_tensors="np", **kwargs)
    pixels = given_images(common_pb2.SamplingParams(images=[ours.processed(image).proto()]))[0].pixels().numpy()
    rows, cols = pixels.shape[1] // 16, pixels.shape[2] // 16
    assert rows * cols // 9 == expected["num_soft_tokens_per_image"][0] <= (max_soft_tokens or 70)
    patches = pixels.reshape(3, rows, 16, cols, 16).transpose(1, 3, 2, 4, 0).reshape(rows * cols, -1)
    np.testing.assert_allclose(patches, expected["pixel_values"][0][:rows * cols], rtol=0, atol=1e-6)
    assert (expected["image_position_ids"][0][rows * cols:] == -1).all()


def test_mm_processor_kwargs_over_the_processors_own(tmp_path):
    """--mm-processor-kwargs: Qwen's pixel bounds and Pixtral's longest edge, over preprocessor_config.json's."""
    qwen, pixtral = tmp_path / "qwen", tmp_path / "pixtral"
    transformers.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 1280).save_pretrained(qwen)
    transformers.PixtralImageProcessorPil(size={"longest_edge": 1540}, patch_size=28).save_pretrained(pixtral)
    (pixtral / "processor_config.json").write_text('{"patch_size": 14, "spatial_merge_size": 2}')
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    bounds = {"min_pixels": 28 * 28 * 9, "max_pixels": 28 * 28 * 64}
    bounded, unbounded = ImageProcessing.from_dir(qwen, bounds), ImageProcessing.from_dir(qwen)
    for size in ((2000, 3000), (20, 20)):
        assert bounded.size_of(*size) == smart_resize(*size, 28, **bounds) != unbounded.size_of(*size)
    image = Image.new("RGB", (3000, 2000))
    expected = transformers.PixtralImageProcessorPil(size={"longest_edge": 560}, patch_size=28)(images=image)
    assert ImageProcessing.from_dir(pixtral, {"size": {"longest_edge": 560}}).size_of(2000, 3000) == \
        tuple(expected["image_sizes"][0]) != ImageProcessing.from_dir(pixtral).size_of(2000, 3000)


def test_a_fixed_sizes_processor_takes_no_other(tmp_path):
    """Gemma 3's tower takes one size: neither pixel bounds nor another size are settings of its processor."""
    transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(tmp_path)
    processing = ImageProcessing.from_dir(tmp_path)
    assert processing.with_kwargs({}) is processing
    for kwargs, message in [({"max_pixels": 100}, "takes no max_pixels"), ({"size": {"height": 28}}, "no height")]:
        with pytest.raises(ValueError, match=message):
            processing.with_kwargs(kwargs)


def test_a_videos_sampling_is_the_video_processors_and_refused_where_there_is_none(tmp_path):
    """fps and do_sample_frames go to a Qwen-VL video processor (video_frames.py); a model that takes no videos
    refuses them in a request with images, its image processor taking none."""
    from services.gateway.errors import APIError
    from services.gateway.image_inputs import ChatImages

    transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(tmp_path)
    processing = ImageProcessing.from_dir(tmp_path, {"fps": 1.0})
    assert processing.with_kwargs({"fps": 4, "do_sample_frames": False}) is processing
    with pytest.raises(APIError, match="takes no videos here, nor do_sample_frames, fps") as refused:
        asyncio.run(ChatImages(processing).read([_png(2)], processor_kwargs={"fps": 4, "do_sample_frames": True}))
    assert refused.value.status == 400


def test_an_images_transparency_shows_the_background_media_io_kwargs_asks(tmp_path):
    """vLLM's rgba_background_color (--media-io-kwargs', a request's media_io_kwargs): white by default, as
    transformers' convert_to_rgb composites it."""
    from services.gateway.errors import APIError
    from services.gateway.image_inputs import ChatImages

    transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(tmp_path)
    saved = io.BytesIO()
    Image.new("RGBA", (56, 56), (255, 0, 0, 0)).save(saved, format="PNG")  # red, wholly transparent
    url = "data:image/png;base64," + base64.b64encode(saved.getvalue()).decode()
    images = ChatImages(ImageProcessing.from_dir(tmp_path))
    assert set(asyncio.run(images.read([url])).images[0].rgb) == {255}
    black = asyncio.run(images.read([url], media_io_kwargs={"image": {"rgba_background_color": [0, 0, 0]}}))
    assert set(black.images[0].rgb) == {0}
    green = {"image": {"rgba_background_color": (0, 9, 0)}}  # as the flag's checked_media_io_kwargs gives it
    flagged = ChatImages(ImageProcessing.from_dir(tmp_path).with_media_io(green))
    assert set(asyncio.run(flagged.read([url])).images[0].rgb) == {0, 9}
    with pytest.raises(APIError, match="three integers") as refused:
        asyncio.run(images.read([url], media_io_kwargs={"image": {"rgba_background_color": "black"}}))
    assert refused.value.param == "media_io_kwargs"


def test_settings_it_cannot_follow_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no preprocessor_config.json"):
        ImageProcessing.from_dir(tmp_path)
    transformers.Gemma3ImageProcessorPil(do_center_crop=True).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="do_center_crop"):
        ImageProcessing.from_dir(tmp_path)


PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4,
                "pan_and_scan_min_ratio_to_activate": 1.2}  # Gemma3Processor's defaults, switched on


@pytest.mark.parametrize("size", [(1000, 300), (300, 1000), (1001, 299), (2000, 500), (600, 500), (5000, 400),
                                  (560, 500), (400, 300), (100, 900)])
@pytest.mark.parametrize("switched_on_by", ["preprocessor_config.json", "mm_processor_kwargs"])
def test_pan_and_scan_crops_equal_gemma3s_image_processor(tmp_path, size, switched_on_by):
    """Gemma 3's pan-and-scan: an image far enough from square, its crops along its longer side (2 to 4, none
    narrower than 256 pixels, the last cut at the edge) after it, each resized as it is; one near square (560x500),
    or whose crops would be too narrow (400x300, 100x900), alone. Pixels, crops' count and order as transformers'
    processor makes them, switched on in the model's processor config or by a request's kwargs."""
    settings = {"size": {"height": 112, "width": 96}, "image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.25, 0.3]}
    reference = transformers.Gemma3ImageProcessorPil(**settings)
    if switched_on_by == "preprocessor_config.json":
        transformers.Gemma3ImageProcessorPil(**settings, do_pan_and_scan=True).save_pretrained(tmp_path)
        ours = ImageProcessing.from_dir(tmp_path)
    else:
        reference.save_pretrained(tmp_path)
        ours = ImageProcessing.from_dir(tmp_path).with_kwargs({"do_pan_and_scan": True})
    image = Image.fromarray((np.random.default_rng(sum(size)).random((size[1], size[0], 3)) * 255).astype(np.uint8))
    expected = reference(images=image, return_tensors="np", **PAN_AND_SCAN)
    images = GivenImages((ours.processed(image),))
    params = common_pb2.SamplingParams()
    images.given_to(params)
    assert images.sizes == [ImageSize(112, 96, int(expected["num_crops"][0]))]
    assert [image.crop for image in params.images] == [False] + [True] * int(expected["num_crops"][0])
    given = given_images(common_pb2.SamplingParams(images=[image.proto() for image in images.sent]))
    pixels = np.stack([image.pixels().numpy() for image in given])
    assert pixels.shape == expected["pixel_values"].shape
    np.testing.assert_allclose(pixels, expected["pixel_values"], rtol=0, atol=1e-6)
    assert [image.crop for image in given] == [image.crop for image in params.images]


def test_pan_and_scan_settings(tmp_path):
    """Its settings over the processor's defaults (a request's kwargs over the model's config); a processor that
    makes no crops (Qwen-VL's, Pixtral's) takes none of them."""
    transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(tmp_path / "gemma3")
    gemma3 = ImageProcessing.from_dir(tmp_path / "gemma3")
    assert gemma3.pan_and_scan.crop_boxes(300, 1000) == []  # off by default
    fewer = gemma3.with_kwargs({"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 2})
    assert fewer.pan_and_scan.crop_boxes(300, 1000) == [(0, 0, 500, 300), (500, 0, 1000, 300)]
    eager = fewer.with_kwargs({"pan_and_scan_min_ratio_to_activate": 1.05, "pan_and_scan_min_crop_size": 100})
    assert eager.pan_and_scan.crop_boxes(210, 200) == [(0, 0, 200, 105), (0, 105, 200, 210)]  # portrait: rows
    assert fewer.pan_and_scan.crop_boxes(210, 200) == []
    transformers.Qwen2VLImageProcessorPil().save_pretrained(tmp_path / "qwen")
    with pytest.raises(ValueError, match="takes no do_pan_and_scan"):
        ImageProcessing.from_dir(tmp_path / "qwen", {"do_pan_and_scan": True})


def test_an_image_resized_past_a_messages_bytes_is_refused_before_it_is_made(tmp_path):
    """A request's Qwen-VL min_pixels may ask a small image scaled up to billions of pixels: refused 413 from the
    sizes alone."""
    from services.gateway.errors import APIError

    transformers.Qwen2VLImageProcessorPil().save_pretrained(tmp_path)
    huge = ImageProcessing.from_dir(tmp_path, {"min_pixels": 10**12})
    with pytest.raises(APIError, match="to 1154720x866040 takes 2861119.4 MiB .*--max-message-bytes.*max_pixels") \
            as refused:
        huge.processed(Image.new("RGB", (40, 30)), most_bytes=64 * 2**20)
    assert refused.value.status == 413


def test_crops_past_a_messages_bytes_are_refused_before_they_are_made(tmp_path):
    """A request may ask hundreds of crops (pan_and_scan_max_num_crops, its min crop size): refused 413 from the
    image's size alone, not after hundreds of resizes."""
    from services.gateway.errors import APIError

    transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(tmp_path)
    many = ImageProcessing.from_dir(tmp_path, {"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 500,
                                               "pan_and_scan_min_crop_size": 1})
    wide = Image.new("RGB", (4000, 10))
    assert len(many.pan_and_scan.crop_boxes(10, 4000)) == 400
    with pytest.raises(APIError, match="with its 400 pan-and-scan crops takes 3.6 MiB") as refused:
        many.processed(wide, most_bytes=2**20)
    assert refused.value.status == 413
    assert len(many.processed(wide, most_bytes=4 * 2**20).crops) == 400


def test_the_gateways_salt_for_a_prompts_images_is_the_engines(tmp_path):
    """Salted so by the gateway, the engine keeps the salt as it is: the router's hashes of a prompt with
    images are the ones its prefill worker publishes."""
    from engine.admission import salted
    from engine.sampling_params import SamplingParams
    from protos import prefill_pb2
    from services.gateway.request_bytes import BulkInputs, with_inputs

    transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(tmp_path)
    processing = ImageProcessing.from_dir(tmp_path)
    rng = np.random.default_rng(3)
    given = GivenImages(tuple(processing.processed(Image.fromarray((rng.random((30, 40, 3)) * 255).astype(np.uint8)))
                              for _ in range(2)))
    params = common_pb2.SamplingParams(cache_salt="tenant")
    given.given_to(params)
    assert params.cache_salt.startswith("tenant\x00prompt_embeds:")
    sent = prefill_pb2.PrefillRequest.FromString(with_inputs(prefill_pb2.PrefillRequest(sampling=params),
                                                                  BulkInputs(images=given)))
    hashed_by_the_engine = [replace(image, given_digest="") for image in given_images(sent.sampling)]
    engine_params = SamplingParams(cache_salt=params.cache_salt)
    assert salted(engine_params, None, hashed_by_the_engine) is engine_params
    assert salted(SamplingParams(cache_salt="tenant"), None, hashed_by_the_engine).cache_salt == params.cache_salt


def _png(seed: int, size: tuple[int, int] = (90, 60)) -> str:
    pixels = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)
    saved = io.BytesIO()
    Image.fromarray(pixels).save(saved, format="PNG")
    return "data:image/png;base64," + base64.b64encode(saved.getvalue()).decode()


def test_a_conversations_images_are_processed_once_and_the_least_used_left_out(tmp_path):
    """vLLM's --mm-processor-cache-gb: an image sent again (the next turn) is the one made before, its digest
    the one hashing it anew gives; past the cache's bytes the least recently used is made again."""
    from prometheus_client import REGISTRY

    from services.gateway.given_embeddings import GivenImages, ProcessedImage
    from services.gateway.image_cache import ProcessedImageCache
    from services.gateway.image_inputs import ChatImages

    transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(tmp_path)
    images = ChatImages(ImageProcessing.from_dir(tmp_path), cache=ProcessedImageCache(2 * 56 * 56 * 3))
    hits = lambda: REGISTRY.get_sample_value("baton_gateway_mm_cache_hits_total") or 0  # noqa: E731
    before = hits()
    urls = [_png(seed) for seed in range(3)]
    first = asyncio.run(images.read(urls[:2]))
    again = asyncio.run(images.read([urls[1], urls[0]]))  # the first now the most recently used
    assert again.images[0] is first.images[1] and again.images[1] is first.images[0] and hits() == before + 2
    hashed_anew = GivenImages(tuple(ProcessedImage.of(image.rgb, (56, 56, 3), image.meta.rescale_factor,
                                                      image.meta.mean, image.meta.std) for image in again.images))
    assert again.digest == hashed_anew.digest != first.digest
    asyncio.run(images.read([urls[2]]))  # the second image out
    made_again = asyncio.run(images.read([urls[0], urls[1]]))  # the first found; the second made again
    assert made_again.images[0] is first.images[0] and made_again.images[1] is not first.images[1]
    assert made_again.digest == first.digest and hits() == before + 3


def test_http_images_are_fetched_only_from_the_allowed_media_domains(tmp_path):
    """vLLM's --allowed-media-domains: an image URL naming another host is refused before anything is fetched,
    and so is a redirect from an allowed host to another (the way around the list that vLLM leaves to
    VLLM_MEDIA_URL_ALLOW_REDIRECTS=0); without the list, any host."""
    import functools
    import http.server
    import threading

    from services.gateway.errors import APIError
    from services.gateway.image_inputs import ChatImages

    transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(tmp_path)
    (tmp_path / "image.png").write_bytes(base64.b64decode(_png(1).partition(",")[2]))
    requested: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            requested.append(self.path)
            if self.path == "/elsewhere":  # to the same server by another name
                self.send_response(302)
                self.send_header("Location", f"http://127.0.0.1:{self.server.server_port}/image.png")
                self.end_headers()
                return
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_port
    processing = ImageProcessing.from_dir(tmp_path)
    listed = ChatImages(processing, allowed_domains=frozenset({"localhost"}))
    try:
        assert asyncio.run(listed.read([f"http://localhost:{port}/image.png"])).sizes == [ImageSize(56, 56)]
        for url in (f"http://127.0.0.1:{port}/image.png", f"http://localhost:{port}/elsewhere"):
            with pytest.raises(APIError, match="only from the gateway's --allowed-media-domains .*'127.0.0.1'"):
                asyncio.run(listed.read([url]))
        assert requested == ["/image.png", "/elsewhere"]  # the refused URL and redirect never fetched
        assert asyncio.run(ChatImages(processing).read([f"http://localhost:{port}/elsewhere"])).sizes == \
            [ImageSize(56, 56)]
    finally:
        server.shutdown()


def test_a_prompts_http_images_are_fetched_at_once(tmp_path):
    """Each URL's round trips its own: the server answers neither of two images until both are asked for (in turn,
    the first would wait for the second and time out)."""
    import functools
    import http.server
    import threading

    from services.gateway.image_inputs import ChatImages, read_image

    transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(tmp_path)
    for seed in range(2):
        (tmp_path / f"{seed}.png").write_bytes(base64.b64decode(_png(seed).partition(",")[2]))
    both_asked = threading.Barrier(2, timeout=5)

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            both_asked.wait()
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        urls = [f"http://127.0.0.1:{server.server_port}/{seed}.png" for seed in range(2)]
        images = asyncio.run(ChatImages(ImageProcessing.from_dir(tmp_path)).read(urls))
        assert [image.rgb for image in images.images] == [
            ImageProcessing.from_dir(tmp_path).processed(read_image(base64.b64decode(_png(seed).partition(",")[2]),
                                                                    "messages")).rgb for seed in range(2)]
    finally:
        server.shutdown()


def test_an_image_named_by_its_uuid_is_made_once_and_may_then_be_sent_by_its_uuid_alone(tmp_path):
    """vLLM's `uuid` on an image part: the cache keeps the image under it (vLLM trusts a uuid to name one image:
    other bytes under it are the image first sent), a part giving only its uuid is that image, unfetched and
    unmade, and a uuid the cache does not hold (or holds read by other settings, or a server caching none) is a
    400 naming it; a part giving neither its image_url nor a uuid is not a part."""
    from pydantic import ValidationError

    from services.gateway.chat_messages import ChatMessage, ImagePart
    from services.gateway.errors import APIError
    from services.gateway.image_cache import ProcessedImageCache
    from services.gateway.image_inputs import ChatImages

    transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(tmp_path)
    images = ChatImages(ImageProcessing.from_dir(tmp_path), cache=ProcessedImageCache(1 << 20))

    def part(uuid: str, url: str | None = None) -> ImagePart:
        return ImagePart.model_validate({"type": "image_url", "uuid": uuid,
                                         **({"image_url": {"url": url}} if url else {})})

    first = asyncio.run(images.read([part("sku-1", _png(1))]))
    assert asyncio.run(images.read([part("sku-1")])).images[0] is first.images[0]
    assert asyncio.run(images.read([part("sku-1", _png(2))])).images[0] is first.images[0]
    unnamed = asyncio.run(images.read([_png(1)])).images[0]  # its bytes name another entry, made alike
    assert unnamed is not first.images[0] and unnamed.digest == first.images[0].digest
    with pytest.raises(APIError, match="no image is cached under uuid 'sku-2' .*send it with its image_url"):
        asyncio.run(images.read([part("sku-2")]))
    with pytest.raises(APIError, match="no image is cached under uuid 'sku-1'"):
        asyncio.run(images.read([part("sku-1")], processor_kwargs={"do_pan_and_scan": True}))
    with pytest.raises(APIError, match="caches none: --mm-processor-cache-gb 0"):
        asyncio.run(ChatImages(ImageProcessing.from_dir(tmp_path)).read([part("sku-1")]))
    message = ChatMessage.model_validate({"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _png(1)}}, {"type": "image_url", "image_url": None, "uuid": "a"},
        {"type": "video_url", "video_url": None, "uuid": "v"}]})
    assert [type(source).__name__ for source in message.media_sources] == ["str", "ImagePart", "VideoPart"]
    with pytest.raises(ValidationError, match="image_url part: give its image_url, or the uuid of one sent before"):
        ChatMessage.model_validate({"role": "user", "content": [{"type": "image_url", "image_url": None}]})
