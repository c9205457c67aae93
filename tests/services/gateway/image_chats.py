"""What the end-to-end tests of multimodal models share: a chat of one user message asked greedily with its top
logprobs, its images' data: URLs, and its reply held to transformers' tokens and logprobs."""
from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
import numpy as np
import openai
import torch
from PIL import Image
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.parity.conftest import transformers
from tests.services.gateway.mesh import GatewayProcess, running_mesh

MAX_TOKENS = 8


def word_level_tokenizer(vocab: Mapping[str, int], specials: Sequence[str], unknown: str,
                         **named: Any) -> transformers.PreTrainedTokenizerFast:
    """A tokenizer of whitespace-split words by `vocab` (every other id under 512 an unused word), `specials` (the
    image marks among them) kept whole, `unknown` for a word it has not; `named`: its named tokens (bos_token=...)."""
    whole = {**vocab, **{f"unused{i}": i for i in range(512) if i not in vocab.values()}}
    tokenizer = Tokenizer(models.WordLevel(whole, unk_token=unknown))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in specials])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, **named)


def qwen_vl_tokenizer(marks: Mapping[str, int], template: str) -> transformers.PreTrainedTokenizerFast:
    """A Qwen-VL chat's tokenizer, tiny: its chat tokens, `marks` (its vision marks) and words w0 to w479, writing
    chats by `template`."""
    specials = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = ({token: i for i, token in enumerate(specials)} | {f"w{i}": 10 + i for i in range(480)}
             | {"user": 495, "assistant": 496} | dict(marks))
    tokenizer = word_level_tokenizer(vocab, [*specials, *marks], "<unk>", eos_token="<|im_end|>", unk_token="<unk>")
    tokenizer.chat_template = template
    return tokenizer


def rendering_mesh(model_dir):
    """A mesh of one prefill and one decode worker in float32 whose chats the tokenizer service renders (the
    gateway renders none itself)."""
    return running_mesh(model_dir, num_prefill=1, num_decode=1, worker_args=("--dtype", "float32"),
                        gateway_args=("--local-prefill-max-tokens", "0", "--local-tokenize-max-chars", "0"))


def image_limited_mesh(model_dir, limit: int):
    """A mesh of one prefill and one decode worker in float32, each taking at most `limit` images a prompt, whose
    gateway sends every prompt to a prefill worker."""
    return running_mesh(model_dir, num_prefill=1, num_decode=1,
                        worker_args=("--dtype", "float32", "--limit-mm-per-prompt", json.dumps({"image": limit})),
                        gateway_args=("--local-prefill-max-tokens", "0"))


def greedy_logprobs(last_logits: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor,
                    max_tokens: int = MAX_TOKENS) -> tuple[list[int], list[torch.Tensor]]:
    """`max_tokens` greedy tokens after prompt `ids` [1, n], each the argmax of `last_logits` (the model's last
    position's logits of the ids so far), and the logprobs each was drawn from."""
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = last_logits(torch.cat([ids, torch.tensor([tokens], dtype=ids.dtype)], dim=1))
            tokens.append(int(logits.argmax()))
            logprobs.append(torch.log_softmax(logits, dim=-1))
    return tokens, logprobs


def random_image(seed: int, size: tuple[int, int]) -> Image.Image:
    """(width, height) of random RGB pixels."""
    return Image.fromarray((np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8))


def data_url(image: Image.Image) -> str:
    saved = io.BytesIO()
    image.save(saved, format="PNG")
    return "data:image/png;base64," + base64.b64encode(saved.getvalue()).decode()


def encoded_video(frames: np.ndarray, fps: int = 10, codec: str = "ffv1", pix_fmt: str = "bgr0",
                  container: str = "matroska") -> bytes:
    """`frames` (uint8 [T, H, W, 3]) as a video file: by default lossless (FFV1 in Matroska, RGB kept bit for bit)."""
    import av  # noqa: PLC0415 (only the tests of videos)

    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as output:
        stream = output.add_stream(codec, rate=fps)
        stream.height, stream.width, stream.pix_fmt = frames.shape[1], frames.shape[2], pix_fmt
        for frame in frames:
            output.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        output.mux(stream.encode())
    return buffer.getvalue()


def saved_tensor(tensor: torch.Tensor) -> str:
    """The base64 of `tensor` saved by torch.save: how vLLM's image_embeds and prompt_embeds are sent."""
    saved = io.BytesIO()
    torch.save(tensor, saved)
    return base64.b64encode(saved.getvalue()).decode()


def greedy_chat(client, model: str, content: list[dict], **extra):
    """MAX_TOKENS greedy tokens past EOS, their ids and top-5 logprobs by id (`extra`: more of the body's)."""
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=5,
                                          extra_body={"ignore_eos": True, "return_token_ids": True,
                                                      "return_tokens_as_token_ids": True, **extra})


def greedy_grpc_chat(address: str, options: gateway_pb2.ChatOptions | None = None,
                     **message) -> gateway_pb2.GenerateResponse:
    """A user message of `message`'s fields asked of the gRPC API at `address`, MAX_TOKENS greedy tokens past EOS:
    its last response (the complete reply, or the error)."""
    request = gateway_pb2.GenerateRequest(
        request_id="chat", chat=common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user", **message)]),
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        chat_options=options)
    with grpc.insecure_channel(address) as channel:
        return list(gateway_pb2_grpc.GenerateStub(channel).Generate(request, timeout=30))[-1]


def assert_same_reply(reply, expected: list[int], logprobs: list[torch.Tensor]) -> None:
    """The tokens, and every top logprob of each within 1e-4 of transformers' (the tokens alone are not enough: a
    tiny model's greedy tokens barely move with its images' pixels)."""
    choice = reply.choices[0]
    assert choice.token_ids == expected
    for position, entry in zip(logprobs, choice.logprobs.content, strict=True):
        for top in entry.top_logprobs:
            assert abs(top.logprob - float(position[int(top.token.removeprefix("token_id:"))])) < 1e-4


def greedy_chat_by_a_local_gateway(mesh, content: list[dict], *gateway_args: str):
    """`greedy_chat`'s reply from a second gateway over the same workers, one that renders short chats itself
    (the mesh's asks its tokenizer service), started with `gateway_args`."""
    gateway = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                             [d.address for d in mesh.decode], *gateway_args)
    try:
        with openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0) as local:
            return greedy_chat(local, mesh.model_name, content)
    finally:
        assert gateway.terminate() == 0
