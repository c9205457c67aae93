"""`baton up --colocated`: the layout disaggregation is measured against. A real process
runs a tokenizer, one worker that prefills and decodes in one engine (the decode service)
and a gateway with no prefill pool; the `openai` client gets the in-process engine's
greedy tokens, every prompt (past the conditional-disaggregation limit too) is
prefilled on that worker, and SIGTERM stops everything."""
from __future__ import annotations

import re
import signal

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from services.common.settings import ConfigError
from services.gateway.config import GatewayConfig
from services.launcher.specs import COLOCATED_KV_BLOCKS, MeshConfig
from services.tokenizer.model_tokenizer import ModelTokenizer
from tests.services.test_baton_up import BatonUp, command_line, is_alive, leftover_segments, wait_all_dead

MESSAGES = [{"role": "user", "content": "Name three colours."}]
# Longer than the tiny model's automatic local-prefill limit (2048 / 8 = 256 tokens): a
# disaggregated gateway would send it to a prefill worker.
LONG_PROMPT = [(11 * j) % 900 + 5 for j in range(300)]


@pytest.fixture(scope="module")
def up(tiny_demo_model):
    up = BatonUp(tiny_demo_model, "--colocated")
    up.wait_up()
    yield up
    up.cleanup()


@pytest.fixture(scope="module")
def api(up) -> tuple[str, str]:
    """The gateway's base URL and model name, from the banner."""
    banner = next(line for line in up.stdout if line.startswith("Baton is up: "))
    match = re.search(r"OpenAI API at (http://\S+)/v1 \(model (\S+)\)", banner)
    return match[1], match[2]


@pytest.fixture(scope="module")
def client(api):
    with openai.OpenAI(base_url=f"{api[0]}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def engine(tiny_demo_model) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=128))


@pytest.fixture(scope="module")
def tokenizer(tiny_demo_model) -> ModelTokenizer:
    return ModelTokenizer.from_dir(tiny_demo_model)


def greedy_ids(engine: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    engine.add_request("reference", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    ids: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids = list(out.token_ids)
    return ids


def continuation(tokenizer: ModelTokenizer, prompt: list[int], output: list[int]) -> str:
    return tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)):]


def prefills_by_place(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {sample.labels["place"]: sample.value for family in text_string_to_metric_families(text)
            if family.name == "baton_gateway_prefills" for sample in family.samples
            if sample.name == "baton_gateway_prefills_total"}


def test_the_table_shows_one_colocated_worker_and_no_prefill_process(up):
    assert set(up.pids) == {"redis", "tokenizer", "colocated-0", "gateway"}, up.output()
    assert all(is_alive(pid) for pid in up.pids.values())
    worker = command_line(up.pids["colocated-0"])
    assert worker[worker.index("-m") + 1] == "services.decode"
    assert worker[worker.index("--kv-blocks") + 1] == str(COLOCATED_KV_BLOCKS)
    gateway = command_line(up.pids["gateway"])
    assert "--colocated" in gateway and "--prefill" not in gateway
    assert gateway[gateway.index("--decode") + 1] == up.addresses["colocated-0"].split(",")[0]
    assert not any("services.prefill" in command_line(pid) for pid in up.pids.values())
    assert up.wait_for(lambda: set(up.pools()) == {"colocated-0"}), up.output()


def test_every_prompt_is_prefilled_on_the_worker_with_the_engines_greedy_tokens(api, client, engine, tokenizer):
    base_url, model = api
    before = prefills_by_place(base_url)
    short = tokenizer.encode("The quick brown fox jumps over the lazy dog, and then")
    for prompt in (short, LONG_PROMPT):
        expected = continuation(tokenizer, prompt, greedy_ids(engine, prompt, 16))
        response = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert response.choices[0].text == expected
        assert response.usage.completion_tokens == 16

    chat_prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)[1]
    expected = continuation(tokenizer, chat_prompt, greedy_ids(engine, chat_prompt, 12))
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "length"

    after = prefills_by_place(base_url)
    assert after.get("decode", 0) - before.get("decode", 0) == 3
    assert after.get("prefill", 0) == 0


def test_sigterm_stops_every_process_and_exits_0(up):
    up.proc.send_signal(signal.SIGTERM)
    assert up.wait_exit() == 0, up.output()
    assert wait_all_dead(up.pids.values(), 1.0) == []
    assert set(up.pools()) == {"colocated-0"} and leftover_segments(up) == []
    # Unmapped cleanly: nothing (the Redis publisher once) kept the engine's views of the pool alive.
    assert not [line for line in up.stderr if "still alive" in line or "BufferError" in line], up.output()
    assert up.stderr[-1] == "baton: stopped"


def test_colocated_takes_no_prefill_workers(tiny_demo_model, capsys):
    import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["up", "--colocated", "--prefill", "1"])
    assert exit_info.value.code == 2
    assert "argument --prefill: not allowed with argument --colocated" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--colocated runs no prefill workers"):
        MeshConfig(tiny_demo_model, num_prefill=1, is_colocated=True)
    with pytest.raises(ValueError, match="drop --kvstore"):
        MeshConfig(tiny_demo_model, num_prefill=0, is_colocated=True, with_kvstore=True)
    with pytest.raises(ValueError, match="or --colocated for none"):
        MeshConfig(tiny_demo_model, num_prefill=0)


def test_the_gateway_needs_prefill_workers_or_colocated(tiny_demo_model):
    common = ["--model", str(tiny_demo_model), "--tokenizer", "127.0.0.1:1", "--decode", "127.0.0.1:2"]
    env: dict[str, str] = {}
    with pytest.raises(ConfigError, match="no prefill workers: .* or --colocated"):
        GatewayConfig.from_args(common, env)
    with pytest.raises(ConfigError, match="--colocated runs no prefill workers"):
        GatewayConfig.from_args([*common, "--colocated", "--prefill", "127.0.0.1:3"], env)
    with pytest.raises(ConfigError, match="drop --local-prefill-max-tokens"):
        GatewayConfig.from_args([*common, "--colocated", "--local-prefill-max-tokens", "64"], env)
    config = GatewayConfig.from_args(common, {"BATON_GATEWAY_COLOCATED": "1"})
    assert config.is_colocated and config.prefill_addresses == ()
