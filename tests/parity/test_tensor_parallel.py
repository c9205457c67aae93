"""A model split across tensor-parallel ranks (engine/tensor_parallel.py): what it refuses, its ranks'
processes and KV pool coming and going with the engine, a rank that dies, weights read again. That it
computes transformers' logits and tokens is test_transformers_parity.py's."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.demo_model import make_demo_model
from engine.llm_engine import LLMEngine
from engine.memory_release import release, resume, unique_storages
from engine.model_config_loader import load_model_config
from engine.sampling_params import SamplingParams
from engine.speculative import SpeculativeConfig
from engine.tensor_parallel import check_shardable
from engine.tensor_parallel_workers import RankError
from tests.draft_models import eagle_head
from tests.encoder_models import make_encoder
from tests.parity.conftest import greedy_outputs
from tests.parity.test_transformers_parity import _engine as parity_engine, _engine_greedy_matches, _engine_logits_match
from tests.services.test_baton_up import is_alive, wait_all_dead
from tests.unit.test_engine import assert_pool_clean, run_all
from tests.unit.test_memory_release import resident_bytes
from tests.unit.test_weight_update import GREEDY, PROMPT, SHAPE

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPTS = {"a": (list(range(3, 40)), {}), "b": (list(range(100, 107)), {})}


def _engine(model_dir: Path, tensor_parallel_size: int = 2, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, tensor_parallel_size=tensor_parallel_size,
                                  **options))


def _pool_files(pid: int) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"baton-kv-pool-{pid}-")]


@pytest.mark.parametrize(("name", "size", "refusal"), [
    ("llama-gqa-untied", 3, "must divide the model's num_heads (4)"),
    ("deepseek-v3", 3, "must divide the model's num_heads (4)"),  # MLA's one latent row is not split
    ("encoder", 2, "does not split BertModel yet"),
    ("stablelm-parallel", 2, "StableLM's q and k layer-normed a head"),
    ("gpt-bigcode", 2, "must divide the model's num_kv_heads (1)"),  # multi_query's one k and v head
    ("mimo-v2-flash", 4, "must divide the model's full layers' num_kv_heads (2)"),  # (its pages hold 4)
])
def test_a_model_the_ranks_cannot_split_is_refused_before_any_process_starts(tiny_model_dirs, tmp_path, name, size,
                                                                             refusal):
    model_dir = make_encoder(tmp_path / name) if name == "encoder" else tiny_model_dirs[name]
    with pytest.raises(ValueError, match=refusal.replace("(", r"\(").replace(")", r"\)")):
        _engine(model_dir, size)


def test_what_a_split_model_does_not_serve_yet_is_refused(tiny_model_dirs):
    config = load_model_config(tiny_model_dirs["llama-gqa-untied"])
    with pytest.raises(ValueError, match="CPU only"):
        check_shardable(config, 2, "cuda:0")
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        _engine(tiny_model_dirs["llama-gqa-untied"], 0)


def test_a_model_whose_layers_have_their_own_q_heads_is_split_only_where_each_layers_divide(tiny_model_dirs):
    """Laguna's layers each have their own q heads: every layer's count must split, not only the model's."""
    config = dataclasses.replace(load_model_config(tiny_model_dirs["laguna"]), num_kv_heads=4)
    check_shardable(config, 4, "cpu")
    with pytest.raises(ValueError, match=r"must divide the model's layer 1's num_heads \(6\)"):
        check_shardable(dataclasses.replace(config, layer_num_heads=(8, 6, 8)), 4, "cpu")


@pytest.mark.usefixtures("forked_ranks")  # (the tests below check the ranks' own processes)
@pytest.mark.parametrize("name", ["mimo-v2-flash", "gemma4-e", "minimax-m3", "gemma4-k-eq-v"])
def test_a_split_model_of_pages_laid_out_its_own_way_writes_the_pages_an_unsplit_one_writes(tiny_model_dirs, name):
    """MiMo-V2-Flash's full layers have half the pages' KV heads: each writes every other one of them, so that a
    rank's run of the pages' heads holds its share of a full layer's too. Gemma 4's pages hold two sliding layers'
    heads where a full layer's lie: each rank writes its share of each layer's in that layer's place. MiniMax-M3's
    hold its indexer's key after the KV heads: each rank writes its KV heads and the key alike. Gemma 4 31B's full
    layers (here) have fewer KV heads than there are ranks: each rank writes the one it computes with, as the others
    sharing it do. Either way a split worker's pages can be handed to an unsplit one (and back) as they are."""
    pools = {}
    for size in (1, 2):
        engine = _engine(tiny_model_dirs[name], size)
        run_all(engine, {"a": (list(range(3, 70)), SamplingParams(max_tokens=1, temperature=0.0))})
        pools[size] = engine.runner.kv_pool.tensor.clone()
        engine.close()
    assert pools[1].abs().sum() > 0
    torch.testing.assert_close(pools[2], pools[1], atol=1e-5, rtol=1e-4)


