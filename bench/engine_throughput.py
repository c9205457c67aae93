"""Baton against `transformers.generate`: offline throughput, batch-1 decode, per-step CPU overhead.

    .venv/bin/python bench/engine_throughput.py [--models 7m,160m,qwen3.5-40m] [--quick]
        [--max-num-batched-tokens 2048] [--sweep 512,1024,4096] [--threads N] [--device cuda]

Our machines are small and shared, so absolute tokens/s mean little: every
figure is a ratio against transformers measured on the same model in the same
process (on `--device`, both sides). The last line of output is one JSON object with all the figures.
qwen3.5-40m is a hybrid (engine/models/qwen3_next.py: six Gated DeltaNet layers, two of full attention),
random weights made by transformers: its figures are keyed "hybrid_" in the last line.
On a busy machine `--threads 1` is steadier: torch's default of one thread
per core stalls whenever a neighbour takes a core, and `--repeats 3` keeps
the best of three alternating Baton/transformers runs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.demo_model import make_demo_model
from engine.demo_model_dir import is_demo_model_dir
from engine.kv_pool import num_state_blocks
from engine.llm_engine import LLMEngine
from engine.model_config_loader import load_model_config
from engine.sampling_params import SamplingParams

MODEL_CACHE = Path(__file__).resolve().parent.parent / ".baton" / "bench-models"
# 7m: 7.1M parameters with 2 KV heads (4 would give 7.4M); 160m: 158.4M with 8 KV heads (4: 153.8M).
MODELS = {
    "7m": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 8192},
    "160m": {"hidden_size": 1024, "num_layers": 8, "num_heads": 16, "num_kv_heads": 8, "vocab_size": 32000},
    "qwen3.5-40m": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 2, "vocab_size": 8192},
}
# Models made by transformers (the demo model's tokenizer beside them): Qwen3_5TextConfig's settings past MODELS'.
HYBRID_MODELS = {"qwen3.5-40m": dict(head_dim=64, intermediate_size=1536, linear_num_key_heads=4,
                                     linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                                     layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)}
BLOCK_SIZE = 16
HF_BATCH_SIZE = 16
PAD_ID = 0  # any id works: padded positions are masked out
BATCH1_PROMPT_LEN, BATCH1_OUTPUT_LEN = 128, 256


def log(msg: str) -> None:
    # Flushed: progress must show while the 160m phases run for minutes. The load
    # average says how much a neighbour may have skewed the phase that just ended.
    print(f"{msg}  [load {os.getloadavg()[0]:.2f}]", flush=True)


def ensure_model(name: str) -> Path:
    """The cached model directory, made on first use (in a temp dir, then renamed)."""
    target = MODEL_CACHE / name
    if not is_demo_model_dir(target):
        MODEL_CACHE.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=MODEL_CACHE))
        make_demo_model(tmp, **MODELS[name])
        if name in HYBRID_MODELS:
            make_hybrid_model(tmp, name)
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        os.rename(tmp, target)
    return target


def make_hybrid_model(path: Path, name: str) -> None:
    """Qwen3.5's text model of MODELS' and HYBRID_MODELS' sizes, random, over the demo model's weights and config."""
    import transformers  # a test-only dependency

    dims = MODELS[name]
    config = transformers.Qwen3_5TextConfig(
        hidden_size=dims["hidden_size"], num_hidden_layers=dims["num_layers"], num_attention_heads=dims["num_heads"],
        num_key_value_heads=dims["num_kv_heads"], vocab_size=dims["vocab_size"], **HYBRID_MODELS[name],
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


# --- workload -------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int


def make_workload(n: int, vocab: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
            for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# --- Baton ------------------------------------------------------------------------------


@dataclass
class StepRecord:
    num_seqs: int
    num_tokens: int
    seconds: float
    phases: dict[str, float]  # seconds in each instrumented call during this step

    @property
    def overhead(self) -> float:
        """Step time outside the model: everything but the forward and the lm_head."""
        return self.seconds - self.phases["forward"] - self.phases["logits"]


class StepProfiler:
    """Times each engine.step() and the calls inside it, by wrapping bound methods
    of this one engine instance (the engine code is untouched). One per engine:
    a second would wrap the first's wrappers."""

    PHASES = ("schedule", "prepare", "forward", "attention", "logits", "sample", "postprocess")

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.records: list[StepRecord] = []
        self._phases = dict.fromkeys(self.PHASES, 0.0)
        self._batch = None
        runner, sched, model = engine.runner, engine.scheduler, engine.runner.model
        for owner, attr, phase in ((sched, "schedule", "schedule"), (runner, "_prepare", "prepare"),
                                   (model, "forward", "forward"), (model, "compute_logits", "logits"),
                                   (runner, "sampler", "sample"), (sched, "postprocess", "postprocess")):
            if hasattr(owner, attr):  # a private name (_prepare) may move; its phase then reads 0
                setattr(owner, attr, self._timed(getattr(owner, attr), phase))
        # Attention is timed inside the forward (a part of it, not an addition):
        # every module that holds the kernel bundle gets a copy with timed attention.
        for module in model.modules():
            if (ops := getattr(module, "kernels", None)) is not None:
                module.kernels = ops._replace(prefill_attention=self._timed(ops.prefill_attention, "attention"),
                                              decode_attention=self._timed(ops.decode_attention, "attention"))

    def _timed(self, fn, phase: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            self._phases[phase] += time.perf_counter() - start
            if phase == "schedule":
                self._batch = result
            return result
        return timed

    def step(self):
        self._phases = dict.fromkeys(self.PHASES, 0.0)
        start = time.perf_counter()
        outputs = self.engine.step()
        seconds = time.perf_counter() - start
        self.records.append(StepRecord(len(self._batch), self._batch.num_tokens, seconds, self._phases))
        return outputs


def make_engine(model_dir: Path, workloads: list[list[Request]], max_num_batched_tokens: int,
                device: str) -> LLMEngine:
    # Room for every request of a workload at once (no preemption), plus the warm-up and batch-1 requests.
    states = num_state_blocks(load_model_config(model_dir), BLOCK_SIZE, torch.float32)
    need = max(sum(math.ceil((len(r.prompt) + r.output_len) / BLOCK_SIZE) + states for r in w) for w in workloads)
    extra = 2 * (math.ceil((BATCH1_PROMPT_LEN + BATCH1_OUTPUT_LEN) / BLOCK_SIZE) + states)
    config = EngineConfig(model=str(model_dir), dtype="float32", device=device, block_size=BLOCK_SIZE,
                          num_kv_blocks=need + extra, max_num_seqs=max(64, len(workloads[0])),
                          max_num_batched_tokens=max_num_batched_tokens)
    engine = LLMEngine(config)
    # Warm-up: the first steps pay for allocator growth and lazy initialisation.
    list(engine.generate([[1] * 40, [2] * 70], greedy(8)))
    return engine


def run_baton(profiler: StepProfiler, workload: list[Request]) -> tuple[float, int, list[StepRecord]]:
    """Adds every request at once and steps until done. Returns wall seconds, tokens, step records."""
    engine = profiler.engine
    profiler.records = []
    start = time.perf_counter()
    for i, r in enumerate(workload):
        engine.add_request(f"bench-{i}", r.prompt, greedy(r.output_len))
    num_tokens = 0
    while engine.has_unfinished_requests():
        num_tokens += sum(len(out.new_token_ids) for out in profiler.step())
    wall = time.perf_counter() - start
    assert num_tokens == sum(r.output_len for r in workload), "a request stopped early"
    return wall, num_tokens, profiler.records


def baton_decode_only(profiler: StepProfiler, prompt: list[int], n: int, request_id: str):
    """One request alone: its tokens and seconds from first to last token, and its decode step records."""
    engine = profiler.engine
    profiler.records = []
    engine.add_request(request_id, prompt, greedy(n))
    tokens, stamps = [], []
    while engine.has_unfinished_requests():
        for out in profiler.step():
            tokens += out.new_token_ids
            stamps += [time.perf_counter()] * len(out.new_token_ids)
    return tokens, stamps[-1] - stamps[0], profiler.records[1:]  # record 0 is the prefill


# --- transformers ---------------------------------------------------------------------


def load_hf(model_dir: Path, device: str):
    from transformers import AutoModelForCausalLM  # a test-only dependency

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    # No eos: every sequence runs to max_new_tokens, like ignore_eos on the Baton side.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_ID
    return model


def hf_generate(model, prompts: list[list[int]], max_new: int, streamer=None) -> torch.Tensor:
    """Greedy generation for one left-padded static batch; returns the new tokens [B, max_new]."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                             do_sample=False, streamer=streamer)
    assert out.shape[1] == width + max_new, "transformers stopped early"
    return out[:, width:]


def run_hf(model, workload: list[Request]) -> tuple[float, int]:
    """Static batches in arrival order, each run to its longest output.
    Returns wall seconds and useful tokens (tokens past a request's own length are waste)."""
    start = time.perf_counter()
    for i in range(0, len(workload), HF_BATCH_SIZE):
        batch = workload[i:i + HF_BATCH_SIZE]
        last = hf_generate(model, [r.prompt for r in batch], max(r.output_len for r in batch))
    last.cpu()  # waits for a device's queued work
    return time.perf_counter() - start, sum(r.output_len for r in workload)


class TokenClock:
    """A transformers streamer that stamps each put; the first put is the prompt."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.tokens: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        if self.stamps or self.tokens:
            self.tokens += value.reshape(-1).tolist()
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


# --- one model ------------------------------------------------------------------------


def step_summary(records: list[StepRecord]) -> dict:
    """Mean microseconds per step: each instrumented phase, the whole step, and the CPU overhead."""
    def mean_us(seconds: list[float]) -> float:
        return round(sum(seconds) / max(1, len(seconds)) * 1e6, 1)
    summary = {p: mean_us([r.phases[p] for r in records]) for p in StepProfiler.PHASES}
    return summary | {"step": mean_us([r.seconds for r in records]), "overhead": mean_us([r.overhead for r in records])}


def bench_throughput(name: str, model_dir: Path, workloads: list[list[Request]], profiler: StepProfiler, hf,
                     args) -> dict:
    """Each repeat runs its own workload (same distribution, next seed: no prefix-cache hits) on
    Baton, then transformers; sides alternate so a noisy neighbour hurts both, and the best run counts."""
    best_tps = best_hf_tps = 0.0
    ratios = []
    for rep, workload in enumerate(workloads):
        wall, tokens, recs = run_baton(profiler, workload)
        if tokens / wall > best_tps:
            best_tps, best_recs = tokens / wall, recs
        log(f"[{name}] Baton: {tokens} tokens in {wall:.2f}s = {tokens / wall:.0f} tok/s over {len(recs)} steps "
            f"(max_num_batched_tokens={args.max_num_batched_tokens}, repeat {rep})")
        hf_wall, hf_tokens = run_hf(hf, workload)
        best_hf_tps = max(best_hf_tps, hf_tokens / hf_wall)
        ratios.append(round((tokens / wall) / (hf_tokens / hf_wall), 3))
        log(f"[{name}] transformers, static batches of {HF_BATCH_SIZE}: {hf_tokens} useful tokens in {hf_wall:.2f}s "
            f"= {hf_tokens / hf_wall:.0f} tok/s; this repeat {ratios[-1]:.2f}x")
    ratio = best_tps / best_hf_tps
    steps = step_summary(best_recs)
    decode_steps = step_summary([r for r in best_recs if r.num_tokens == r.num_seqs])
    log(f"[{name}] throughput, best of {len(workloads)}: Baton {best_tps:.0f} tok/s, transformers {best_hf_tps:.0f} "
        f"tok/s, Baton/transformers {ratio:.2f}x")
    log(f"[{name}] Baton mean us per step: {steps}; CPU overhead (step - forward - lm_head) {steps['overhead']} "
        f"us/step, {decode_steps['overhead']} on decode-only steps ({len(best_recs)} steps)")
    sweep = {args.max_num_batched_tokens: round(best_tps, 1)}
    for mnbt in args.sweep:
        w, t, _ = run_baton(StepProfiler(make_engine(model_dir, workloads, mnbt, args.device)), workloads[0])
        sweep[mnbt] = round(t / w, 1)
        log(f"[{name}] sweep: max_num_batched_tokens={mnbt}: {sweep[mnbt]:.0f} tok/s")
    if args.sweep:
        log(f"[{name}] sweep: best max_num_batched_tokens={max(sweep, key=sweep.get)}")
    return {"baton_tokens_per_s": round(best_tps, 1), "transformers_tokens_per_s": round(best_hf_tps, 1),
            "ratio_vs_transformers": round(ratio, 3), "ratio_per_repeat": ratios,
            "cpu_overhead_us_per_step": steps["overhead"],
            "decode_cpu_overhead_us_per_step": decode_steps["overhead"], "step_us": steps,
            "decode_step_us": decode_steps, "num_steps": len(best_recs), "sweep_tokens_per_s": sweep}


def bench_batch1(name: str, vocab: int, profiler: StepProfiler, hf, args) -> dict:
    """Decode of one request, timed from its first token to its last on both sides (prefill excluded).
    Sides alternate and the best repeat counts, so a noisy neighbour hurts both alike."""
    rng = random.Random(f"batch1-{args.seed}")  # a stream of its own, apart from the workloads' seeds
    n_out = 32 if args.quick else BATCH1_OUTPUT_LEN
    best_baton = best_hf = math.inf
    for rep in range(args.batch1_repeats):
        prompt = [rng.randrange(vocab) for _ in range(BATCH1_PROMPT_LEN)]  # fresh: no prefix-cache hit
        tokens, seconds, recs = baton_decode_only(profiler, prompt, n_out, f"batch1-{rep}")
        if seconds < best_baton:
            best_baton, best_recs = seconds, recs
        clock = TokenClock()
        hf_generate(hf, [prompt], n_out, streamer=clock)
        best_hf = min(best_hf, clock.stamps[-1] - clock.stamps[1])
        agree = next((i for i, (a, b) in enumerate(zip(tokens, clock.tokens)) if a != b), len(tokens))
    baton_tps, hf_tps = (n_out - 1) / best_baton, (n_out - 1) / best_hf
    steps = step_summary(best_recs)
    log(f"[{name}] batch-1 decode ({BATCH1_PROMPT_LEN}-token prompt, {n_out} tokens, first to last token, best of "
        f"{args.batch1_repeats}): Baton {baton_tps:.0f} tok/s, transformers {hf_tps:.0f} tok/s, "
        f"{baton_tps / hf_tps:.2f}x; greedy tokens identical for the first {agree}/{n_out}")
    log(f"[{name}] batch-1 Baton mean us per decode step: {steps}")
    return {"batch1_baton_tokens_per_s": round(baton_tps, 1), "batch1_transformers_tokens_per_s": round(hf_tps, 1),
            "batch1_ratio_vs_transformers": round(baton_tps / hf_tps, 3),
            "batch1_cpu_overhead_us_per_step": steps["overhead"], "batch1_greedy_agreement": agree}


def bench_model(name: str, args) -> dict:
    model_dir = ensure_model(name)
    vocab = MODELS[name]["vocab_size"]
    n, prompt_range, output_range = (16, (32, 256), (8, 64)) if args.quick else (64, (32, 512), (16, 256))
    workloads = [make_workload(n, vocab, prompt_range, output_range, seed=args.seed + rep)
                 for rep in range(args.repeats)]
    workload = workloads[0]
    profiler = StepProfiler(make_engine(model_dir, workloads, args.max_num_batched_tokens, args.device))
    num_params = sum(p.numel() for p in profiler.engine.runner.model.parameters())
    kernels = profiler.engine.runner.kernels.name
    log(f"[{name}] {num_params / 1e6:.1f}M parameters, {MODELS[name]}, Baton kernels {kernels!r}; {n} requests, "
        f"{sum(len(r.prompt) for r in workload)} prompt tokens, {sum(r.output_len for r in workload)} output tokens")
    hf = load_hf(model_dir, args.device)
    hf_generate(hf, [[1] * 40, [2] * 70], 8)  # warm-up
    return ({"params": num_params, "kernels": kernels}
            | bench_throughput(name, model_dir, workloads, profiler, hf, args)
            | bench_batch1(name, vocab, profiler, hf, args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="7m,160m", help="comma-separated subset of: " + ",".join(MODELS))
    parser.add_argument("--quick", action="store_true", help="16 short requests and 32-token batch-1: a smoke run")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--sweep", default="", help="also run Baton at these max_num_batched_tokens, e.g. 512,4096")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=1, help="throughput runs per side, alternating; best counts")
    parser.add_argument("--batch1-repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where both sides run: cpu, cuda or cuda:N")
    args = parser.parse_args()
    args.sweep = [int(x) for x in args.sweep.split(",") if x]
    names = [m for m in args.models.split(",") if m]
    if unknown := set(names) - set(MODELS):
        parser.error(f"unknown models {sorted(unknown)}; choose from {sorted(MODELS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()}")

    results = {name: bench_model(name, args) for name in names}
    summary = {"load_average": [round(x, 2) for x in os.getloadavg()], "threads": torch.get_num_threads(),
               "quick": args.quick, "max_num_batched_tokens": args.max_num_batched_tokens, "device": args.device}
    # The key names: unprefixed keys are the 7m model, "small_" ones the 160m model.
    for name, prefix in (("7m", ""), ("160m", "small_"), ("qwen3.5-40m", "hybrid_")):
        r = results.get(name, {})
        for key in ("ratio_vs_transformers", "baton_tokens_per_s", "transformers_tokens_per_s",
                    "cpu_overhead_us_per_step", "batch1_ratio_vs_transformers", "batch1_baton_tokens_per_s",
                    "batch1_transformers_tokens_per_s", "batch1_cpu_overhead_us_per_step", "params"):
            summary[prefix + key] = r.get(key)
    summary["details"] = results
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
