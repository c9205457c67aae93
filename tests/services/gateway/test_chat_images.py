"""A chat's images through the mesh, by the `openai` client: a tiny Gemma 3 (SigLIP tower, projector, text
model) with its processor (tokenizer, chat template, image processor) saved by transformers; image parts
as data: and file:// URLs. The greedy tokens equal transformers' on what Gemma3Processor makes of the same
messages and images."""
from __future__ import annotations

import base64
import functools
import http.server
import io
import threading

import anthropic
import grpc
import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.parity.conftest import transformers
from tests.services.gateway.image_chats import greedy_grpc_chat, saved_tensor, word_level_tokenizer
from tests.services.gateway.mesh import GatewayProcess, running_mesh
from tests.services.gateway.test_conditional_disaggregation import prefills_by_place

IMAGE_TOKEN, BEGIN_IMAGE, END_IMAGE = 500, 498, 499
MAX_TOKENS = 8
SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
IMAGE_MARKS = {"<start_of_image>": BEGIN_IMAGE, "<end_of_image>": END_IMAGE, "<image_soft_token>": IMAGE_TOKEN}
# Gemma 3's template, shortened: a message's parts in turn, an image part as the image's mark.
TEMPLATE = ("{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }} "
            "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
            "{% for item in message['content'] %}{% if item['type'] == 'image' %}<start_of_image>"
            "{% elif item['type'] == 'text' %}{{ item['text'] | trim }} {% endif %}{% endfor %}{% endif %}"
            "<end_of_turn> {% endfor %}{% if add_generation_prompt %}<start_of_turn>model {% endif %}")


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Words w0..w489 (and the roles) by a word-level vocabulary of 512, Gemma 3's image marks at 498..500."""
    words = SPECIALS + [f"w{i}" for i in range(490)] + ["user", "model"]
    return word_level_tokenizer({token: i for i, token in enumerate(words)} | IMAGE_MARKS, [*SPECIALS, *IMAGE_MARKS],
                                "<pad>", bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                                      "image_token": "<image_soft_token>"})


@pytest.fixture(scope="module")
def gemma3_vlm(tmp_path_factory):
    """The model and its processor, saved as transformers saves them."""
    text = transformers.Gemma3TextConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=3, head_dim=16,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                         sliding_window=24, query_pre_attn_scalar=24, initializer_range=0.2,
                                         max_position_embeddings=2048)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=112, patch_size=14)
    torch.manual_seed(12)
    model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=16,
        image_token_index=IMAGE_TOKEN, boi_token_index=BEGIN_IMAGE, eoi_token_index=END_IMAGE,
        eos_token_id=1)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "projection" in name:
                p.add_(torch.randn_like(p) * 0.3)
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(size={"height": 112, "width": 112},
                                                             image_mean=[0.5] * 3, image_std=[0.5] * 3),
        tokenizer=_tokenizer(), chat_template=TEMPLATE, image_seq_length=16)
    path = tmp_path_factory.mktemp("gemma3-vlm")
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path, model, processor


