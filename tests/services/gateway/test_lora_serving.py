"""LoRA adapters through the mesh, as vLLM's `--lora-modules` serves them: a gateway and workers
started with an adapter list it in /v1/models, and a request naming it as its model (HTTP or gRPC)
is computed with it on prefill and decode, whether prefilled by a prefill worker (KV handed over)
or by its decode worker; its output equals the engine's with the same adapter."""
from __future__ import annotations

import re
import signal
import time

import grpc
import httpx
import openai
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.decode.servicer import SERVICE_NAME as DECODE_SERVICE
from services.tokenizer.servicer import SERVICE_NAME as TOKENIZER_SERVICE
from tests.lora_adapters import ALL_PROJECTIONS, make_adapter
from tests.services.gateway.mesh import GatewayProcess, gateway_client, start_mesh, stop_mesh
from tests.services.service_process import ServiceProcess, stop_processes, wait_all_serving

transformers = pytest.importorskip("transformers")
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapter(tiny_demo_model, tmp_path_factory):
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_demo_model, dtype="float32")
    where = tmp_path_factory.mktemp("lora") / "tuned"
    make_adapter(where, base, ALL_PROJECTIONS, 4, 8.0, False, seed=5)
    return where


@pytest.fixture(scope="module")
def lora_mesh(tiny_demo_model, adapter):
    # The gateway's default local prefill: short prompts prefill on their decode worker, long ones on
    # the prefill worker, whose KV the decode worker then reads.
    flags = ("--lora-modules", f"tuned={adapter}")
    mesh = start_mesh(tiny_demo_model, num_prefill=1, num_decode=1, gateway_args=flags, worker_args=flags)
    try:
        yield mesh
    finally:
        assert all(code == 0 for code in stop_mesh(mesh).values())


def engine_outputs(model_dir, adapter, prompts: list[list[int]], lora_name: str | None) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=128,
                                    lora_modules=(("tuned", str(adapter)),)))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, lora_name=lora_name)
    finished = {out.request_id: out.token_ids for out in engine.generate(prompts, params) if out.finished}
    return [finished[request_id] for request_id in sorted(finished, key=lambda r: int(r.removeprefix("gen-")))]


def test_a_request_naming_the_adapter_is_computed_with_it_on_every_path(lora_mesh, adapter):
    short, long = list(range(40, 60)), [40 + (i * 7) % 900 for i in range(300)]  # prefilled on decode; on prefill
    tuned = engine_outputs(lora_mesh.model_dir, adapter, [short, long], "tuned")
    base = engine_outputs(lora_mesh.model_dir, adapter, [short, long], None)
    assert tuned != base  # the adapter changes the output enough to tell
    with openai.OpenAI(base_url=f"{lora_mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        cards = {card.id: card for card in client.models.list().data}
        assert set(cards) == {lora_mesh.model_name, "tuned"}
        assert cards["tuned"].root == str(adapter) and cards["tuned"].parent == lora_mesh.model_name
        for name, expected in (("tuned", tuned), (lora_mesh.model_name, base)):
            for prompt, tokens in zip((short, long), expected):
                answer = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                   logprobs=0, extra_body={"ignore_eos": True,
                                                                           "return_tokens_as_token_ids": True})
                assert answer.model == name
                made = [int(t.removeprefix("token_id:")) for t in answer.choices[0].logprobs.tokens]
                assert made == tokens, (name, len(prompt))
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="untuned", prompt="hi", max_tokens=1)
    with grpc.insecure_channel(lora_mesh.gateway.grpc_address) as channel:
        stub = gateway_pb2_grpc.GenerateStub(channel)
        greedy = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        [done] = [r for r in stub.Generate(gateway_pb2.GenerateRequest(
            model="tuned", token_ids=common_pb2.TokenIds(token_ids=long), sampling=greedy), timeout=60)
            if r.HasField("complete")]
        assert list(done.complete.token_ids) == tuned[1]
        unknown = common_pb2.SamplingParams(max_tokens=2, lora_name="untuned")
        [refused] = stub.Generate(gateway_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(token_ids=short),
                                                              sampling=unknown), timeout=30)
        assert refused.error.code == 400 and refused.error.param == "sampling.lora_name"
    lora_mesh.assert_decode_pools_free()


