"""`baton generate` as a user runs it: a real subprocess."""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

BATON = [sys.executable, str(Path(__file__).resolve().parents[2] / "cli.py")]


def baton(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*BATON, *args], capture_output=True, text=True, timeout=120)


def test_generate_json_matches_the_engine(tiny_demo_model):
    result = baton("generate", "--model", str(tiny_demo_model), "--prompt-ids", "5,6,7,8", "--max-tokens", "6",
                   "--ignore-eos", "--json", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert set(out) >= {"prompt_token_ids", "token_ids", "text", "finish_reason"}
    engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=16))
    expected = list(engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)))[-1]
    assert out["prompt_token_ids"] == [5, 6, 7, 8]
    assert out["token_ids"] == expected.token_ids
    assert out["finish_reason"] == "length"
    assert out["text"] == engine.tokenizer.decode(expected.token_ids)


def test_generate_text_prompt_streams_text(tiny_demo_model):
    result = baton("generate", "--model", str(tiny_demo_model), "--prompt", "hello there", "--max-tokens", "4")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_errors_are_one_line_and_exit_2(tmp_path):
    result = baton("generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "not found" in result.stderr
    result = baton("generate", "--prompt", "x", "--temperature", "-1")
    assert result.returncode == 2 and "temperature" in result.stderr
    result = baton("generate", "--prompt", "x", "--kv-cache-dtype", "int4")
    assert result.returncode == 2 and "--kv-cache-dtype: invalid choice: 'int4'" in result.stderr
    result = baton("generate", "--prompt", "x", "--speculative-config", '{"method": "ngram"}')
    assert result.returncode == 2 and "num_speculative_tokens" in result.stderr
    result = baton("generate", "--prompt", "x", "--device", "tpu")
    assert result.returncode == 2 and "--device must be auto, cpu, cuda or cuda:N, got 'tpu'" in result.stderr
    result = baton("generate", "--prompt", "x", "--device", "cuda:64")
    assert result.returncode == 2 and "--device cuda:64: torch sees" in result.stderr


def test_generate_with_drafts_fp8_pages_and_overrides(tiny_demo_model):
    """vLLM's --speculative-config makes the same tokens; --kv-cache-dtype fp8 runs on one-byte pages;
    --hf-overrides changes the model (its RoPE here, and so its tokens)."""
    def tokens(*more: str) -> list[int]:
        result = baton("generate", "--model", str(tiny_demo_model), "--prompt-ids", "5,6,7,8,5,6,7,8,5,6,7",
                       "--max-tokens", "12", "--ignore-eos", "--json", *more)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["token_ids"]

    runs = [(), ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'),
            ("--kv-cache-dtype", "fp8"), ("--hf-overrides", '{"rope_scaling": {"rope_type": "linear", "factor": 4.0}}')]
    with ThreadPoolExecutor(len(runs)) as pool:  # each process mostly imports torch: side by side
        plain, drafted, fp8, overridden = pool.map(lambda more: tokens(*more), runs)
    assert drafted == plain
    assert len(fp8) == 12
    assert overridden != plain


def test_generate_leaves_the_engine_and_torch_out_of_the_collectors_sight(tiny_demo_model):
    """Alive until exit, they are frozen once the engine is built (gc.freeze), so that Python's exit does not
    walk them: about 0.4 s of every `baton generate` here."""
    probe = ("import gc, sys; import cli; "
             f"code = cli.main(['generate', '--model', {str(tiny_demo_model)!r}, '--prompt-ids', '5,6,7', "
             "'--max-tokens', '2', '--json', '--device', 'cpu']); "
             "print(code, gc.get_freeze_count(), file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[2])
    code, frozen = result.stderr.split()[-2:]
    assert code == "0"
    assert int(frozen) > 100_000  # torch's modules alone hold more