@pytest.fixture(scope="module")
def vlm_mesh(gemma3_vlm, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    with running_mesh(gemma3_vlm[0], num_prefill=1, num_decode=1, worker_args=("--dtype", "float32"),
                      gateway_args=("--local-prefill-max-tokens", "0", "--allowed-local-media-path",
                                    str(media))) as mesh:
        yield mesh, media


@pytest.fixture(scope="module")
def client(vlm_mesh):
    with openai.OpenAI(base_url=f"{vlm_mesh[0].gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def _image(seed: int, size: tuple[int, int] = (60, 40), mode: str = "RGB") -> Image.Image:
    pixels = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)
    return Image.fromarray(pixels).convert(mode)


def _data_url(image: Image.Image) -> str:
    saved = io.BytesIO()
    image.save(saved, format="PNG")
    return "data:image/png;base64," + base64.b64encode(saved.getvalue()).decode()


def _transformers_greedy(gemma3_vlm, messages: list[dict], **processor_kwargs
                         ) -> tuple[list[int], list[torch.Tensor], int]:
    """transformers' greedy tokens for `messages` (image parts holding their PIL images), the logprobs each
    was drawn from, and its prompt's length."""
    _, model, processor = gemma3_vlm
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt", **processor_kwargs)
    ids, tokens, logprobs = inputs["input_ids"], [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            current = torch.cat([ids, torch.tensor([tokens], dtype=ids.dtype)], dim=1)
            logits = model(input_ids=current, pixel_values=inputs["pixel_values"],
                           token_type_ids=(current == IMAGE_TOKEN).long()).logits
            tokens.append(int(logits[0, -1].argmax()))
            logprobs.append(torch.log_softmax(logits[0, -1], dim=-1))
    return tokens, logprobs, ids.shape[1]


def _assert_same_reply(reply, expected: list[int], logprobs: list[torch.Tensor]) -> None:
    """The tokens, and every top logprob of each within 1e-4 of transformers' (the tokens alone are not
    enough: a tiny model's greedy tokens barely move with its images' pixels)."""
    choice = reply.choices[0]
    assert choice.token_ids == expected
    for position, entry in zip(logprobs, choice.logprobs.content, strict=True):
        for top in entry.top_logprobs:
            token = int(top.token.removeprefix("token_id:"))
            assert abs(top.logprob - float(position[token])) < 1e-4


def _chat(client, model: str, content: list[dict], **extra):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=5,
                                          extra_body={"ignore_eos": True, "return_token_ids": True,
                                                      "return_tokens_as_token_ids": True, **extra})


def test_an_images_greedy_reply_is_transformers(vlm_mesh, client, gemma3_vlm):
    mesh = vlm_mesh[0]
    image = _image(1)
    reply = _chat(client, mesh.model_name, [{"type": "image_url", "image_url": {"url": _data_url(image)}},
                                            {"type": "text", "text": "w5 w6 w7"}])
    expected, logprobs, num_prompt = _transformers_greedy(gemma3_vlm, [{"role": "user", "content": [
        {"type": "image", "image": image}, {"type": "text", "text": "w5 w6 w7"}]}])
    _assert_same_reply(reply, expected, logprobs)
    assert reply.usage.prompt_tokens == num_prompt  # the image's 16 tokens among them
    mesh.assert_decode_pools_free()


def test_two_images_one_from_a_file_and_one_grayscale(vlm_mesh, client, gemma3_vlm):
    mesh, media = vlm_mesh
    first, second = _image(2, (200, 120)), _image(3, (50, 50), mode="L")
    first.save(media / "first.png")
    reply = _chat(client, mesh.model_name, [
        {"type": "text", "text": "w1 w2"}, {"type": "image_url", "image_url": {"url": f"file://{media}/first.png"}},
        {"type": "text", "text": "w3"}, {"type": "image_url", "image_url": {"url": _data_url(second)}}])
    expected, logprobs, _ = _transformers_greedy(gemma3_vlm, [{"role": "user", "content": [
        {"type": "text", "text": "w1 w2"}, {"type": "image", "image": first}, {"type": "text", "text": "w3"},
        {"type": "image", "image": second}]}])
    _assert_same_reply(reply, expected, logprobs)


def test_pan_and_scan_crops_beside_a_wide_image_are_transformers(vlm_mesh, client, gemma3_vlm):
    """vLLM's mm_processor_kwargs {"do_pan_and_scan": true}: a 3:1 image also goes as its three crops, the
    prompt as Gemma3Processor writes it ("Here is the original image ... and here are some crops ..."), a square
    one beside it alone; the greedy reply transformers'. /tokenize counts the same prompt by the same kwargs."""
    mesh = vlm_mesh[0]
    wide, square = _image(10, (900, 300)), _image(11, (80, 80))
    kwargs = {"do_pan_and_scan": True}
    content = [{"type": "image_url", "image_url": {"url": _data_url(wide)}}, {"type": "text", "text": "w5 w6"},
               {"type": "image_url", "image_url": {"url": _data_url(square)}}]
    reply = _chat(client, mesh.model_name, content, mm_processor_kwargs=kwargs)
    expected, logprobs, num_prompt = _transformers_greedy(gemma3_vlm, [{"role": "user", "content": [
        {"type": "image", "image": wide}, {"type": "text", "text": "w5 w6"}, {"type": "image", "image": square}]}],
        **kwargs)
    _assert_same_reply(reply, expected, logprobs)
    assert reply.usage.prompt_tokens == num_prompt
    plain = _chat(client, mesh.model_name, content)
    assert plain.usage.prompt_tokens < num_prompt - 3 * 16  # the crops' runs are its own
    counted = httpx.post(f"{mesh.gateway.base_url}/tokenize", json={
        "model": mesh.model_name, "messages": [{"role": "user", "content": content}], "mm_processor_kwargs": kwargs})
    assert counted.status_code == 200 and counted.json()["count"] == num_prompt
    with pytest.raises(openai.BadRequestError, match="do_pan_and_scan must be true or false"):
        _chat(client, mesh.model_name, content, mm_processor_kwargs={"do_pan_and_scan": "yes"})
    mesh.assert_decode_pools_free()


def test_an_image_sent_once_with_its_uuid_is_then_sent_by_its_uuid_alone(vlm_mesh, client, gemma3_vlm):
    """vLLM's uuid on a part: the image sent with it once, a later request giving the uuid alone (image_url null)
    gets transformers' reply on that image; a uuid never sent is a 400 naming it, no page left reserved."""
    mesh = vlm_mesh[0]
    image = _image(21)
    text = {"type": "text", "text": "w5 w6 w7"}
    _chat(client, mesh.model_name, [{"type": "image_url", "image_url": {"url": _data_url(image)}, "uuid": "sku-21"},
                                    text])
    reply = _chat(client, mesh.model_name, [{"type": "image_url", "image_url": None, "uuid": "sku-21"}, text])
    expected, logprobs, _ = _transformers_greedy(gemma3_vlm, [{"role": "user", "content": [
        {"type": "image", "image": image}, text]}])
    _assert_same_reply(reply, expected, logprobs)
    with pytest.raises(openai.BadRequestError, match="no image is cached under uuid 'sku-22'"):
        _chat(client, mesh.model_name, [{"type": "image_url", "image_url": None, "uuid": "sku-22"}, text])
    mesh.assert_decode_pools_free()


def test_the_same_image_again_is_served_from_the_prefix_cache_and_another_is_not(vlm_mesh, client):
    mesh = vlm_mesh[0]
    content = lambda seed: [{"type": "image_url", "image_url": {"url": _data_url(_image(seed))}},  # noqa: E731
                            {"type": "text", "text": " ".join(f"w{i}" for i in range(40))}]
    first = _chat(client, mesh.model_name, content(4))
    again = _chat(client, mesh.model_name, content(4))
    other = _chat(client, mesh.model_name, content(5))
    assert again.usage.prompt_tokens_details.cached_tokens >= 48
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # same placeholder tokens, another image
    assert again.choices[0].token_ids == first.choices[0].token_ids


def test_the_responses_and_messages_apis_take_images_as_chat_does(vlm_mesh, client):
    mesh = vlm_mesh[0]
    url = _data_url(_image(10))
    expected = _chat(client, mesh.model_name, [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": "w5 w6"}]).choices[0].message.content
    response = client.responses.create(model=mesh.model_name, max_output_tokens=MAX_TOKENS, temperature=0,
                                       input=[{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                                                           {"type": "input_text", "text": "w5 w6"}]}],
                                       extra_body={"ignore_eos": True})
    assert response.output_text == expected
    media_type, data = url.removeprefix("data:").split(";base64,")
    with anthropic.Anthropic(base_url=mesh.gateway.base_url, api_key="unused", max_retries=0) as claude:
        message = claude.messages.create(model=mesh.model_name, max_tokens=MAX_TOKENS, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": media_type,
                                                                      "data": data}},
                                         {"type": "text", "text": "w5 w6"}]}],
            extra_body={"ignore_eos": True, "temperature": 0})
    assert message.content[0].text == expected