def test_sglangs_ways_of_naming_the_adapter_name_it(lora_mesh, adapter):
    """SGLang's OpenAI API takes an adapter as `model` "MODEL:ADAPTER", or as `lora_path`."""
    prompt = list(range(40, 60))
    [tuned] = engine_outputs(lora_mesh.model_dir, adapter, [prompt], "tuned")
    with openai.OpenAI(base_url=f"{lora_mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        def made(model: str, **extra) -> list[int]:
            answer = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                               logprobs=0, extra_body={"ignore_eos": True, **extra,
                                                                       "return_tokens_as_token_ids": True})
            return [int(t.removeprefix("token_id:")) for t in answer.choices[0].logprobs.tokens]

        assert made(f"{lora_mesh.model_name}:tuned") == tuned
        assert made(lora_mesh.model_name, lora_path="tuned") == tuned
        with pytest.raises(openai.NotFoundError):
            made(lora_mesh.model_name, lora_path="untuned")
        with pytest.raises(openai.NotFoundError):
            made(f"{lora_mesh.model_name}:untuned")
    lora_mesh.assert_decode_pools_free()


@pytest.fixture(scope="module")
def second_adapter(tiny_demo_model, tmp_path_factory):
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_demo_model, dtype="float32")
    where = tmp_path_factory.mktemp("lora") / "second"
    make_adapter(where, base, ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"), 2, 4.0, True, seed=9)
    return where


def test_adapters_load_and_unload_at_run_time_through_the_mesh(tiny_demo_model, adapter, second_adapter):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: a loaded adapter is named and computed
    with on every path, as one served from the start; unloaded, it is named no more; another loaded under
    its name computes as itself (no cached prefix of the first read on either worker)."""
    short, long = list(range(40, 60)), [40 + (i * 7) % 900 for i in range(300)]
    first = engine_outputs(tiny_demo_model, adapter, [short, long], "tuned")
    second = engine_outputs(tiny_demo_model, second_adapter, [short, long], "tuned")
    assert first != second
    allowed = ("--allow-runtime-lora-updating",)
    mesh = start_mesh(tiny_demo_model, num_prefill=1, num_decode=1, gateway_args=allowed, worker_args=allowed)
    try:
        api = mesh.gateway.base_url
        with openai.OpenAI(base_url=f"{api}/v1", api_key="unused", max_retries=0) as client:
            def outputs(model: str) -> list[list[int]]:
                made = []
                for prompt in (short, long):
                    answer = client.completions.create(
                        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
                    made.append([int(t.removeprefix("token_id:")) for t in answer.choices[0].logprobs.tokens])
                return made

            def load(name: str, path) -> httpx.Response:
                return httpx.post(f"{api}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                                  timeout=60)

            with pytest.raises(openai.NotFoundError):
                outputs("rt")
            loaded = load("rt", adapter)
            assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'rt' added successfully.")
            assert {card.id for card in client.models.list().data} == {mesh.model_name, "rt"}
            assert outputs("rt") == first
            assert load("rt", adapter).status_code == 200  # again from the same path: reaches new workers
            clash = load("rt", second_adapter)
            assert clash.status_code == 400 and "already been loaded" in clash.json()["error"]["message"]
            broken = load("broken", second_adapter.parent / "nowhere")
            assert broken.status_code == 400 and "no adapter_config.json" in broken.json()["error"]["message"]
            assert broken.json()["error"]["param"] == "lora_path"
            assert {card.id for card in client.models.list().data} == {mesh.model_name, "rt"}
            unloaded = httpx.post(f"{api}/v1/unload_lora_adapter", json={"lora_name": "rt"}, timeout=60)
            assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'rt' removed successfully.")
            with pytest.raises(openai.NotFoundError):
                outputs("rt")
            again = httpx.post(f"{api}/v1/unload_lora_adapter", json={"lora_name": "rt"}, timeout=60)
            assert again.status_code == 404 and again.json()["error"]["message"] == \
                "The lora adapter 'rt' cannot be found."
            assert load("rt", second_adapter).status_code == 200
            assert outputs("rt") == second

            # SGLang's routes: the same updates, answered as SGLang answers them.
            def sglang(verb: str, **body) -> httpx.Response:
                return httpx.post(f"{api}/{verb}_lora_adapter", json=body, timeout=60)
            unloaded = sglang("unload", lora_name="rt")
            assert (unloaded.status_code, unloaded.json()) == (
                200, {"success": True, "error_message": "", "loaded_adapters": {}})
            loaded = sglang("load", lora_name="rt", lora_path=str(adapter), pinned=False)
            assert (loaded.status_code, loaded.json()) == (
                200, {"success": True, "error_message": "", "loaded_adapters": {"rt": str(adapter)}})
            assert outputs("rt") == first
            broken = sglang("load", lora_name="broken", lora_path=str(second_adapter.parent / "nowhere"))
            assert broken.status_code == 400 and broken.json()["success"] is False
            assert "no adapter_config.json" in broken.json()["error_message"]
            assert broken.json()["loaded_adapters"] == {"rt": str(adapter)}
        mesh.assert_decode_pools_free()
    finally:
        assert all(code == 0 for code in stop_mesh(mesh).values())


def test_a_worker_that_joins_after_a_runtime_load_is_given_the_adapter_before_it_is_routed_to(
        tiny_demo_model, adapter):
    """Decode worker B answers only after an adapter was loaded at run time (paused until then, as a
    replica added or restarted later is away): the gateway loads it onto B before routing to B, so
    once A is gone, B computes requests naming it as A did."""
    prompt = list(range(40, 60))
    [expected] = engine_outputs(tiny_demo_model, adapter, [prompt], "tuned")
    allowed = ("--allow-runtime-lora-updating",)
    tokenizer = ServiceProcess("tokenizer", TOKENIZER_SERVICE, tiny_demo_model, wait=False)
    first, late = (ServiceProcess("decode", DECODE_SERVICE, tiny_demo_model, "--kv-blocks", "128", *allowed,
                                  wait=False) for _ in range(2))
    gateway = None
    try:
        wait_all_serving([tokenizer, first, late])
        late.proc.send_signal(signal.SIGSTOP)
        gateway = GatewayProcess(tiny_demo_model, tokenizer.address, [], [first.address, late.address],
                                 "--colocated", *allowed)
        loaded = httpx.post(f"{gateway.base_url}/v1/load_lora_adapter",
                            json={"lora_name": "rt", "lora_path": str(adapter)}, timeout=60)
        assert loaded.status_code == 200, loaded.text
        late.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        serving = re.compile(r'^baton_gateway_workers\{[^}]*kind="decode"[^}]*state="serving"[^}]*\} 2\.0$', re.M)
        while not serving.search(httpx.get(f"{gateway.base_url}/metrics", timeout=5).text):
            assert time.monotonic() < deadline, "the late worker never came into routing"
            time.sleep(0.05)
        assert first.terminate() == 0
        with openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
            answer = client.completions.create(model="rt", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                               logprobs=0, extra_body={"ignore_eos": True,
                                                                       "return_tokens_as_token_ids": True})
        assert [int(t.removeprefix("token_id:")) for t in answer.choices[0].logprobs.tokens] == expected
    finally:
        if gateway is not None:
            gateway.terminate()
        late.proc.send_signal(signal.SIGCONT)
        stop_processes([tokenizer, first, late])


def test_runtime_updates_are_off_unless_allowed(lora_mesh, adapter):
    """Off by default, as in vLLM: no such endpoint on the gateway; a gateway that allows them over
    workers that do not is told so by the workers."""
    refused = httpx.post(f"{lora_mesh.gateway.base_url}/v1/load_lora_adapter",
                         json={"lora_name": "rt", "lora_path": str(adapter)}, timeout=30)
    assert refused.status_code == 404
    with gateway_client(lora_mesh, "--allow-runtime-lora-updating", "--lora-modules", f"tuned={adapter}") as client:
        answer = httpx.post(f"{client.base_url}load_lora_adapter", json={"lora_name": "rt", "lora_path": str(adapter)},
                            timeout=30)
        assert answer.status_code == 500 and "--allow-runtime-lora-updating" in answer.json()["error"]["message"]
        assert {card.id for card in client.models.list().data} == {lora_mesh.model_name, "tuned"}


def test_every_service_reads_the_runtime_updating_switch_alike(tiny_demo_model):
    from services.decode.config import DecodeServiceConfig
    from services.gateway.config import GatewayConfig
    from services.prefill.config import PrefillServiceConfig

    gateway_args = ["--tokenizer", "127.0.0.1:1", "--prefill", "127.0.0.1:2", "--decode", "127.0.0.1:3"]
    for config_class, extra in ((PrefillServiceConfig, []), (DecodeServiceConfig, []), (GatewayConfig, gateway_args)):
        argv = ["--model", str(tiny_demo_model), *extra]

        def allows(argv: list[str], env: dict[str, str]) -> bool:
            return config_class.from_args(argv, env=env).allow_runtime_lora_updating

        assert not allows(argv, {}) and not allows(argv, {"BATON_ALLOW_RUNTIME_LORA_UPDATING": ""})
        assert allows(argv, {"BATON_ALLOW_RUNTIME_LORA_UPDATING": "1"})
        assert allows([*argv, "--allow-runtime-lora-updating"], {})


def test_workers_read_max_cpu_loras_and_hold_it_to_max_loras(tiny_demo_model):
    from services.common.settings import ConfigError
    from services.decode.config import DecodeServiceConfig
    from services.prefill.config import PrefillServiceConfig

    for config_class in (PrefillServiceConfig, DecodeServiceConfig):
        argv = ["--model", str(tiny_demo_model), "--max-loras", "2"]
        assert config_class.from_args([*argv, "--max-cpu-loras", "3"], env={}).max_cpu_loras == 3
        with pytest.raises(ConfigError, match=r"--max-cpu-loras \(1\) must be at least --max-loras \(2\)"):
            config_class.from_args([*argv, "--max-cpu-loras", "1"], env={})
