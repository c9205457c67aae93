"""What the gateway sends a decode worker (protos/decode.proto's DecodeRequest): the request's params but its
images' pixels and its prompt embeddings' rows, which the pages' KV stands for, each named by its digest."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import torch
from PIL import Image

from engine.admission import salted
from engine.block_hash import embeddings_digest, salted_with_embeddings
from engine.prompt_embeds import WithheldEmbeddings
from engine.prompt_images import WithheldImage
from engine.sampling_params import SamplingParams
from protos import common_pb2, prefill_pb2
from services.common.prompt_embeds import given_embeddings, given_images, given_inputs
from services.gateway.given_embeddings import GivenImages, inputs_withheld, with_prompt_embeds
from services.gateway.image_inputs import ImageProcessing
from services.gateway.request_bytes import with_pixels
from tests.parity.conftest import transformers


def _without_rows(params: common_pb2.SamplingParams) -> common_pb2.SamplingParams:
    expected = common_pb2.SamplingParams()
    expected.CopyFrom(params)
    expected.prompt_embeds.ClearField("data")
    return expected


def test_a_decode_workers_params_name_the_images_by_size_and_digest_without_their_pixels(tmp_path):
    """The gateway's params carry images without their pixels, and go to a decode worker as they are; a
    prefill worker's request has them spliced in, each image's digest that of its pixels as a worker given
    them makes it; the engine's salt unchanged either way."""
    transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(tmp_path)
    processing = ImageProcessing.from_dir(tmp_path)
    rng = np.random.default_rng(4)
    params = common_pb2.SamplingParams(max_tokens=9, temperature=0.5, stop_token_ids=[4, 5], cache_salt="tenant")
    given = GivenImages(tuple(processing.processed(Image.fromarray((rng.random((30, 40, 3)) * 255).astype(np.uint8)))
                              for _ in range(2)))
    given.given_to(params)
    assert inputs_withheld(params) is params and not any(image.rgb for image in params.images)
    images = given_images(params)
    named = given_images(prefill_pb2.PrefillRequest.FromString(
        with_pixels(prefill_pb2.PrefillRequest(sampling=params), given)).sampling)
    assert all(isinstance(image, WithheldImage) and image.shape == (56, 56, 3) for image in images)
    assert [image.digest for image in images] == [replace(image, given_digest="").digest for image in named]
    engine_params = SamplingParams(cache_salt=params.cache_salt)
    assert salted(engine_params, None, images) is engine_params


def test_a_decode_workers_params_name_the_prompt_embeddings_by_shape_and_digest_without_their_rows():
    rows = torch.randn(6, 8)
    embeds = common_pb2.PromptEmbeds(data=rows.numpy().tobytes(), num_rows=6, hidden_size=8, dtype="float32")
    params = common_pb2.SamplingParams(max_tokens=3, seed=5)
    with_prompt_embeds(params, embeds, 4)  # the last 4 rows, as truncate_prompt_tokens keeps
    withheld = inputs_withheld(params)
    assert withheld == _without_rows(params) and params.prompt_embeds.data
    given = given_embeddings(withheld)
    assert given == WithheldEmbeddings((4, 8), embeddings_digest("float32", (4, 8), rows[2:].numpy().tobytes()))
    assert torch.equal(given_embeddings(params), rows[2:])
    engine_params = SamplingParams(cache_salt=params.cache_salt)
    assert salted(engine_params, given, ()) is engine_params


def test_a_worker_takes_the_gateways_name_for_the_rows_it_is_given():
    """Not hashed again on its engine thread: the salt the gateway's digest makes."""
    rows = torch.randn(6, 8)
    params = common_pb2.SamplingParams(max_tokens=3)
    with_prompt_embeds(params, common_pb2.PromptEmbeds(data=rows.numpy().tobytes(), num_rows=6, hidden_size=8,
                                                       dtype="float32"), 6)
    given = asyncio.run(given_inputs(params))
    assert torch.equal(given.prompt_embeds, rows) and given.prompt_embeds_digest == params.prompt_embeds.digest
    engine_params = SamplingParams(cache_salt=params.cache_salt)
    assert salted(engine_params, given.prompt_embeds, (), given.prompt_embeds_digest) is engine_params
    assert salted(SamplingParams(), rows, (), "named").cache_salt == salted_with_embeddings(None, "named")