def test_the_grpc_api_takes_a_messages_image_urls(vlm_mesh, client):
    mesh = vlm_mesh[0]
    url = _data_url(_image(11))
    expected = _chat(client, mesh.model_name, [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": "w7"}]).choices[0].token_ids

    def generate(options: gateway_pb2.ChatOptions | None = None, **message) -> gateway_pb2.GenerateResponse:
        return greedy_grpc_chat(mesh.gateway.grpc_address, options, **message)

    reply = generate(content_parts=["w7"], image_parts=[0], image_urls=[url])
    assert list(reply.complete.token_ids) == expected
    refused = generate(content_parts=["w7"], image_parts=[0])  # where an image goes, but not which
    assert refused.error.code == 400 and refused.error.param == "chat.messages[0].image_urls", refused
    # vLLM's uuids: the image sent under one, then the uuid alone; an empty URL without one, and uuids that do not
    # pair with the URLs, refused.
    assert list(generate(content_parts=["w7"], image_parts=[0], image_urls=[url],
                         image_uuids=["grpc-11"]).complete.token_ids) == expected
    assert list(generate(content_parts=["w7"], image_parts=[0], image_urls=[""],
                         image_uuids=["grpc-11"]).complete.token_ids) == expected
    refused = generate(content_parts=["w7"], image_parts=[0], image_urls=[""])
    assert refused.error.code == 400 and refused.error.param == "chat.messages[0].image_urls", refused
    refused = generate(content_parts=["w7"], image_parts=[0], image_urls=[url], image_uuids=["a", "b"])
    assert refused.error.code == 400 and refused.error.param == "chat.messages[0].image_uuids", refused
    refused = generate(content_parts=["w7"], image_parts=[0], image_urls=[""], image_uuids=["never-sent"])
    assert refused.error.code == 400 and "no image is cached under uuid 'never-sent'" in refused.error.message
    # An image's crops, asked as the HTTP API's mm_processor_kwargs asks them: the same reply.
    wide = _data_url(_image(12, (900, 300)))
    cropped = _chat(client, mesh.model_name, [{"type": "image_url", "image_url": {"url": wide}},
                                              {"type": "text", "text": "w7"}], mm_processor_kwargs={
        "do_pan_and_scan": True})
    reply = generate(gateway_pb2.ChatOptions(mm_processor_kwargs_json='{"do_pan_and_scan": true}'),
                     content_parts=["w7"], image_parts=[0], image_urls=[wide])
    assert list(reply.complete.token_ids) == cropped.choices[0].token_ids
    assert reply.complete.usage.prompt_tokens == cropped.usage.prompt_tokens > 4 * 16
    for bad in ('{"do_pan_and_scan": 1}', "[1]", "{"):
        refused = generate(gateway_pb2.ChatOptions(mm_processor_kwargs_json=bad), content_parts=["w7"],
                           image_parts=[0], image_urls=[wide])
        assert refused.error.code == 400 and refused.error.param == "chat_options.mm_processor_kwargs_json", refused


def test_unreadable_images_are_refused(vlm_mesh, client, tmp_path):
    mesh, media = vlm_mesh
    (tmp_path / "outside.png").write_bytes(b"")
    (media / "not-an-image.png").write_bytes(b"hello")
    for url, message in [("data:image/png;base64,@@@", "not base64"), ("data:image/png,raw", "must be base64"),
                         (f"file://{tmp_path}/outside.png", "--allowed-local-media-path"),
                         (f"file://{media}/not-an-image.png", "not an image"), ("ftp://host/x.png", "data:, http")]:
        with pytest.raises(openai.BadRequestError) as refused:
            _chat(client, mesh.model_name, [{"type": "image_url", "image_url": {"url": url}}])
        assert message in refused.value.message and refused.value.body["param"] == "messages", url
    with pytest.raises(openai.BadRequestError, match="beam search"):
        _chat(client, mesh.model_name, [{"type": "image_url", "image_url": {"url": _data_url(_image(6))}}],
              use_beam_search=True)
    mesh.assert_decode_pools_free()


def test_a_gateway_limiting_images_a_prompt(vlm_mesh):
    mesh = vlm_mesh[0]
    gateway = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                             [d.address for d in mesh.decode], "--limit-mm-per-prompt", '{"image": 1}')
    try:
        with openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0) as limited:
            image = {"type": "image_url", "image_url": {"url": _data_url(_image(9))}}
            assert len(_chat(limited, mesh.model_name, [image]).choices[0].token_ids) == MAX_TOKENS
            with pytest.raises(openai.BadRequestError, match="limit of 1 \\(--limit-mm-per-prompt\\)"):
                _chat(limited, mesh.model_name, [image, image])
    finally:
        assert gateway.terminate() == 0


