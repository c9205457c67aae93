"""A prompt's images encoded on a worker are a span of their own: a decode worker process prefilling a tiny
Qwen2.5-VL's prompt itself (GenerateLocally) exports `prefill.encode_images` beside its `prefill.chunk`, under its
`decode.prefill`, with the images' count and tokens."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from protos import common_pb2, decode_pb2, decode_pb2_grpc
from services.decode.servicer import SERVICE_NAME as DECODE_SERVICE
from tests.parity.conftest import transformers
from tests.parity.images import QWEN2_5_VL_TEXT, QWEN2_5_VL_VISION
from tests.services.service_process import ServiceProcess
from tests.tracing.otlp_receiver import OtlpReceiver
from tests.tracing.test_worker_traces import client_span_metadata, one

IMAGE, HEIGHT, WIDTH = 500, 24, 40  # 3x5 squares of 8 pixels


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    torch.manual_seed(3)
    model = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
        text_config=QWEN2_5_VL_TEXT, vision_config=QWEN2_5_VL_VISION, image_token_id=IMAGE))
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    model.save_pretrained(path)
    return path


def test_a_prompts_images_are_encoded_in_a_span_of_their_own(qwen2_5_vl, monkeypatch):
    for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    receiver = OtlpReceiver().start()
    decode = ServiceProcess("decode", DECODE_SERVICE, qwen2_5_vl, "--kv-blocks", "64", "--otlp-endpoint",
                            receiver.endpoint)
    try:
        trace_id, _, metadata = client_span_metadata("gateway")
        rgb = (np.random.default_rng(0).random((HEIGHT, WIDTH, 3)) * 255).astype(np.uint8)
        image = common_pb2.PromptImage(rgb=rgb.tobytes(), height=HEIGHT, width=WIDTH, channels=3,
                                       rescale_factor=1 / 255, mean=[0.5] * 3, std=[0.5] * 3)
        prompt = [5, 6, 498, *[IMAGE] * 15, 499, 7, 8]
        sampling = common_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, images=[image])
        chunks = list(decode_pb2_grpc.DecodeStub(decode.channel).GenerateLocally(decode_pb2.GenerateLocallyRequest(
            request_id="images", prompt_token_ids=prompt, sampling=sampling), metadata=metadata, timeout=30))
        assert sum(len(c.token_ids) for c in chunks) == 2

        def complete(spans):
            return {"prefill.encode_images", "/baton.decode.v1.Decode/GenerateLocally"} <= \
                {s.name for s in spans if s.trace_id == trace_id}

        spans = [s for s in receiver.wait_for(complete) if s.trace_id == trace_id]
        encode, chunk, prefill = one(spans, "prefill.encode_images"), one(spans, "prefill.chunk"), \
            one(spans, "decode.prefill")
        assert encode.parent_id == chunk.parent_id == prefill.span_id
        assert encode.attributes["baton.images.count"] == 1 and encode.attributes["baton.images.num_tokens"] == 15
        assert chunk.start_ns <= encode.start_ns <= encode.end_ns <= chunk.end_ns
    finally:
        assert decode.terminate() == 0
        receiver.stop()
