"""`/v1/embeddings` through the mesh with the `openai` client: each input's embedding is the
model's last hidden state at its last token, L2-normalized, as `transformers`' AutoModel computes
it on the same weights and ids; in all of OpenAI's input shapes, cut to `dimensions`, unnormalized
on request, as base64, on a prefill worker or (colocated) a decode worker; bad input is a 400 (an
unknown model a 404), and no page stays held."""
from __future__ import annotations

import base64
import json
import re
import shutil
import struct
import time

import grpc
import httpx
import openai
import pytest
import torch

from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.services.gateway.mesh import GatewayProcess, start_mesh, stop_mesh

transformers = pytest.importorskip("transformers")
TEXTS = ["The quick brown fox", "Once upon a time, in a land far away, there lived a dragon."]


@pytest.fixture(scope="module")
def reference(mesh):
    """(token ids, last hidden state at the last token) of each text, by transformers."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(mesh.model_dir)
    model = transformers.AutoModel.from_pretrained(mesh.model_dir, dtype=torch.float32)
    made = []
    with torch.no_grad():
        for text in TEXTS:
            ids = tokenizer(text)["input_ids"]
            made.append((ids, model(torch.tensor([ids])).last_hidden_state[0, -1]))
    return made


def close(got, want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.as_tensor(got), want, atol=1e-4, rtol=1e-4)


def test_embeddings_are_the_last_hidden_state_normalized(mesh, client, reference):
    response = client.embeddings.create(model=mesh.model_name, input=TEXTS)
    assert [d.index for d in response.data] == [0, 1] and response.model == mesh.model_name
    for data, (_, hidden) in zip(response.data, reference):
        close(data.embedding, torch.nn.functional.normalize(hidden, dim=0))
    num_tokens = sum(len(ids) for ids, _ in reference)
    assert response.usage.prompt_tokens == response.usage.total_tokens == num_tokens

    # The same from token ids, one list or several; a text alone.
    [(ids, hidden), (more_ids, more_hidden)] = reference
    by_ids = client.embeddings.create(model=mesh.model_name, input=[ids, more_ids]).data
    close(by_ids[1].embedding, torch.nn.functional.normalize(more_hidden, dim=0))
    close(client.embeddings.create(model=mesh.model_name, input=ids).data[0].embedding,
          torch.nn.functional.normalize(hidden, dim=0))
    close(client.embeddings.create(model=mesh.model_name, input=TEXTS[0]).data[0].embedding,
          torch.nn.functional.normalize(hidden, dim=0))

    # Matryoshka's first numbers, normalized after the cut; vLLM's `normalize: false`; base64 float32s.
    cut = client.embeddings.create(model=mesh.model_name, input=TEXTS[0], dimensions=16).data[0].embedding
    assert len(cut) == 16
    close(cut, torch.nn.functional.normalize(hidden[:16], dim=0))
    raw = client.embeddings.create(model=mesh.model_name, input=TEXTS[0], extra_body={"normalize": False})
    close(raw.data[0].embedding, hidden)
    packed = httpx.post(f"{mesh.gateway.base_url}/v1/embeddings", timeout=30, json={
        "model": mesh.model_name, "input": TEXTS[0], "encoding_format": "base64"}).json()["data"][0]["embedding"]
    decoded = base64.b64decode(packed)
    close(list(struct.unpack(f"<{len(decoded) // 4}f", decoded)), torch.nn.functional.normalize(hidden, dim=0))
    mesh.assert_decode_pools_free()


def test_sglangs_encode_answers_the_same_embeddings_in_its_shape(mesh, reference):
    """SGLang's native /encode: a text is answered by one `{"embedding", "meta_info"}`, a batch (of ids
    here) by a list, each with its rid and token count; the vectors are /v1/embeddings'."""
    url = f"{mesh.gateway.base_url}/encode"
    [(ids, hidden), (more_ids, more_hidden)] = reference
    one = httpx.post(url, json={"text": TEXTS[0], "rid": "enc-1", "sampling_params": {}}, timeout=30).json()
    close(one["embedding"], torch.nn.functional.normalize(hidden, dim=0))
    assert one["meta_info"]["id"] == "enc-1" and one["meta_info"]["prompt_tokens"] == len(ids)
    batch = httpx.put(url, json={"input_ids": [ids, more_ids], "dimensions": 16}, timeout=30).json()
    assert [answer["meta_info"]["prompt_tokens"] for answer in batch] == [len(ids), len(more_ids)]
    close(batch[1]["embedding"], torch.nn.functional.normalize(more_hidden[:16], dim=0))
    [alone] = httpx.post(url, json={"text": [TEXTS[1]]}, timeout=30).json()  # a list, even of one
    close(alone["embedding"], torch.nn.functional.normalize(more_hidden, dim=0))
    for body, param in (({"text": TEXTS[0], "priority": 1}, "priority"), ({"text": ""}, "text"),
                        ({"input_ids": [ids, ids], "rid": ["a", "a"]}, "rid"),
                        ({"input_ids": [[5, -1]]}, "input_ids.0.1"),
                        ({"text": TEXTS[0], "dimensions": 0}, "dimensions")):
        refused = httpx.post(url, json=body, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    mesh.assert_decode_pools_free()


def test_pooling_requests_are_counted_and_timed_by_endpoint(mesh, client, reference):
    def counted(name: str) -> float:
        found = re.search(rf'^{name}{{[^}}]*endpoint="embeddings"[^}}]*}} (\S+)$',
                          httpx.get(f"{mesh.gateway.base_url}/metrics", timeout=10).text, re.M)
        return float(found[1]) if found else 0.0

    latency = "baton_gateway_pooling_request_duration_seconds"
    names = ("baton_gateway_pooling_inputs_total", "baton_gateway_pooling_tokens_total", f"{latency}_count",
             f"{latency}_sum")
    before = [counted(name) for name in names]
    started = time.perf_counter()
    client.embeddings.create(model=mesh.model_name, input=TEXTS)
    took = time.perf_counter() - started
    inputs, tokens, requests, seconds = (b - a for a, b in zip(before, [counted(name) for name in names]))
    assert inputs == 2 and tokens == sum(len(ids) for ids, _ in reference) and requests == 1
    assert 0 < seconds < took


def in_progress(mesh) -> float:
    """The gateway's requests in progress (each embedding input counts)."""
    text = httpx.get(f"{mesh.gateway.base_url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("baton_gateway_requests_in_progress{"))


def test_a_client_that_goes_away_cancels_its_embeddings(mesh):
    """Gone before its answer (its read timed out), a client's inputs stop counting at once and the
    prefill workers drop those not yet computed: a small request after it answers at once, not after
    the rest of the big one (seconds of prefill here)."""
    url = f"{mesh.gateway.base_url}/v1/embeddings"
    big = {"model": mesh.model_name, "input": [[10 + (7 * i + j) % 500 for j in range(2000)] for i in range(160)]}
    assert in_progress(mesh) == 0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=big, timeout=httpx.Timeout(30, read=0.5))
    deadline = time.monotonic() + 1.0
    while in_progress(mesh) > 0:
        assert time.monotonic() < deadline, "the inputs of a client gone are still in progress"
        time.sleep(0.02)
    start = time.monotonic()
    small = httpx.post(url, json={"model": mesh.model_name, "input": "The quick brown fox"}, timeout=30)
    assert small.status_code == 200 and time.monotonic() - start < 2.0


def test_an_input_may_fill_the_whole_context(mesh, client):
    """An embedding's one token is never computed, so no place is kept for it, as vLLM keeps none."""
    context = client.models.list().data[0].max_model_len
    whole = client.embeddings.create(model=mesh.model_name, input=[[5] * context])
    assert whole.usage.prompt_tokens == context
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.embeddings.create(model=mesh.model_name, input=[[5] * (context + 1)])
    mesh.assert_decode_pools_free()


def test_the_grpc_api_embeds_as_the_http_api_does(mesh, reference):
    with grpc.insecure_channel(mesh.gateway.grpc_address) as channel:
        stub = gateway_pb2_grpc.GenerateStub(channel)
        texts = stub.Embed(gateway_pb2.EmbedRequest(request_id="embed-1", texts=TEXTS), timeout=30)
        ids = stub.Embed(gateway_pb2.EmbedRequest(
            model=mesh.model_name, token_ids=[common_pb2.TokenIds(token_ids=ids) for ids, _ in reference],
            dimensions=16, normalize=False), timeout=30)
        refused = [stub.Embed(request, timeout=30) for request in (
            gateway_pb2.EmbedRequest(texts=TEXTS, token_ids=[common_pb2.TokenIds(token_ids=[5])]),
            gateway_pb2.EmbedRequest(token_ids=[common_pb2.TokenIds(token_ids=[5, -1])]),
            gateway_pb2.EmbedRequest(model="nope", texts=TEXTS))]
    assert texts.request_id == "embed-1" and texts.embeddings.prompt_tokens == sum(len(i) for i, _ in reference)
    for got, (_, hidden) in zip(texts.embeddings.data, reference):
        close(list(got.values), torch.nn.functional.normalize(hidden, dim=0))
    for got, (_, hidden) in zip(ids.embeddings.data, reference):
        close(list(got.values), hidden[:16])
    assert [(r.error.code, r.error.param) for r in refused] == [(400, "input"), (400, "token_ids"), (404, "model")]
    mesh.assert_decode_pools_free()


def test_a_conversation_is_embedded_as_its_chat_template_renders_it(mesh):
    """vLLM's `messages` in place of `input`: one input, rendered without a generation prompt unless
    asked for, as transformers renders it."""
    messages = [{"role": "system", "content": "Represent the question for retrieval."},
                {"role": "user", "content": "How warm is it in Oslo?"}]
    tokenizer = transformers.AutoTokenizer.from_pretrained(mesh.model_dir)
    model = transformers.AutoModel.from_pretrained(mesh.model_dir, dtype=torch.float32)
    for add_generation_prompt in (False, True):
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        ids = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0, -1]
        response = httpx.post(f"{mesh.gateway.base_url}/v1/embeddings", timeout=30, json={
            "model": mesh.model_name, "messages": messages, "add_generation_prompt": add_generation_prompt}).json()
        close(response["data"][0]["embedding"], torch.nn.functional.normalize(hidden, dim=0))
        assert response["usage"]["prompt_tokens"] == len(ids)
    mesh.assert_decode_pools_free()


def test_a_colocated_gateway_embeds_on_its_decode_workers(mesh, reference):
    gateway = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [], [d.address for d in mesh.decode],
                             "--colocated")
    try:
        with openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0) as colocated:
            response = colocated.embeddings.create(model=mesh.model_name, input=TEXTS[1])
    finally:
        gateway.terminate()
    close(response.data[0].embedding, torch.nn.functional.normalize(reference[1][1], dim=0))
    mesh.assert_decode_pools_free()


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": ["fine", ""]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": 100_000}, "dimensions"),
    ({"input": [[5, 10_000_000]]}, "input"),
    ({"input": [list(range(1, 3000))]}, "input"),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ({"input": 42}, "input"),
    ({"input": "hi", "messages": [{"role": "user", "content": "hi"}]}, "input"),
    ({}, "input"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages.0"),
])
def test_bad_input_is_a_400_and_holds_no_page(mesh, body, param):
    answer = httpx.post(f"{mesh.gateway.base_url}/v1/embeddings", json={"model": mesh.model_name, **body}, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and param in (error["param"] or "")
    mesh.assert_decode_pools_free()


def test_an_unknown_model_is_a_404(mesh, client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="hi")


DOCUMENTS = ["Paris is the capital of France.", "Dragons breathe fire.", "The quick brown fox jumps."]


def cosine(client, mesh, first: str, second: str) -> float:
    a, b = (torch.tensor(d.embedding) for d in client.embeddings.create(model=mesh.model_name,
                                                                          input=[first, second]).data)
    return float(a @ b)


def test_score_and_rerank_are_the_cosine_of_the_embeddings(mesh, client):
    """vLLM's /score and /rerank (Jina's and Cohere's shape) with an embedding model: each pair's cosine
    similarity; rerank orders the documents by it."""
    expected = [cosine(client, mesh, TEXTS[0], document) for document in DOCUMENTS]
    base = mesh.gateway.base_url
    one_to_many = httpx.post(f"{base}/score", timeout=30, json={"model": mesh.model_name, "text_1": TEXTS[0],
                                                                 "text_2": DOCUMENTS}).json()
    assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2] and one_to_many["object"] == "list"
    for data, want in zip(one_to_many["data"], expected):
        assert abs(data["score"] - want) < 1e-5
    pairwise = httpx.post(f"{base}/v1/score", timeout=30, json={"text_1": [TEXTS[0], TEXTS[1]],
                                                                "text_2": [DOCUMENTS[0], DOCUMENTS[1]]}).json()
    assert abs(pairwise["data"][1]["score"] - cosine(client, mesh, TEXTS[1], DOCUMENTS[1])) < 1e-5
    assert pairwise["model"] == mesh.model_name  # left out: the served model

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = httpx.post(f"{base}{path}", timeout=30, json={"model": mesh.model_name, "query": TEXTS[0],
                                                               "documents": DOCUMENTS, "top_n": 2}).json()
        order = sorted(range(3), key=lambda i: expected[i], reverse=True)[:2]
        assert [r["index"] for r in ranked["results"]] == order
        assert [r["document"]["text"] for r in ranked["results"]] == [DOCUMENTS[i] for i in order]
        assert all(abs(r["relevance_score"] - expected[r["index"]]) < 1e-5 for r in ranked["results"])
    mesh.assert_decode_pools_free()


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_2"),
    ("/score", {"text_1": [], "text_2": "c"}, "text_1"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
    ("/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
    ("/rerank", {"model": "no-such-model", "query": "q", "documents": ["d"]}, "model"),
])
def test_bad_score_and_rerank_requests_are_refused(mesh, path, body, param):
    answer = httpx.post(f"{mesh.gateway.base_url}{path}", json=body, timeout=30)
    assert answer.status_code in (400, 404), answer.text
    assert param in (answer.json()["error"]["param"] or "")


LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def classifier_mesh(tiny_demo_model, model_dir, labels: dict[int, str]):
    """A sequence classifier (LlamaForSequenceClassification, random weights) of `labels` over the demo
    model's tokenizer, behind a mesh of its own: (the mesh, the transformers model)."""
    demo = json.loads((tiny_demo_model / "config.json").read_text())
    config = transformers.LlamaConfig(
        vocab_size=demo["vocab_size"], hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=demo["max_position_embeddings"],
        bos_token_id=demo.get("bos_token_id"), eos_token_id=demo.get("eos_token_id"), initializer_range=0.2,
        id2label=labels, label2id={v: k for k, v in labels.items()})
    torch.manual_seed(4)
    model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_demo_model / name, model_dir / name)
    mesh = start_mesh(model_dir, num_prefill=1, num_decode=1)
    try:
        yield mesh, model
    finally:
        assert all(code == 0 for code in stop_mesh(mesh).values())


@pytest.fixture(scope="module")
def classifier(tiny_demo_model, tmp_path_factory):
    yield from classifier_mesh(tiny_demo_model, tmp_path_factory.mktemp("classifier") / "classifier", LABELS)


@pytest.fixture(scope="module")
def cross_encoder(tiny_demo_model, tmp_path_factory):
    yield from classifier_mesh(tiny_demo_model, tmp_path_factory.mktemp("cross") / "cross", {0: "LABEL_0"})


