"""What the gateway sends its workers of a prompt's images and embeddings: its params name each by size (or
shape) and digest without the pixels or rows, and go so to a decode worker, whose pages' KV stands for them; a
request that prefills the prompt has them spliced in (request_bytes.py), named by the digests a worker given
them would make."""
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
from services.gateway.given_embeddings import GivenImages, GivenRows
from services.gateway.image_processing import ImageProcessing
from services.gateway.request_bytes import BulkInputs, with_inputs
from tests.parity.conftest import transformers


def _prefill_sampling(params: common_pb2.SamplingParams, bulk: BulkInputs) -> common_pb2.SamplingParams:
    """`params` as a prefill worker reads them from its request."""
    return prefill_pb2.PrefillRequest.FromString(with_inputs(prefill_pb2.PrefillRequest(sampling=params),
                                                             bulk)).sampling


def test_a_decode_workers_params_name_the_images_by_size_and_digest_without_their_pixels(tmp_path):
    transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(tmp_path)
    processing = ImageProcessing.from_dir(tmp_path)
    rng = np.random.default_rng(4)
    params = common_pb2.SamplingParams(max_tokens=9, temperature=0.5, stop_token_ids=[4, 5], cache_salt="tenant")
    given = GivenImages(tuple(processing.processed(Image.fromarray((rng.random((30, 40, 3)) * 255).astype(np.uint8)))
                              for _ in range(2)))
    given.given_to(params)
    assert not any(image.rgb for image in params.images)
    images, named = given_images(params), given_images(_prefill_sampling(params, BulkInputs(images=given)))
    assert all(isinstance(image, WithheldImage) and image.shape == (56, 56, 3) for image in images)
    assert [image.digest for image in images] == [replace(image, given_digest="").digest for image in named]
    engine_params = SamplingParams(cache_salt=params.cache_salt)
    assert salted(engine_params, None, images) is engine_params


def test_a_decode_workers_params_name_the_prompt_embeddings_by_shape_and_digest_without_their_rows():
    rows = torch.randn(6, 8)
    params = common_pb2.SamplingParams(max_tokens=3, seed=5)
    kept = GivenRows.of(common_pb2.PromptEmbeds(data=rows.numpy().tobytes(), num_rows=6, hidden_size=8,
                                                dtype="float32"), 4)  # the last 4 rows, as truncate_prompt_tokens keeps
    kept.given_to(params)
    assert not params.prompt_embeds.data
    given = given_embeddings(params)
    assert given == WithheldEmbeddings((4, 8), embeddings_digest("float32", (4, 8), rows[2:].numpy().tobytes()))
    assert torch.equal(given_embeddings(_prefill_sampling(params, BulkInputs(rows=kept))), rows[2:])
    engine_params = SamplingParams(cache_salt=params.cache_salt)
    assert salted(engine_params, given, ()) is engine_params


def test_a_worker_takes_the_gateways_name_for_the_rows_it_is_given():
    """Not hashed again on its engine thread: the salt the gateway's digest makes."""
    rows = torch.randn(6, 8)
    params = common_pb2.SamplingParams(max_tokens=3)
    kept = GivenRows.of(common_pb2.PromptEmbeds(data=rows.numpy().tobytes(), num_rows=6, hidden_size=8,
                                                dtype="float32"), 6)
    kept.given_to(params)
    given = asyncio.run(given_inputs(_prefill_sampling(params, BulkInputs(rows=kept))))
    assert torch.equal(given.prompt_embeds, rows) and given.prompt_embeds_digest == params.prompt_embeds.digest
    engine_params = SamplingParams(cache_salt=params.cache_salt)
    assert salted(engine_params, given.prompt_embeds, (), given.prompt_embeds_digest) is engine_params
    assert salted(SamplingParams(), rows, (), "named").cache_salt == salted_with_embeddings(None, "named")
