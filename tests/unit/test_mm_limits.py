"""vLLM's --limit-mm-per-prompt as the gateway and the workers read it, and its --mm-processor-kwargs."""
from __future__ import annotations

import pytest

from services.common.mm_limits import (
    checked_media_io_kwargs,
    image_limit,
    media_io_kwargs,
    processor_kwargs,
    video_limit,
)
from services.common.settings import ConfigError
from services.decode.config import DecodeServiceConfig
from services.gateway.config_flags import config_from_args


def test_the_images_a_prompt_may_hold():
    assert image_limit("") is None
    assert image_limit('{"image": 3}') == 3
    assert image_limit('{"image": 0, "video": 0}') == 0
    assert image_limit("{}") is None
    for bad, message in (("3", "JSON object"), ('{"image": -1}', "maps image"), ('{"image": true}', "maps image"),
                         ('{"images": 2}', "maps image"), ("{image: 2}", "not JSON"),
                         ('{"audio": 1}', "audio is not served"), ('{"image": 0, "video": 1}', "give videos 0")):
        with pytest.raises(ConfigError, match=message):
            image_limit(bad)


def test_the_videos_a_prompt_may_hold():
    assert video_limit("") is None
    assert video_limit('{"image": 3}') is None
    assert video_limit('{"video": 2}') == 2
    assert video_limit('{"image": 1, "video": 0}') == 0
    assert video_limit('{"image": 0}') == 0  # no image encoder, none to encode them


def test_media_io_kwargs_as_vllm_takes_them():
    assert media_io_kwargs("") == {}
    assert media_io_kwargs('{"video": {"num_frames": 16}}') == {"video": {"num_frames": 16}}
    assert media_io_kwargs('{"video": {"num_frames": -1}, "image": {"rgba_background_color": [0, 0, 0]}}') == {
        "video": {"num_frames": -1}, "image": {"rgba_background_color": (0, 0, 0)}}
    for bad, message in (('{"video": {"num_frames": 0}}', "positive integer or -1"),
                         ('{"video": {"num_frames": true}}', "positive integer or -1"),
                         ('{"image": {"rgba_background_color": [0, 0]}}', "three integers"),
                         ('{"image": {"rgba_background_color": [0, 0, 256]}}', "three integers"),
                         ('{"video": {"fps": 2}}', "only"), ('{"audio": {}}', "only"), ('{"video": 3}', "only")):
        with pytest.raises(ConfigError, match=message):
            media_io_kwargs(bad)
    with pytest.raises(ValueError, match="media_io_kwargs: only"):
        checked_media_io_kwargs({"image": {"rgba": 1}}, "media_io_kwargs")


def test_the_gateway_and_the_workers_take_the_flag(tiny_demo_model):
    gateway = config_from_args(["--model", str(tiny_demo_model), "--tokenizer", "127.0.0.1:1", "--decode",
                                "127.0.0.1:2", "--colocated", "--limit-mm-per-prompt", '{"image": 2}',
                                "--allowed-media-domains", "upload.wikimedia.org", "GitHub.com"], env={})
    assert gateway.limit_images == 2
    assert gateway.allowed_media_domains == {"upload.wikimedia.org", "github.com"}
    decode = DecodeServiceConfig.from_args(["--model", str(tiny_demo_model), "--limit-mm-per-prompt",
                                            '{"image": 0}'], env={})
    assert decode.limit_images == 0 and decode.limit_videos == 0


def test_mm_processor_kwargs_as_vllm_takes_them():
    assert processor_kwargs("") == {}
    assert processor_kwargs('{"max_pixels": 1003520, "min_pixels": 3136}') == {"max_pixels": 1003520,
                                                                               "min_pixels": 3136}
    assert processor_kwargs('{"size": {"longest_edge": 1024}}') == {"size": {"longest_edge": 1024}}
    pan_and_scan = ('{"do_pan_and_scan": true, "pan_and_scan_min_crop_size": 128, "pan_and_scan_max_num_crops": 3, '
                    '"pan_and_scan_min_ratio_to_activate": 1.5}')
    assert processor_kwargs(pan_and_scan) == {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 128,
                                              "pan_and_scan_max_num_crops": 3,
                                              "pan_and_scan_min_ratio_to_activate": 1.5}
    assert processor_kwargs('{"fps": 0.5, "do_sample_frames": true}') == {"fps": 0.5, "do_sample_frames": True}
    for bad, message in [('{"num_frames": 2}', "'num_frames' is not served"), ('{"fps": 0}', "positive number"),
                         ('{"do_sample_frames": "no"}', "true or false"), ('{"max_pixels": 0}', "positive integer"),
                         ('{"do_pan_and_scan": 1}', "true or false"),
                         ('{"pan_and_scan_max_num_crops": 2.5}', "positive integer"),
                         ('{"pan_and_scan_min_ratio_to_activate": 0}', "positive number"),
                         ('{"pan_and_scan_min_ratio_to_activate": true}', "positive number"),
                         ('{"max_pixels": true}', "positive integer"), ('{"size": {}}', "object of them"),
                         ('{"size": {"longest_edge": "big"}}', "object of them"), ("[1]", "JSON object")]:
        with pytest.raises(ConfigError, match=message):
            processor_kwargs(bad)
