"""A worker's request with its images' pixels spliced into its bytes, sent as those bytes by the workers'
stubs, on new calls and on calls kept open alike; a request without images as before."""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
from prometheus_client import CollectorRegistry, Counter

from protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2
from services.gateway.given_embeddings import EmbeddedImage, GivenImages, GivenRows, ProcessedImage
from services.gateway.kept_calls import KeptCalls
from services.gateway.request_bytes import BulkInputs, stub_taking_bytes, with_inputs
from services.gateway.workers import Worker


def _processed(seed: int, side: int) -> ProcessedImage:
    rgb = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8).tobytes()
    return ProcessedImage.of(rgb, (side, side, 3), 1 / 255, [0.5] * 3, [0.5] * 3)


def test_a_requests_pixels_and_rows_are_spliced_into_its_bytes_as_protobuf_frames_them():
    """As the request made with each image and the embeddings whole parses: pixels of lengths whose varints take
    2 and 3 bytes (a 16x16 image's 768; a 1000x1000's 3 MB), beside every other field of the request and its
    params. (A prompt has images or embeddings, not both; the bytes have room for either.)"""
    images = GivenImages((_processed(1, 16), _processed(2, 1000)))
    rows = np.random.default_rng(3).random((5, 8), dtype=np.float32)
    embeds = GivenRows.of(common_pb2.PromptEmbeds(data=rows.tobytes(), num_rows=5, hidden_size=8, dtype="float32"),
                          5)
    params = common_pb2.SamplingParams(max_tokens=7, temperature=0.5, stop_token_ids=[4, 5], cache_salt="t")
    params.logit_bias[3] = 1.5
    images.given_to(params)
    embeds.given_to(params)
    whole = common_pb2.SamplingParams()
    whole.CopyFrom(params)
    del whole.images[:]
    whole.images.extend(image.proto() for image in images.images)
    whole.prompt_embeds.data = rows.tobytes()
    for request_class, fields in ((prefill_pb2.PrefillRequest, {"token_ids": [1, 2, 3], "output_token_ids": [9],
                                                                "target": {"decode_address": "127.0.0.1:1"}}),
                                  (decode_pb2.GenerateLocallyRequest, {"prompt_token_ids": [1, 2, 3]})):
        spliced = with_inputs(request_class(request_id="r", sampling=params, **fields), BulkInputs(images, embeds))
        assert request_class.FromString(spliced) == request_class(request_id="r", sampling=whole, **fields)
    text = decode_pb2.GenerateLocallyRequest(request_id="r", prompt_token_ids=[1])
    assert with_inputs(text, None) is text


def _with_image() -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams(max_tokens=4)
    params.images.add(rgb=bytes(range(256)) * 3, channels=3, height=16, width=16, digest="d")
    return params


class EchoesItsRequest(decode_pb2_grpc.DecodeServicer):
    """Answers each request by its id and its images' bytes, whichever call brings it."""

    async def GenerateLocally(self, request, context):
        yield decode_pb2.DecodeChunk(token_ids=[len(request.request_id), len(request.sampling.images[0].rgb)])

    async def DecodePreopened(self, request_iterator, context):
        request = await request_iterator.__anext__()
        yield decode_pb2.DecodeChunk(token_ids=[len(request.request_id), len(request.sampling.images[0].rgb)])


def test_an_image_given_as_rows_is_spliced_beside_one_given_as_pixels():
    """An image_embeds image's rows in a frame of PromptImage.embeds, which merges with the rest of its embeds'
    numbers: the request parses as the one made with the rows in place, and the worker's ImageRows names them as
    the gateway did."""
    from dataclasses import replace

    from services.common.prompt_embeds import given_images

    rows = np.random.default_rng(4).random((16, 64), dtype=np.float32).tobytes()
    embedded = EmbeddedImage.of(common_pb2.PromptEmbeds(data=rows, num_rows=16, hidden_size=64, dtype="float32"),
                                112, 112)
    images = GivenImages((embedded, _processed(5, 40)))
    params = common_pb2.SamplingParams(max_tokens=3)
    images.given_to(params)
    request = prefill_pb2.PrefillRequest(request_id="r", sampling=params)
    sent = prefill_pb2.PrefillRequest.FromString(with_inputs(request, BulkInputs(images=images)))
    whole = common_pb2.PromptImage()
    whole.CopyFrom(embedded.meta)
    whole.embeds.data = rows
    assert list(sent.sampling.images) == [whole, images.images[1].proto()]
    given = given_images(sent.sampling)
    assert given[0].rows.numpy().tobytes() == rows and given[0].shape == (112, 112, 3)
    assert replace(given[0], given_digest="").digest == embedded.digest


def test_the_workers_stubs_send_a_request_as_its_bytes_or_as_a_message():
    async def answers() -> list[list[int]]:
        server = grpc.aio.server()
        decode_pb2_grpc.add_DecodeServicer_to_server(EchoesItsRequest(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = stub_taking_bytes(decode_pb2_grpc.DecodeStub, "baton.decode.v1.Decode")(channel)
        kept = KeptCalls("Decode", "DecodePreopened", Counter("request_bytes_test", "calls", ["call"],
                                                               registry=CollectorRegistry()), timeout_s=10)
        worker = Worker(f"127.0.0.1:{port}", channel, stub)
        try:
            request = decode_pb2.GenerateLocallyRequest(request_id="abc", sampling=_with_image())
            seen = [[c.token_ids[:] async for c in stub.GenerateLocally(message)]
                    for message in (request, request.SerializeToString())]
            kept.replenish(worker)
            preopened = await kept.start(worker, decode_pb2.DecodeRequest(request_id="abcd", sampling=_with_image())
                                         .SerializeToString())
            seen.append([c.token_ids[:] async for c in preopened])
            return seen
        finally:
            kept.close()
            await channel.close()
            await server.stop(None)

    assert asyncio.run(answers()) == [[[3, 768]], [[3, 768]], [[4, 768]]]