@pytest.mark.usefixtures("forked_ranks")  # (the tests below check the ranks' own processes)
@pytest.mark.parametrize(("name", "size"), [("llama-linear-rope-bf16", 2), ("llama-gqa-untied", 4), ("phi3", 4),
                                             ("gemma4-k-eq-v", 2)])
def test_ranks_outnumbering_the_kv_heads_each_compute_with_one_of_them(tiny_model_dirs, name, size):
    """As vLLM replicates KV heads where the ranks outnumber them: each rank holds its share of the q heads and the one
    KV head they attend over (one KV head for two ranks; two for four, Phi-3's of its fused q/k/v too; Gemma 4's full
    layers' one, its sliding layers' two split): the logits and greedy tokens are transformers'."""
    engine = parity_engine(tiny_model_dirs[name], max_num_batched_tokens=32, tensor_parallel_size=size)
    assert engine.runner.model.config.num_kv_heads == 1 or name.startswith("gemma4")
    _engine_logits_match(engine, tiny_model_dirs[name])
    _engine_greedy_matches(engine, tiny_model_dirs[name])
    engine.close()


def test_kv_heads_are_replicated_only_where_a_rank_can_hold_one_of_them_whole(tiny_model_dirs):
    """Not where a rank's q, k and v are fused a head at a time (GPT-BigCode's multi_query), nor where the ranks'
    count is no multiple of the heads'."""
    with pytest.raises(ValueError, match=r"num_kv_heads \(1\) \(its KV heads are not shared by more ranks: its q, k "
                                         r"and v fused a head at a time\)"):
        _engine(tiny_model_dirs["gpt-bigcode"], 2)
    config = dataclasses.replace(load_model_config(tiny_model_dirs["llama-gqa-untied"]), num_heads=6, num_kv_heads=2,
                                 intermediate_size=162)
    with pytest.raises(ValueError, match=r"must divide the model's num_kv_heads \(2\) or be a multiple of it"):
        check_shardable(config, 3, "cpu")


