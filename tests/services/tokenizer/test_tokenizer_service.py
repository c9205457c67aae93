"""The tokenizer service as a real process (`python -m services.tokenizer`) over real
gRPC: health, parity with `tokenizers` and `transformers`, the context check, bad
input, concurrency, and a clean exit on SIGTERM."""
from __future__ import annotations

import asyncio
import functools
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenizers import Tokenizer

from protos import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.common.channel import make_channel
from services.common.limits import DEFAULT_MAX_MESSAGE_BYTES, message_size_options
from services.tokenizer.config import ConfigError, TokenizerServiceConfig
from services.tokenizer.converters import chat_message_to_proto
from services.tokenizer.servicer import SERVICE_NAME
from tests.services.tokenizer.conftest import SHARED_MODEL_NAMES, shared_model_dir

REPO_ROOT = Path(__file__).resolve().parents[3]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3, héhé? 🙂"}],
]
TEXTS = ["Hello, world!", "  leading spaces and\nnewlines\t", "héllo wörld 你好 🙂", "a" * 5000]


class Service:
    """One `python -m services.tokenizer` process and a sync channel to it."""

    def __init__(self, model_dir: Path, *extra_args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.tokenizer", "--model", str(model_dir), "--port", "0", *extra_args],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.address = _read_listening_line(self.proc, timeout_s=30)
        self.channel = grpc.insecure_channel(self.address, options=message_size_options(DEFAULT_MAX_MESSAGE_BYTES))
        self.stub = tokenizer_pb2_grpc.TokenizerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.wait_serving()

    def wait_serving(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self.health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
            assert time.monotonic() < deadline, "the tokenizer never reported SERVING"
            time.sleep(0.05)

    def close(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()


def _read_listening_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The HOST:PORT of the first stdout line; fails with the process's stderr if none comes."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not lines or not lines[0].startswith("tokenizer listening on "):
        proc.kill()
        pytest.fail(f"no listening line (got {lines!r}); stderr:\n{proc.stderr.read()}")
    return lines[0].removeprefix("tokenizer listening on ").strip()


@pytest.fixture(scope="module")
def service(demo_model_dir):
    svc = Service(demo_model_dir)
    yield svc
    svc.close()


def chat_request(messages, add_generation_prompt=True) -> tokenizer_pb2.ApplyChatTemplateRequest:
    return tokenizer_pb2.ApplyChatTemplateRequest(
        request_id="r", messages=[common_pb2.ChatMessage(**m) for m in messages],
        add_generation_prompt=add_generation_prompt)


def assert_invalid(call, request, *fragments: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    for fragment in fragments:
        assert fragment in err.value.details()


@functools.cache
def auto_tokenizer(model_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


def transformers_chat_ids(model_dir: Path, messages) -> list[int]:
    tok = auto_tokenizer(model_dir)
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


def test_health_serving_for_server_and_service(service):
    for name in ["", SERVICE_NAME]:
        reply = service.health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_encode_equals_tokenizers(service, demo_model_dir):
    raw = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    for text in TEXTS:
        for add in (True, False):
            reply = service.stub.Encode(tokenizer_pb2.EncodeRequest(request_id="r", text=text,
                                                                    add_special_tokens=add), timeout=10)
            assert list(reply.token_ids) == raw.encode(text, add_special_tokens=add).ids


def test_chat_template_equals_transformers(service, demo_model_dir):
    for messages in CONVERSATIONS:
        reply = service.stub.ApplyChatTemplate(chat_request(messages), timeout=10)
        assert list(reply.token_ids) == transformers_chat_ids(demo_model_dir, messages)
        assert reply.text.endswith("<|im_start|>assistant\n")


def test_a_requests_template_documents_and_special_tokens_render_as_transformers_renders_them(service,
                                                                                                demo_model_dir):
    template = ("{{ bos_token }}{% for d in documents or [] %}<doc title={{ d.title | tojson }}>{{ d.text }}</doc>"
                "{% endfor %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    documents = [{"title": "Zürich", "text": "21 °C"}]
    messages = CONVERSATIONS[1]
    request = chat_request(messages)
    request.chat_template, request.documents_json = template, json.dumps(documents)
    reply = service.stub.ApplyChatTemplate(request, timeout=10)
    hf = auto_tokenizer(demo_model_dir)
    assert reply.text == hf.apply_chat_template(messages, chat_template=template, documents=documents,
                                                tokenize=False)
    assert '<doc title="Zürich">21 °C</doc>' in reply.text
    assert list(reply.token_ids) == hf(reply.text, add_special_tokens=False)["input_ids"]
    request.add_special_tokens = True  # the tokenizer's BOS before the template's own
    again = service.stub.ApplyChatTemplate(request, timeout=10)
    assert list(again.token_ids) == hf(reply.text, add_special_tokens=True)["input_ids"] != list(reply.token_ids)
    for field, value, words in (("chat_template", "{% if %}", ("does not compile",)),
                                ("documents_json", "{}", ("documents", "list")),
                                ("documents_json", "[1]", ("documents", "list"))):
        bad = chat_request(messages)
        setattr(bad, field, value)
        assert_invalid(service.stub.ApplyChatTemplate, bad, *words)


def test_decode_round_trips(service):
    for text in TEXTS:
        ids = service.stub.Encode(tokenizer_pb2.EncodeRequest(text=text, add_special_tokens=True)).token_ids
        plain = service.stub.Decode(tokenizer_pb2.DecodeRequest(token_ids=ids, skip_special_tokens=True))
        assert plain.text == text
        special = service.stub.Decode(tokenizer_pb2.DecodeRequest(token_ids=ids, skip_special_tokens=False))
        assert special.text == "<|begin_of_text|>" + text


def test_check_context(service):
    check = service.stub.CheckContext
    fits = check(tokenizer_pb2.CheckContextRequest(num_prompt_tokens=2000, max_tokens=48))
    assert (fits.fits, fits.max_model_len, fits.max_tokens, fits.message) == (True, 2048, 48, "")
    budget = check(tokenizer_pb2.CheckContextRequest(num_prompt_tokens=2000))
    assert (budget.fits, budget.max_tokens) == (True, 48)

    over = check(tokenizer_pb2.CheckContextRequest(num_prompt_tokens=2000, max_tokens=49))
    assert (over.fits, over.max_model_len, over.max_tokens) == (False, 2048, 49)
    assert over.message.startswith("This model's maximum context length is 2048 tokens. However, you requested "
                                   "2049 tokens (2000 in the prompt, 49 for the completion).")
    full = check(tokenizer_pb2.CheckContextRequest(num_prompt_tokens=2048))
    assert (full.fits, full.max_tokens) == (False, 0)
    assert "2048 tokens" in full.message and "your prompt has 2048 tokens" in full.message


def test_bad_input_is_invalid_argument(service):
    stub = service.stub
    assert_invalid(stub.ApplyChatTemplate, tokenizer_pb2.ApplyChatTemplateRequest(), "messages must not be empty")
    assert_invalid(stub.ApplyChatTemplate, chat_request([{"role": "user", "content": "hi"}, {"content": "x"}]),
                   "messages[1] has no role")
    hi = chat_request([{"role": "user", "content": "hi"}])
    for kwargs, words in (("{not json", ("not JSON",)), ("[1]", ("JSON object",)),
                          ('{"tools": []}', ("cannot set", "tools")),
                          ('{"special_tokens": 1}', ("cannot set", "special_tokens"))):
        hi.chat_template_kwargs_json = kwargs
        assert_invalid(stub.ApplyChatTemplate, hi, *words)
    hi.chat_template_kwargs_json = ""
    hi.continue_final_message = True  # with the generation prompt chat_request asks for
    assert_invalid(stub.ApplyChatTemplate, hi, "cannot both be set")
    assert_invalid(stub.Decode, tokenizer_pb2.DecodeRequest(token_ids=[1, 2, 999_999]), "999999", "vocabulary")
    assert_invalid(stub.Decode, tokenizer_pb2.DecodeRequest(token_ids=[-1]), "-1")
    assert_invalid(stub.CheckContext, tokenizer_pb2.CheckContextRequest(num_prompt_tokens=0), "empty")
    assert_invalid(stub.CheckContext, tokenizer_pb2.CheckContextRequest(num_prompt_tokens=5, max_tokens=0),
                   "max_tokens")
    # The server is still fine afterwards.
    assert stub.Encode(tokenizer_pb2.EncodeRequest(text="ok")).token_ids


def test_concurrent_encodes(service, demo_model_dir):
    raw = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    texts = [f"request {i}: " + "lorem ipsum " * (i * 300) for i in range(20)]  # some long enough for a thread

    async def main():
        async with make_channel(service.address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerStub(channel)
            return await asyncio.gather(*(stub.Encode(tokenizer_pb2.EncodeRequest(text=t), timeout=20)
                                          for t in texts))

    replies = asyncio.run(main())
    assert [list(r.token_ids) for r in replies] == [raw.encode(t, add_special_tokens=False).ids for t in texts]


def test_sigterm_exits_zero(demo_model_dir):
    svc = Service(demo_model_dir)
    try:
        svc.proc.send_signal(signal.SIGTERM)
        assert svc.proc.wait(timeout=8) == 0
    finally:
        svc.close()


def test_unloadable_model_exits_with_a_clear_error(demo_model_dir, tmp_path):
    # max_model_len beyond the model's context is refused at load time.
    proc = subprocess.run([sys.executable, "-m", "services.tokenizer", "--model", str(demo_model_dir),
                           "--max-model-len", "999999"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "max_model_len=999999" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "services.tokenizer", "--model", str(tmp_path)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "no tokenizer.json" in proc.stderr


def test_config_from_flags_and_environment(demo_model_dir):
    env = {"BATON_MODEL": str(demo_model_dir), "BATON_TOKENIZER_PORT": "7001", "BATON_MAX_MODEL_LEN": "512"}
    config = TokenizerServiceConfig.from_args([], env=env)
    assert (config.model_dir, config.host, config.port, config.max_model_len) == (demo_model_dir, "127.0.0.1",
                                                                                  7001, 512)
    assert TokenizerServiceConfig.from_args(["--port", "7002"], env=env).port == 7002  # a flag beats the env
    with pytest.raises(ConfigError, match="--port"):
        TokenizerServiceConfig.from_args(["--port", "70000"], env=env)
    with pytest.raises(ConfigError, match="BATON_MODEL"):
        TokenizerServiceConfig.from_args([], env={})
    with pytest.raises(ConfigError, match="BATON_TOKENIZER_PORT"):
        TokenizerServiceConfig.from_args([], env={**env, "BATON_TOKENIZER_PORT": "x"})


def test_a_chat_template_from_a_file_or_written_out_replaces_the_models(demo_model_dir, tmp_path):
    written = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(written)
    env = {"BATON_MODEL": str(demo_model_dir)}
    assert TokenizerServiceConfig.from_args(["--chat-template", str(tmp_path / "t.jinja")], env=env).chat_template \
        == written
    assert TokenizerServiceConfig.from_args([], env={**env, "BATON_CHAT_TEMPLATE": written}).chat_template == written
    assert TokenizerServiceConfig.from_args([], env=env).chat_template is None
    with pytest.raises(ConfigError, match="no such file"):
        TokenizerServiceConfig.from_args(["--chat-template", str(tmp_path / "absent.jinja")], env=env)
    with pytest.raises(ConfigError, match="does not compile"):
        TokenizerServiceConfig.from_args(["--chat-template", "{% for %}"], env=env)
    svc = Service(demo_model_dir, "--chat-template", str(tmp_path / "t.jinja"))
    try:
        reply = svc.stub.ApplyChatTemplate(chat_request(CONVERSATIONS[0]), timeout=10)
        assert reply.text == "[user] Hello there!"
    finally:
        svc.close()


@pytest.mark.parametrize("name", SHARED_MODEL_NAMES)
def test_shared_models_chat_template_parity(name):
    model_dir = shared_model_dir(name)
    svc = Service(model_dir)
    try:
        for messages in CONVERSATIONS:
            reply = svc.stub.ApplyChatTemplate(chat_request(messages), timeout=10)
            assert list(reply.token_ids) == transformers_chat_ids(model_dir, messages)
        if name == "tiny-llama2-spm":  # its template raises on roles that do not alternate
            assert_invalid(svc.stub.ApplyChatTemplate,
                           chat_request([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]),
                           "alternate")
    finally:
        svc.close()



def test_tools_and_tool_call_turns_render_as_transformers_renders_them():
    # A template that shows tools (Qwen2.5's): the tool list, an assistant's call and the tool's answer.
    model_dir = shared_model_dir("tiny-qwen2.5-bpe")
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "call_1"},
    ]
    svc = Service(model_dir)
    try:
        request = tokenizer_pb2.ApplyChatTemplateRequest(
            request_id="r", messages=[chat_message_to_proto(m) for m in messages], add_generation_prompt=True,
            tools_json=json.dumps(tools))
        reply = svc.stub.ApplyChatTemplate(request, timeout=10)
        expected = auto_tokenizer(model_dir).apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                                 tokenize=True)["input_ids"]
        assert list(reply.token_ids) == list(expected) and "get_weather" in reply.text
        request.tools_json = '{"not": "a list"}'
        assert_invalid(svc.stub.ApplyChatTemplate, request, "tools must be a JSON list")
    finally:
        svc.close()
