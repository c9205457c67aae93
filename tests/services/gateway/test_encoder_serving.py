"""A BERT embedding model (all-MiniLM's shape: mean pooling, then normalized) served by the mesh:
`/v1/embeddings` through the `openai` client equal to sentence-transformers' computation on the
same weights, `/score` from them, and text generation refused with a 400 naming the model; BERT
and ModernBERT cross-encoders' `/score` and `/rerank` equal to transformers' scores."""
from __future__ import annotations

import grpc
import httpx
import openai
import pytest
import torch

from protos import gateway_pb2, gateway_pb2_grpc
from tests.encoder_models import make_encoder, transformers_embedding
from tests.services.gateway.mesh import start_mesh, stop_mesh

transformers = pytest.importorskip("transformers")

TEXTS = ["The quick brown fox jumps over the lazy dog.", "A cat sat on the mat!"]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    model_dir = make_encoder(tmp_path_factory.mktemp("encoder") / "minilm", "BertModel", "mean")
    mesh = start_mesh(model_dir, num_prefill=1, num_decode=1)
    try:
        yield mesh
    finally:
        assert all(code == 0 for code in stop_mesh(mesh).values())


@pytest.fixture(scope="module")
def client(mesh):
    with openai.OpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def expected_embedding(mesh, text: str) -> torch.Tensor:
    ids = transformers.AutoTokenizer.from_pretrained(mesh.model_dir)(text)["input_ids"]
    return torch.nn.functional.normalize(transformers_embedding(mesh.model_dir, ids, "mean"), dim=0)


def test_embeddings_are_the_mean_pooled_hidden_states_normalized(mesh, client):
    response = client.embeddings.create(model=mesh.model_name, input=TEXTS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(mesh.model_dir)
    for data, text in zip(response.data, TEXTS):
        torch.testing.assert_close(torch.tensor(data.embedding), expected_embedding(mesh, text), atol=1e-4,
                                   rtol=1e-4)
    assert response.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)  # [CLS] and [SEP]
    scored = httpx.post(f"{mesh.gateway.base_url}/score", timeout=30,
                        json={"model": mesh.model_name, "text_1": TEXTS[0], "text_2": TEXTS[1]}).json()
    cosine = float(expected_embedding(mesh, TEXTS[0]) @ expected_embedding(mesh, TEXTS[1]))
    assert abs(scored["data"][0]["score"] - cosine) < 1e-4
    mesh.assert_decode_pools_free()


def test_token_embed_answers_every_tokens_hidden_state(mesh):
    """An encoder's tokens attend to each other: each token's state is the whole input's computation."""
    ids = transformers.AutoTokenizer.from_pretrained(mesh.model_dir)(TEXTS[0])["input_ids"]
    model = transformers.AutoModel.from_pretrained(mesh.model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        states = model(torch.tensor([ids])).last_hidden_state[0]
    answer = httpx.post(f"{mesh.gateway.base_url}/pooling", timeout=30,
                        json={"model": mesh.model_name, "input": TEXTS[0], "task": "token_embed"})
    assert answer.status_code == 200, answer.text
    torch.testing.assert_close(torch.tensor(answer.json()["data"][0]["data"]),
                               torch.nn.functional.normalize(states, dim=-1), atol=1e-4, rtol=1e-4)
    mesh.assert_decode_pools_free()


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "the cat", "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"input": "hi"}),
])
def test_text_generation_is_refused_naming_the_model(mesh, path, body):
    answer = httpx.post(f"{mesh.gateway.base_url}{path}", timeout=30, json={"model": mesh.model_name, **body})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "model" and error["code"] == "model_not_generative"
    assert "/v1/embeddings" in error["message"]


def test_a_text_over_the_encoders_positions_is_a_400(mesh, client):
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=mesh.model_name, input="the cat sat " * 700)
    mesh.assert_decode_pools_free()


def test_the_grpc_generate_api_refuses_it_too(mesh):
    with grpc.insecure_channel(mesh.gateway.grpc_address) as channel:
        [response] = list(gateway_pb2_grpc.GenerateStub(channel).Generate(
            gateway_pb2.GenerateRequest(request_id="encoder-1", text="the cat"), timeout=30))
    assert response.WhichOneof("response") == "error"
    assert response.error.code == 400 and response.error.param == "model"


@pytest.fixture(scope="module", params=["BertForSequenceClassification", "ModernBertForSequenceClassification"])
def reranker(tmp_path_factory, request):
    """ms-marco-MiniLM's shape: a BERT cross-encoder of one label; gte-reranker-modernbert's."""
    model_dir = make_encoder(tmp_path_factory.mktemp("reranker") / "cross-encoder", request.param, "cls",
                             num_labels=1)
    mesh = start_mesh(model_dir, num_prefill=1, num_decode=1)
    try:
        yield mesh
    finally:
        assert all(code == 0 for code in stop_mesh(mesh).values())


def test_a_cross_encoder_reranks_as_transformers_scores_each_pair(reranker):
    query, documents = "the quick brown fox", ["a lazy dog sat on the mat", "the quick fox jumps", "red sky"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(reranker.model_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(reranker.model_dir, dtype=torch.float32)
    is_bert = model.config.model_type == "bert"
    expected = []
    for document in documents:  # BERT's token types from the tokenizer: the document's are 1
        pair = {k: v for k, v in tokenizer(query, document, return_tensors="pt").items()
                if k != "token_type_ids" or is_bert}
        with torch.no_grad():
            expected.append(float(model.eval()(**pair).logits[0, 0].sigmoid()))
    base = reranker.gateway.base_url
    scored = httpx.post(f"{base}/score", timeout=30, json={"text_1": query, "text_2": documents}).json()
    assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=1e-5)
    ranked = httpx.post(f"{base}/v1/rerank", timeout=30, json={"query": query, "documents": documents}).json()
    assert [r["index"] for r in ranked["results"]] == sorted(range(3), key=lambda i: expected[i], reverse=True)
    # Its head reads the pooled [CLS] state: it classifies sequences, not tokens.
    per_token = httpx.post(f"{base}/pooling", timeout=30, json={"model": reranker.model_name, "input": query,
                                                                  "task": "token_classify"})
    assert per_token.status_code == 400 and per_token.json()["error"]["param"] == "task", per_token.text
    reranker.assert_decode_pools_free()