def _anonymous_bytes(pid: int) -> int:
    """The private memory process `pid` has resident (its weights, in a rank's process)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["RssAnon"].split()[0]) * 1024


def test_a_split_model_gives_every_ranks_memory_back_and_computes_as_before_once_resumed(tmp_path):
    """vLLM's sleep and wake_up, SGLang's release and resume of memory, on a split model: every rank's weights
    leave its process (rank 1's private memory drops by its share), the shared KV pool's pages leave the
    host, and once resumed every rank has read its share again."""
    model_dir = make_demo_model(tmp_path / "wide", seed=3, **{**SHAPE, "hidden_size": 256, "vocab_size": 4096})
    engine = _engine(model_dir, max_num_batched_tokens=64)
    before = run_all(engine, {"a": (PROMPT, GREEDY)})["a"]
    (rank_1,) = engine.runner.rank_workers.pids
    held = _anonymous_bytes(rank_1)
    weights = unique_storages(engine.runner.model.parameters())
    held_by_rank_0 = sum(resident_bytes(w) for w in weights)
    released = release(engine, ["weights", "kv_cache"])
    rank_1_released = held - _anonymous_bytes(rank_1)
    assert rank_1_released > 4 * 2**20  # its embeddings, LM head and half the layers: 4 MiB each and more
    assert released >= held_by_rank_0 + rank_1_released  # and the KV pool's pages
    assert sum(resident_bytes(w) for w in weights) == 0
    assert sum(resident_bytes(t) for t in engine.kv_pool_tensors()) == 0
    with pytest.raises(ValueError, match="weights are released"):
        engine.add_request("asleep", PROMPT, GREEDY)
    resume(engine, ["weights", "kv_cache"])
    after = run_all(engine, {"b": (PROMPT, GREEDY)})["b"]
    assert after.token_ids == before.token_ids and after.num_cached_tokens == 0
    assert_pool_clean(engine)
    engine.close()


def test_the_ranks_processes_and_pool_file_go_with_the_engine(tiny_model_dirs):
    engine = _engine(tiny_model_dirs["llama-gqa-untied"])
    pids = engine.runner.rank_workers.pids
    assert len(pids) == 1 and all(is_alive(pid) for pid in pids)
    # Every rank maps the pool by now: its file is gone already, so none is left behind whatever happens.
    assert _pool_files(os.getpid()) == []
    assert greedy_outputs(engine, PROMPTS, 8).keys() == PROMPTS.keys()
    engine.close()
    assert wait_all_dead(pids, 0.0) == []


def test_the_ranks_stop_when_their_engine_is_killed(tiny_model_dirs):
    script = ("import sys, time; from engine.config import EngineConfig; from engine.llm_engine import LLMEngine; "
              f"e = LLMEngine(EngineConfig(model={str(tiny_model_dirs['llama-gqa-untied'])!r}, num_kv_blocks=64, "
              "tensor_parallel_size=2)); print(*e.runner.rank_workers.pids, flush=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert pids and all(is_alive(pid) for pid in pids)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    assert wait_all_dead(pids, 15.0) == [], "a rank outlived its engine's process"


def test_a_rank_that_dies_fails_the_next_step_instead_of_hanging(tiny_model_dirs):
    engine = _engine(tiny_model_dirs["llama-gqa-untied"])
    os.kill(engine.runner.rank_workers.pids[0], signal.SIGKILL)
    assert wait_all_dead(engine.runner.rank_workers.pids, 15.0) == []
    engine.add_request("r", list(range(3, 20)), SamplingParams(max_tokens=4))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 has exited"):
        engine.step()
    assert time.monotonic() - start < 5
    engine.close()


@pytest.mark.usefixtures("forked_ranks")  # (the tests above check the ranks' own processes)
def test_weights_read_again_reach_every_rank(tiny_model_dirs, tmp_path):
    """update_weights on a split model: each rank reads its share of the new checkpoint (one whose every
    tensor differs), and the tokens are those of an unsplit engine on it."""
    served = tiny_model_dirs["llama-gqa-untied"]
    later = tmp_path / "later"
    later.mkdir()
    for file in served.iterdir():
        (later / file.name).write_bytes(file.read_bytes())
    generator = torch.Generator().manual_seed(0)
    tensors = {name: t + 0.05 * torch.randn(t.shape, generator=generator)
               for name, t in load_file(served / "model.safetensors").items()}
    save_file(tensors, later / "model.safetensors", metadata={"format": "pt"})
    engine = _engine(served)
    before = greedy_outputs(engine, PROMPTS, 12)
    assert engine.update_weights(later) is not None
    after = greedy_outputs(engine, PROMPTS, 12)
    engine.close()
    unsplit = _engine(later, tensor_parallel_size=1)
    assert after == greedy_outputs(unsplit, PROMPTS, 12) != before


@pytest.mark.usefixtures("forked_ranks")  # (the tests above check the ranks' own processes)
@pytest.mark.parametrize("options", [
    {"speculative": SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})},
    {"kv_cache_dtype": "fp8"},
    {"enable_prefix_caching": False, "max_num_batched_tokens": 16},
], ids=["ngram-drafts", "fp8-pages", "no-prefix-cache-chunks-of-16"])
def test_a_split_model_decodes_as_the_unsplit_one_with_the_engines_other_settings(tiny_model_dirs, options):
    """Drafts checked in one step, pages of one byte a number, small chunks: the greedy tokens and the prompt's
    logprobs of the same settings unsplit."""
    model_dir = tiny_model_dirs["llama-gqa-untied"]
    prompt = list(range(3, 40)) * 2  # repeats: n-gram drafts are proposed, and some are right
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    tokens, prompt_logprobs = {}, {}
    for size in (1, 2):
        engine = _engine(model_dir, size, **options)
        outputs = list(engine.generate([prompt], params))  # the first holds the prompt's logprobs
        tokens[size], prompt_logprobs[size] = outputs[-1].token_ids, outputs[0].prompt_logprobs
        engine.close()
    assert tokens[2] == tokens[1]
    for split, unsplit in zip(prompt_logprobs[2][1:], prompt_logprobs[1][1:], strict=True):
        assert split.keys() == unsplit.keys()
        assert max(abs(split[t] - unsplit[t]) for t in split) < 1e-4


@pytest.mark.usefixtures("forked_ranks")  # (the tests above check the ranks' own processes)
def test_the_vocabulary_is_split_across_the_ranks_even_where_it_does_not_divide(tmp_path):
    """Each rank holds a run of the embeddings' and LM head's token rows (vLLM's VocabParallelEmbedding and
    ParallelLMHead), the last padded: 1021 tokens in two runs of 511. The greedy tokens, and the logprobs of a
    prompt long enough that its logits come in several calls each rank makes in turn, are the unsplit model's."""
    model_dir = make_demo_model(tmp_path / "odd-vocabulary", hidden_size=64, num_layers=2, num_heads=4,
                                num_kv_heads=2, vocab_size=1021, seed=4)
    prompt = [(7 * j) % 1000 + 3 for j in range(600)] + [1019, 1020]  # the last tokens: the padded run's
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    tokens, prompt_logprobs = {}, {}
    for size in (1, 2):
        engine = _engine(model_dir, size, max_num_batched_tokens=1024)
        if size == 2:
            assert engine.runner.model.embed.shape[0] == engine.runner.model.lm_head.shape[0] == 511
        outputs = list(engine.generate([prompt], params))
        tokens[size], prompt_logprobs[size] = outputs[-1].token_ids, outputs[0].prompt_logprobs
        engine.close()
    assert tokens[2] == tokens[1]
    assert len(prompt_logprobs[2]) == len(prompt) == len(prompt_logprobs[1])
    for split, unsplit in zip(prompt_logprobs[2][1:], prompt_logprobs[1][1:], strict=True):
        assert split.keys() == unsplit.keys()
        assert max(abs(split[t] - unsplit[t]) for t in split) < 1e-4


@pytest.mark.usefixtures("forked_ranks")  # (the tests above check the ranks' own processes)
def test_an_eagle_head_sharing_the_targets_embeddings_does_not_draft_for_a_split_target(tiny_demo_model, tmp_path):
    head = eagle_head(tiny_demo_model, tmp_path / "head", "eagle")
    with pytest.raises(ValueError, match="does not draft for a target split across tensor-parallel ranks"):
        _engine(tiny_demo_model, speculative=SpeculativeConfig(num_speculative_tokens=2, method="eagle",
                                                               model=str(head)))


def test_baton_generate_splits_the_model_as_asked(tiny_demo_model):
    def generate(*flags: str) -> dict:
        done = subprocess.run([sys.executable, "-m", "cli", "generate", "--model", str(tiny_demo_model),
                               "--prompt-ids", "5,6,7,8,9", "--max-tokens", "12", "--json", *flags],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.splitlines()[-1])

    assert generate("-tp", "2") == generate()
    done = subprocess.run([sys.executable, "-m", "cli", "generate", "--model", str(tiny_demo_model),
                           "--prompt-ids", "5,6", "--tensor-parallel-size", "3"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "tensor_parallel_size 3 must divide the model's num_heads (4)" in done.stderr


def test_a_step_rank_0_fails_part_way_stops_the_ranks_and_every_later_step(tiny_model_dirs):
    """Its other ranks wait for sums rank 0 will not make, and their next step's would pair with the wrong
    ones: they are killed at once, and each later step is refused with the reason."""
    engine = _engine(tiny_model_dirs["llama-gqa-untied"])
    pids = engine.runner.rank_workers.pids
    second = engine.runner.model.layers[1]

    def failing(*args, **kwargs):
        raise RuntimeError("injected")

    second.forward = failing
    engine.add_request("r", list(range(3, 20)), SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert wait_all_dead(pids, 5.0) == []
    del second.forward
    with pytest.raises(RankError, match=r"a step failed part way \(RuntimeError: injected\).*start the engine again"):
        engine.step()
    engine.close()
