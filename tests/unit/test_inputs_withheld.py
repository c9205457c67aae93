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
from protos import common_pb2
from services.common.prompt_embeds import given_embeddings, given_images, given_inputs
from services.gateway.given_embeddings import GivenImages, inputs_withheld, with_prompt_embeds
from services.gateway.image_inputs import ImageProcessing
from tests.parity.conftest import transformers


def _without(params: common_pb2.SamplingParams, *fields: tuple[str, str]) -> common_pb2.SamplingParams:
    """A copy of `params` with each (message, field) of theirs cleared."""
    expected = common_pb2.SamplingParams()
    expected.CopyFrom(params)
    for message, name in fields:
        for part in (expected.images if message == "images" else [expected.prompt_embeds]):
            part.ClearField(name)
    return expected


def test_a_decode_workers_params_name_the_images_by_size_and_digest_without_their_pixels(tmp_path):
    """What the gateway sends a decode worker: the params but the images' pixels (the pages hold their KV),
    each image's digest that of its pixels, as a worker given them makes it; the engine's salt unchanged."""
    transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(tmp_path)
    processing = ImageProcessing.from_dir(tmp_path)
    rng = np.random.default_rng(4)
    params = common_pb2.SamplingParams(max_tokens=9, temperature=0.5, stop_token_ids=[4, 5], cache_salt="tenant")
    params.logit_bias[7] = 2.5
    params.thinking_budget.max_tokens = 3
    GivenImages.of([processing.as_proto(Image.fromarray((rng.random((30, 40, 3)) * 255).astype(np.uint8)))
                    for _ in range(2)]).given_to(params)
    withheld = inputs_withheld(params)
    expected = _without(params, ("images", "rgb"))
    assert withheld == expected and all(image.rgb for image in params.images)
    assert inputs_withheld(common_pb2.SamplingParams(max_tokens=2)) == common_pb2.SamplingParams(max_tokens=2)
    images, named = given_images(withheld), given_images(params)
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
    assert withheld == _without(params, ("prompt_embeds", "data")) and params.prompt_embeds.data
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