def test_classify_gives_the_classifiers_probabilities_as_transformers_does(classifier):
    mesh, model = classifier
    tokenizer = transformers.AutoTokenizer.from_pretrained(mesh.model_dir)
    answer = httpx.post(f"{mesh.gateway.base_url}/classify", timeout=30,
                        json={"model": mesh.model_name, "input": TEXTS}).json()
    assert answer["object"] == "list" and [d["index"] for d in answer["data"]] == [0, 1]
    for data, text in zip(answer["data"], TEXTS):
        with torch.no_grad():
            want = model(torch.tensor([tokenizer(text)["input_ids"]])).logits[0].softmax(dim=0)
        torch.testing.assert_close(torch.tensor(data["probs"]), want, atol=1e-4, rtol=1e-4)
        assert data["label"] == LABELS[int(want.argmax())] and data["num_classes"] == 3
    assert answer["usage"]["prompt_tokens"] == sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    mesh.assert_decode_pools_free()


def test_classify_asks_for_a_classification_head(mesh):
    answer = httpx.post(f"{mesh.gateway.base_url}/v1/classify", timeout=30,
                        json={"model": mesh.model_name, "input": "hi"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "model"
    assert "classification head" in answer.json()["error"]["message"]
    mesh.assert_decode_pools_free()


def test_a_cross_encoder_scores_each_pair_joined(cross_encoder):
    """A sequence classifier of one label (a cross-encoder reranker) scores a pair as vLLM scores with
    one: the texts joined by the tokenizer's pair template, the sigmoid of the head's logit."""
    mesh, model = cross_encoder
    tokenizer = transformers.AutoTokenizer.from_pretrained(mesh.model_dir)
    with torch.no_grad():
        expected = [float(model(torch.tensor([tokenizer(TEXTS[0], document)["input_ids"]])).logits[0, 0].sigmoid())
                    for document in DOCUMENTS]
    base = mesh.gateway.base_url
    scored = httpx.post(f"{base}/score", timeout=30, json={"text_1": TEXTS[0], "text_2": DOCUMENTS}).json()
    assert all(abs(d["score"] - want) < 1e-5 for d, want in zip(scored["data"], expected))
    ranked = httpx.post(f"{base}/v1/rerank", timeout=30, json={"query": TEXTS[0], "documents": DOCUMENTS}).json()
    assert [r["index"] for r in ranked["results"]] == sorted(range(3), key=lambda i: expected[i], reverse=True)
    mesh.assert_decode_pools_free()


def pooling(mesh, **body) -> httpx.Response:
    return httpx.post(f"{mesh.gateway.base_url}/pooling", timeout=30, json={"model": mesh.model_name, **body})


def test_pooling_answers_the_embeddings_by_default(mesh, reference):
    """vLLM's /pooling on a model without a classification head: each input's embedding, as
    /v1/embeddings gives it; use_activation false leaves it unnormalized; base64 as embeddings'."""
    answer = pooling(mesh, input=TEXTS)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert answer.headers["x-request-id"] == body["id"] and body["id"].startswith("pool-")
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "pooling"), (1, "pooling")]
    for data, (_, hidden) in zip(body["data"], reference):
        close(data["data"], torch.nn.functional.normalize(hidden, dim=0))
    assert body["usage"]["prompt_tokens"] == sum(len(ids) for ids, _ in reference)
    close(pooling(mesh, input=TEXTS[0], task="embed", use_activation=False).json()["data"][0]["data"],
          reference[0][1])
    packed = base64.b64decode(pooling(mesh, input=TEXTS[0], encoding_format="base64").json()["data"][0]["data"])
    close(list(struct.unpack(f"<{len(packed) // 4}f", packed)), torch.nn.functional.normalize(reference[0][1], dim=0))
    mesh.assert_decode_pools_free()