def test_a_text_model_refuses_images(mesh, client):
    """The gateway package's text-only demo mesh."""
    with openai.OpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as text_client, \
            pytest.raises(openai.BadRequestError, match="takes no images"):
        _chat(text_client, mesh.model_name, [{"type": "image_url", "image_url": {"url": _data_url(_image(7))}}])


def test_a_decode_worker_prefilling_itself_and_an_image_over_http(vlm_mesh, client, tmp_path):
    """A second gateway, which lets the decode worker prefill short prompts (GenerateLocally, the images
    with them), gives the reply the disaggregated one gives; an http:// image is fetched (a real server
    here); without --allowed-local-media-path a file:// image is refused."""
    mesh = vlm_mesh[0]
    image = _image(8)
    image.save(tmp_path / "served.png")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    gateway = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                             [d.address for d in mesh.decode], "--local-prefill-max-tokens", "1000")
    try:
        content = [{"type": "image_url", "image_url": {"url": f"http://127.0.0.1:{server.server_port}/served.png"}},
                   {"type": "text", "text": "w9"}]
        expected = _chat(client, mesh.model_name, content)
        with openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0) as local:
            assert _chat(local, mesh.model_name, content).choices[0].token_ids == expected.choices[0].token_ids
            with pytest.raises(openai.BadRequestError, match="allowed-local-media-path"):
                _chat(local, mesh.model_name, [{"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}])
            with pytest.raises(openai.BadRequestError, match="could not be fetched"):
                _chat(local, mesh.model_name, [{"type": "image_url", "image_url": {
                    "url": f"http://127.0.0.1:{server.server_port}/missing.png"}}])
        places = prefills_by_place(gateway)
        assert places.get("decode") == 1 and not places.get("prefill"), places
    finally:
        server.shutdown()
        assert gateway.terminate() == 0
    mesh.assert_decode_pools_free()


def test_an_image_given_as_its_encoders_rows_gets_the_reply_its_pixels_get(vlm_mesh, client, gemma3_vlm):
    """vLLM's image_embeds part (--enable-mm-embeds): transformers' tower, pooling and projector's rows for an
    image, given in its place, get the reply the image gets, beside an image given by its URL; a gateway without
    the flag refuses them."""
    mesh = vlm_mesh[0]
    _, model, processor = gemma3_vlm
    image, other = _image(13), _image(14)
    with torch.no_grad():
        rows = model.model.get_image_features(processor.image_processor(images=image, return_tensors="pt")[
            "pixel_values"]).pooler_output[0]
    as_url = [{"type": "image_url", "image_url": {"url": _data_url(image)}}, {"type": "text", "text": "w3 w4"},
              {"type": "image_url", "image_url": {"url": _data_url(other)}}]
    as_rows = [{"type": "image_embeds", "image_embeds": saved_tensor(rows)}, *as_url[1:]]
    expected = _chat(client, mesh.model_name, as_url)
    with pytest.raises(openai.BadRequestError, match="--enable-mm-embeds"):
        _chat(client, mesh.model_name, as_rows)
    gateway = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                             [d.address for d in mesh.decode], "--enable-mm-embeds")
    try:
        with openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0) as embedding:
            reply = _chat(embedding, mesh.model_name, as_rows)
            assert reply.choices[0].token_ids == expected.choices[0].token_ids
            assert reply.usage.prompt_tokens == expected.usage.prompt_tokens
            for ours, theirs in zip(reply.choices[0].logprobs.content, expected.choices[0].logprobs.content,
                                    strict=True):
                assert abs(ours.logprob - theirs.logprob) < 1e-4
            # vLLM's uuid: the rows given under it once, then the uuid alone (image_embeds null).
            named = [{"type": "image_embeds", "image_embeds": saved_tensor(rows), "uuid": "rows-13"}, *as_url[1:]]
            assert _chat(embedding, mesh.model_name, named).choices[0].token_ids == expected.choices[0].token_ids
            named[0] = {"type": "image_embeds", "image_embeds": None, "uuid": "rows-13"}
            assert _chat(embedding, mesh.model_name, named).choices[0].token_ids == expected.choices[0].token_ids
            with pytest.raises(openai.BadRequestError, match="no image given as rows is cached under uuid 'rows-14'"):
                _chat(embedding, mesh.model_name, [{"type": "image_embeds", "image_embeds": None, "uuid": "rows-14"}])
            with pytest.raises(openai.BadRequestError, match="needs 16 rows of 64 floats"):
                _chat(embedding, mesh.model_name, [{"type": "image_embeds", "image_embeds": saved_tensor(rows[:-1])}])
            with pytest.raises(openai.BadRequestError, match="base64 of a torch.save'd tensor"):
                _chat(embedding, mesh.model_name, [{"type": "image_embeds", "image_embeds": {"image_embeds": "x"}}])
        # The gRPC API's: the rows at their index among the message's images, the other image by its URL.
        embeds = common_pb2.ChatImageEmbeds(index=0, rows=common_pb2.PromptEmbeds(
            data=rows.numpy().tobytes(), num_rows=rows.shape[0], hidden_size=rows.shape[1], dtype="float32"))
        message = common_pb2.ChatMessage(role="user", content_parts=["w3 w4"], image_parts=[0, 2],
                                          image_urls=[_data_url(other)], image_embeds=[embeds])
        request = gateway_pb2.GenerateRequest(
            request_id="rows", chat=common_pb2.ChatMessages(messages=[message]),
            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        with grpc.insecure_channel(gateway.grpc_address) as channel:
            generate = gateway_pb2_grpc.GenerateStub(channel).Generate
            answered = list(generate(request, timeout=30))[-1]
            assert list(answered.complete.token_ids) == expected.choices[0].token_ids, answered
            # A uuid names them in either API: the rows the HTTP request sent under "rows-13", by their uuid alone.
            named = request.chat.messages[0].image_embeds[0]
            named.ClearField("rows")
            named.uuid = "rows-13"
            answered = list(generate(request, timeout=30))[-1]
            assert list(answered.complete.token_ids) == expected.choices[0].token_ids, answered
            named.uuid = "rows-15"
            refused = list(generate(request, timeout=30))[-1]
            assert refused.error.code == 400, refused
            assert "no image given as rows is cached under uuid 'rows-15'" in refused.error.message
            assert "send it with its rows" in refused.error.message
            del request.chat.messages[0].image_urls[:]  # two image_parts, one image
            refused = list(generate(request, timeout=30))[-1]
        assert refused.error.code == 400 and "image_embeds" in refused.error.message
    finally:
        assert gateway.terminate() == 0
    mesh.assert_decode_pools_free()


def test_a_mesh_without_image_encoders_takes_images_as_their_rows(vlm_mesh, client, gemma3_vlm):
    """vLLM's encoder-less serving: every service started with --limit-mm-per-prompt '{"image": 0}' and
    --enable-mm-embeds, so no worker loads the image encoder (an encoder elsewhere makes the rows): an image given
    as its rows gets the reply the full mesh gives its pixels; an image by its URL is refused."""
    _, model, processor = gemma3_vlm
    image = _image(15)
    with torch.no_grad():
        rows = model.model.get_image_features(processor.image_processor(images=image, return_tensors="pt")[
            "pixel_values"]).pooler_output[0]
    expected = _chat(client, vlm_mesh[0].model_name, [{"type": "image_url", "image_url": {"url": _data_url(image)}},
                                                      {"type": "text", "text": "w8"}])
    flags = ("--limit-mm-per-prompt", '{"image": 0}', "--enable-mm-embeds")
    with running_mesh(gemma3_vlm[0], num_prefill=1, num_decode=1, worker_args=("--dtype", "float32", *flags),
                      gateway_args=("--local-prefill-max-tokens", "0", *flags)) as mesh, \
            openai.OpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as encoderless:
        reply = _chat(encoderless, mesh.model_name, [{"type": "image_embeds", "image_embeds": saved_tensor(rows)},
                                                     {"type": "text", "text": "w8"}])
        assert reply.choices[0].token_ids == expected.choices[0].token_ids
        with pytest.raises(openai.BadRequestError, match="only as their encoder's rows"):
            _chat(encoderless, mesh.model_name, [{"type": "image_url", "image_url": {"url": _data_url(image)}}])
        mesh.assert_decode_pools_free()
