"""ShareGPT conversations as `baton bench`'s workload, sampled as vLLM's benchmark samples them."""
from __future__ import annotations

import json

import numpy as np
import pytest

from loadgen.sharegpt import load_tokenizer, read_conversations, sharegpt_workload
from tests.loadgen.test_bench_command import bench

REPLY = "Once upon a time there was a small red fox who lived by the river and sang every night."


def write_sharegpt(path, num_good: int) -> None:
    conversations = [{"id": str(i), "conversations": [{"from": "human", "value": f"Tell me story number {i}, please."},
                                                      {"from": "gpt", "value": REPLY}]} for i in range(num_good)]
    conversations += [{"id": "short", "conversations": [{"from": "human", "value": "Hi"},
                                                        {"from": "gpt", "value": REPLY}]},
                      {"id": "one-turn", "conversations": [{"from": "human", "value": "Only a question?"}]},
                      {"id": "no-turns"}]
    path.write_text(json.dumps(conversations))


def test_pairs_are_sampled_with_their_reply_lengths_and_short_ones_left_out(tiny_demo_model, tmp_path):
    write_sharegpt(tmp_path / "sharegpt.json", 5)
    pairs = read_conversations(tmp_path / "sharegpt.json")
    assert len(pairs) == 6  # the one-turn and turnless conversations are not pairs
    tokenizer = load_tokenizer(tiny_demo_model)
    specs = sharegpt_workload(pairs, tokenizer, 5, "ids", np.random.default_rng(0))
    reply_len = len(tokenizer.encode(REPLY, add_special_tokens=False).ids)
    assert all(s.output_len == reply_len for s in specs)
    encoded = [tokenizer.encode(prompt).ids for prompt, _ in pairs[:5]]  # the five long enough, each once
    assert sorted(s.prompt for s in specs) == sorted(encoded) and all(s.prompt_len == len(s.prompt) for s in specs)
    assert [s.index for s in specs] == list(range(5))
    assert sharegpt_workload(pairs, tokenizer, 5, "ids", np.random.default_rng(0)) == specs  # seeded
    with pytest.raises(ValueError, match="5 conversations within the lengths"):
        sharegpt_workload(pairs, tokenizer, 6, "ids", np.random.default_rng(0))  # "Hi" is too short


def test_bench_runs_sharegpt_conversations_on_a_mesh(mesh, tiny_demo_model, tmp_path):
    write_sharegpt(tmp_path / "sharegpt.json", 6)
    done = bench("--base-url", f"{mesh.gateway.base_url}/v1", "--dataset-name", "sharegpt", "--dataset-path",
                 str(tmp_path / "sharegpt.json"), "--tokenizer", str(tiny_demo_model), "--num-requests", "4",
                 "--concurrency", "2", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    tokenizer = load_tokenizer(tiny_demo_model)
    [run] = doc["runs"]
    assert (run["completed"], doc["workload"]["dataset"]) == (4, "sharegpt")
    assert run["total_output_tokens"] == 4 * len(tokenizer.encode(REPLY, add_special_tokens=False).ids)
    assert bench("--base-url", f"{mesh.gateway.base_url}/v1", "--dataset-name", "sharegpt").returncode == 2
