"""Workers whose model is split across tensor-parallel ranks (--tensor-parallel-size), in a real mesh
through the `openai` client: the tokens of one unsplit engine, pages handed between workers split or
not alike (a split worker's pool holds every head), and no rank or pool file left behind."""
from __future__ import annotations

import os
import re
import signal

import openai
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from services.common.settings import ConfigError
from services.decode.config import DecodeServiceConfig
from services.prefill.config import PrefillServiceConfig
from tests.services.gateway.mesh import running_mesh
from tests.services.service_process import ServiceProcess
from tests.services.test_baton_up import (
    BatonUp,
    check_up,
    children_of,
    command_line,
    leftover_segments,
    wait_all_dead,
)

PROMPTS = [list(range(5, 60)), list(range(300, 310)), list(range(7, 40)) * 3]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def unsplit_tokens(tiny_demo_model) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=64))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    finished = {out.request_id: out.token_ids for out in engine.generate(PROMPTS, params) if out.finished}
    return [finished[f"gen-{i}"] for i in range(len(PROMPTS))]


def _rank_pids(worker: ServiceProcess) -> list[int]:
    """The worker's children running a rank (engine/tensor_parallel_workers.py)."""
    return [pid for pid in children_of(worker.proc.pid) if "engine.tensor_parallel_workers" in command_line(pid)]


def _files_left_by(pids: set[int]) -> list[str]:
    """The KV pool and sums files of shared memory that the split workers `pids` made and left."""
    return [name for name in os.listdir("/dev/shm") if name.startswith(("baton-kv-pool-", "baton-rank-sums-"))
            and int(name.split("-")[3]) in pids]


def _greedy(client: openai.OpenAI, model: str, prompt: list[int], stream: bool) -> str:
    kwargs = dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
    if not stream:
        return client.completions.create(**kwargs).choices[0].text
    return "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **kwargs)
                   if chunk.choices)


@pytest.mark.parametrize("config", [PrefillServiceConfig, DecodeServiceConfig])
def test_a_workers_split_comes_from_its_flag_or_the_shared_variable(config, tiny_demo_model):
    model = ["--model", str(tiny_demo_model)]
    assert config.from_args(model, {}).tensor_parallel_size == 1
    assert config.from_args(model, {"BATON_TENSOR_PARALLEL_SIZE": "2"}).tensor_parallel_size == 2
    assert config.from_args([*model, "-tp", "4"], {"BATON_TENSOR_PARALLEL_SIZE": "2"}).tensor_parallel_size == 4
    with pytest.raises(ConfigError, match="--tensor-parallel-size must be 1 or more, got 0"):
        config.from_args([*model, "--tensor-parallel-size", "0"], {})


@pytest.mark.parametrize(("prefill_size", "decode_size"), [(2, 2), (1, 2), (2, 1)])
def test_split_workers_answer_as_one_unsplit_engine(tiny_demo_model, unsplit_tokens, prefill_size, decode_size):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_demo_model / "tokenizer.json"))
    expected = [tokenizer.decode(tokens) for tokens in unsplit_tokens]
    # Every prompt prefilled by the prefill worker, its pages handed over: none computed by the decode worker.
    with running_mesh(tiny_demo_model, num_prefill=1, num_decode=1, gateway_args=("--local-prefill-max-tokens", "0"),
                      prefill_args=("--tensor-parallel-size", str(prefill_size)),
                      decode_args=("--tensor-parallel-size", str(decode_size))) as mesh:
        ranks = {worker: _rank_pids(worker) for worker in (*mesh.prefill, *mesh.decode)}
        assert [len(pids) for pids in ranks.values()] == [prefill_size - 1, decode_size - 1]
        with openai.OpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
            for prompt, text in zip(PROMPTS, expected, strict=True):
                assert _greedy(client, mesh.model_name, prompt, stream=False) == text
                assert _greedy(client, mesh.model_name, prompt, stream=True) == text
        mesh.assert_decode_pools_free()
    assert wait_all_dead([pid for pids in ranks.values() for pid in pids], 5.0) == []
    assert _files_left_by({worker.proc.pid for worker in ranks}) == []


def test_baton_up_splits_its_workers_and_stops_their_ranks_with_them(tiny_demo_model, unsplit_tokens):
    """`baton up --tensor-parallel-size 2` (vLLM's flag): each worker runs a second rank, the mesh answers as an
    unsplit engine, and SIGTERM leaves no rank, pool file or segment behind."""
    up = BatonUp(tiny_demo_model, "--tensor-parallel-size", "2", "--gateway-args=--local-prefill-max-tokens 0")
    try:
        check_up(up, 1, 1)
        ranks = [pid for name in ("prefill-0", "decode-0") for pid in children_of(up.pids[name])
                 if "engine.tensor_parallel_workers" in command_line(pid)]
        assert len(ranks) == 2, up.output()
        url = next(match[1] for line in up.stdout if (match := re.search(r"OpenAI API at (\S+/v1)", line)))
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as client:
            answer = client.completions.create(model=tiny_demo_model.name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                               temperature=0.0, extra_body={"ignore_eos": True})
        from tokenizers import Tokenizer

        assert answer.choices[0].text == Tokenizer.from_file(str(tiny_demo_model / "tokenizer.json")).decode(
            unsplit_tokens[0])
        up.proc.send_signal(signal.SIGTERM)
        assert up.wait_exit() == 0, up.output()
        assert wait_all_dead([*up.pids.values(), *ranks], 5.0) == []
        assert leftover_segments(up) == []
        assert _files_left_by(set(up.pids.values())) == []
    finally:
        up.cleanup()