def test_pooling_a_classifier_answers_its_probabilities_by_default(classifier):
    mesh, _ = classifier
    classified = httpx.post(f"{mesh.gateway.base_url}/classify", timeout=30,
                            json={"model": mesh.model_name, "input": TEXTS}).json()
    pooled = pooling(mesh, input=TEXTS).json()
    assert [d["data"] for d in pooled["data"]] == [d["probs"] for d in classified["data"]]
    assert pooled["usage"] == classified["usage"]
    assert pooling(mesh, input=TEXTS, task="encode").json()["data"] == pooled["data"]
    embedded = httpx.post(f"{mesh.gateway.base_url}/v1/embeddings", timeout=30,
                          json={"model": mesh.model_name, "input": TEXTS[0]}).json()["data"][0]["embedding"]
    assert pooling(mesh, input=TEXTS[0], task="embed").json()["data"][0]["data"] == embedded
    answer = pooling(mesh, input=TEXTS[0], use_activation=False)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "use_activation"
    mesh.assert_decode_pools_free()


def test_token_embed_answers_every_tokens_hidden_state(mesh):
    """vLLM's token_embed: one row per input token, each the token's last hidden state (as transformers'
    AutoModel computes it) cut to `dimensions` and then normalized; base64 packs the rows one after
    another. The last input's blocks were cached by its embeddings just before, on both prefill workers
    (computed at once, one each): it is computed again."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(mesh.model_dir)
    model = transformers.AutoModel.from_pretrained(mesh.model_dir, dtype=torch.float32)
    texts = [*TEXTS, " ".join(TEXTS * 4)]
    assert pooling(mesh, input=[texts[-1]] * 2, task="embed").status_code == 200
    answer = pooling(mesh, input=texts, task="token_embed")
    assert answer.status_code == 200, answer.text
    body = answer.json()
    ids = [tokenizer(text)["input_ids"] for text in texts]
    assert len(ids[-1]) > 2 * 16  # whole pages of it were cached
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids))
    for data, one in zip(body["data"], ids):
        with torch.no_grad():
            states = model(torch.tensor([one])).last_hidden_state[0]
        assert data["object"] == "pooling" and len(data["data"]) == len(one)
        close(data["data"], torch.nn.functional.normalize(states, dim=-1))
    cut = pooling(mesh, input=TEXTS[0], task="token_embed", dimensions=8, use_activation=False).json()
    with torch.no_grad():
        states = model(torch.tensor([ids[0]])).last_hidden_state[0]
    close(cut["data"][0]["data"], states[:, :8])
    packed = base64.b64decode(pooling(mesh, input=TEXTS[0], task="token_embed",
                                      encoding_format="base64").json()["data"][0]["data"])
    rows = torch.tensor(struct.unpack(f"<{len(packed) // 4}f", packed)).view(len(ids[0]), -1)
    close(rows, torch.nn.functional.normalize(states, dim=-1))
    mesh.assert_decode_pools_free()


def test_an_answer_over_the_gateways_message_limit_is_a_400_not_a_retry(mesh):
    """A gateway taking smaller messages than its workers send (its --max-message-bytes): a per-token
    answer over its limit is a 400 naming the input and the flag, not the 429 of an overloaded
    worker (which the openai client retries, and which would fail the same way every time)."""
    small = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                           [d.address for d in mesh.decode], "--max-message-bytes", "65536")
    try:
        def token_embed(num_tokens: int) -> httpx.Response:
            return httpx.post(f"{small.base_url}/pooling", timeout=30, json={
                "model": mesh.model_name, "task": "token_embed", "input": [5 + k % 400 for k in range(num_tokens)]})

        assert token_embed(8).status_code == 200
        answer = token_embed(600)  # 600 rows of the model's width: well over 64 KiB
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "input" and "--max-message-bytes" in error["message"]
    finally:
        small.terminate()
    mesh.assert_decode_pools_free()


def test_token_classify_answers_the_heads_probabilities_at_every_token(classifier):
    """vLLM's token_classify on a sequence classifier (a process reward model's per-step scores): its
    head at each token's last hidden state, a softmax over the labels each, as transformers computes them."""
    mesh, model = classifier
    tokenizer = transformers.AutoTokenizer.from_pretrained(mesh.model_dir)
    answer = pooling(mesh, input=TEXTS, task="token_classify")
    assert answer.status_code == 200, answer.text
    for data, text in zip(answer.json()["data"], TEXTS):
        with torch.no_grad():
            states = model.model(torch.tensor([tokenizer(text)["input_ids"]])).last_hidden_state[0]
            want = model.score(states).softmax(dim=-1)
        close(data["data"], want)
        # The last token's is the sequence's.
        close(data["data"][-1], torch.tensor(pooling(mesh, input=text).json()["data"][0]["data"]))
    refused = pooling(mesh, input=TEXTS[0], task="token_classify", use_activation=False)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "use_activation"
    mesh.assert_decode_pools_free()


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "task": "plugin"}, "task"),
    ({"input": "hi", "task": "sing"}, "task"),
    ({"input": "hi", "task": "classify"}, "model"),  # no classification head
    ({"input": "hi", "task": "token_classify"}, "model"),
    ({"input": ""}, "input"),
])
def test_what_pooling_cannot_serve_is_a_400_naming_it(mesh, body, param):
    answer = pooling(mesh, **body)
    assert answer.status_code == 400, answer.text
    assert param in (answer.json()["error"]["param"] or "")
    mesh.assert_decode_pools_free()
