"""The `baton` command.

`baton generate` runs one prompt through an in-process engine and streams the
text (or prints one JSON object); `baton up` runs every service as a local process
and prints where the API listens; `baton bench` measures any OpenAI-compatible
server under load; `baton make-demo-model` writes the random-weight
demo model. Every failure is one line on stderr and exit status 2 (`baton up`:
1 when a service it runs fails); set BATON_DEBUG=1 to see the traceback instead.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from typing import NoReturn, Sequence

from engine.config import DTYPES, KV_CACHE_DTYPES  # no torch: a bad value is refused before the slow imports

EXIT_USAGE = 2


class UsageError(Exception):
    """A bad argument or input, reported as one line without a traceback."""


class _Parser(argparse.ArgumentParser):
    # argparse prints the whole usage block on error; one line is the contract.
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Output piped into `head` and closed: not an error. Point stdout at
        # devnull so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # noqa: BLE001 - the CLI's contract: one line, never a traceback
        if os.environ.get("BATON_DEBUG"):
            raise
        # Bad input explains itself; anything else keeps its type as a clue.
        message = str(exc) if isinstance(exc, (UsageError, ValueError, OSError)) else f"{type(exc).__name__}: {exc}"
        print(f"baton: error: {' '.join(message.split())}", file=sys.stderr)
        return EXIT_USAGE


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="baton", description="Baton: disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate text for one prompt in-process",
                         description="Generate a completion for one prompt with an in-process engine. "
                                     "Sampling is greedy unless --temperature is above 0.")
    gen.add_argument("--model", metavar="DIR",
                     help="Hugging Face model directory (default: the demo model, made on first use "
                          "in $BATON_DEMO_MODEL or ~/.cache/baton/demo-model)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="prompt text, encoded with the model's tokenizer (bos added)")
    prompt.add_argument("--prompt-ids", metavar="IDS", type=_token_ids, help="prompt token ids, e.g. 1,2,3")
    gen.add_argument("--max-tokens", type=int, default=32, metavar="N", help="tokens to generate at most (default 32)")
    # Greedy by default (unlike vLLM's API default of 1.0): a command run twice should print the same text.
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default 0)")
    gen.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1 = off)")
    gen.add_argument("--top-k", type=int, default=0, metavar="K", help="sample from the K likeliest (default 0 = off)")
    gen.add_argument("--min-p", type=float, default=0.0, metavar="P",
                     help="drop tokens below P x the top probability (default 0 = off)")
    gen.add_argument("--seed", type=int, metavar="S", help="per-request sampling seed")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    gen.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype (default float32)")
    gen.add_argument("--device", default=None, help="where it computes: cpu, cuda, cuda:N or auto (a GPU where "
                                                    "torch sees one) (default $BATON_DEVICE, else auto)")
    gen.add_argument("--lora", metavar="DIR", help="generate with this LoRA adapter (a PEFT adapter directory) "
                                                  "on the model")
    gen.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", metavar="DTYPE",
                     help="the KV pages' dtype: auto (the compute dtype), or fp8, fp8_e4m3, fp8_e5m2 (one byte a "
                          "number), as vLLM's")
    gen.add_argument("--speculative-config", metavar="JSON",
                     help='speculative decoding, as vLLM\'s: {"method": "ngram", "num_speculative_tokens": 4}, '
                          '{"method": "draft_model", "model": DIR, "num_speculative_tokens": 3}, an EAGLE head\'s '
                          '({"method": "eagle3" or "eagle", "model": DIR, ...}) or the checkpoint\'s MTP layer\'s '
                          '({"method": "mtp", "num_speculative_tokens": 1}): the same tokens, in fewer steps where the '
                          "drafts are right")
    gen.add_argument("--hf-overrides", metavar="JSON", help="config.json keys replaced, as vLLM's --hf-overrides")
    gen.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                     help="split the model's heads and MLP width across N processes on this host, as vLLM's "
                          "(the models README.md's Tensor parallelism lists, on the CPU) (default 1)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (prompt_token_ids, token_ids, text, finish_reason) "
                          "instead of streaming text")
    gen.set_defaults(run=_generate)

    from services.launcher.command import DESCRIPTION as UP_DESCRIPTION, add_up_arguments

    up = sub.add_parser("up", help="run every service as a local process (the whole mesh on this host)",
                        description=UP_DESCRIPTION)
    add_up_arguments(up)
    up.set_defaults(run=_up)

    from loadgen.command import DESCRIPTION as BENCH_DESCRIPTION, add_bench_arguments

    bench = sub.add_parser("bench", help="measure any OpenAI-compatible server under load",
                           description=BENCH_DESCRIPTION)
    add_bench_arguments(bench)
    bench.set_defaults(run=_bench)

    from loadgen.run_batch import DESCRIPTION as RUN_BATCH_DESCRIPTION, add_run_batch_arguments

    batch = sub.add_parser("run-batch", help="run a file of requests in OpenAI's batch format against a server "
                                              "(or a mesh of its own, with --model)",
                           description=RUN_BATCH_DESCRIPTION)
    add_run_batch_arguments(batch)
    batch.set_defaults(run=_run_batch)

    from services.common.kv_event_subscriber import DESCRIPTION as KV_EVENTS_DESCRIPTION, add_kv_events_arguments

    events = sub.add_parser("kv-events", help="print a worker's KV events as JSON lines, as a KV-aware router reads "
                                               "them", description=KV_EVENTS_DESCRIPTION)
    add_kv_events_arguments(events)
    events.set_defaults(run=_kv_events)

    demo = sub.add_parser("make-demo-model", help="write a tiny random-weight Llama model directory",
                          description="Write a random-weight LlamaForCausalLM directory with a locally "
                                      "trained byte-level BPE tokenizer.")
    demo.add_argument("dir", metavar="DIR", help="output directory (created; same-named files are overwritten)")
    demo.add_argument("--hidden-size", type=int, default=256)
    demo.add_argument("--num-layers", type=int, default=4)
    demo.add_argument("--num-heads", type=int, default=4)
    demo.add_argument("--num-kv-heads", type=int, default=2)
    demo.add_argument("--intermediate-size", type=int, help="default: 8/3 x hidden size, rounded up to 64")
    demo.add_argument("--vocab-size", type=int, default=8192)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the stored weights")
    demo.set_defaults(run=_make_demo_model)
    return parser


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected one or more non-negative token ids, got {text!r}")
    return ids


def _kv_events(args: argparse.Namespace) -> int:
    from services.common.kv_event_subscriber import kv_events_command

    return kv_events_command(args)


def _make_demo_model(args: argparse.Namespace) -> int:
    from engine.demo_model import make_demo_model

    start = time.perf_counter()
    path = make_demo_model(
        args.dir, hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads, intermediate_size=args.intermediate_size,
        vocab_size=args.vocab_size, seed=args.seed, dtype=args.dtype,
    )
    print(f"wrote demo model to {path} in {time.perf_counter() - start:.1f}s")
    return 0


def _generate(args: argparse.Namespace) -> int:
    # Before torch loads OpenMP: its threads spin briefly, as the workers' do (a split model's rank 0 would
    # otherwise keep the cores its other ranks need spinning).
    import services.common.openmp_env  # noqa: F401

    # Imported here so `baton --help` and argument errors stay instant.
    from engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos,
            lora_name="lora" if args.lora else None,
        )
    except ValueError as exc:  # checked before the model loads, so a typo fails fast
        raise UsageError(str(exc)) from None

    model_dir = args.model or _demo_model_dir()
    if not os.path.isdir(model_dir):
        raise UsageError(f"model directory not found: {model_dir}")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise UsageError(f"not a model directory (no config.json): {model_dir}")

    from tokenizers import Tokenizer

    # The tokenizer is loaded before the engine, so a bad prompt fails before
    # the slow part and the KV pool can be sized to this one request.
    tokenizer_path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(tokenizer_path):
        raise UsageError(f"no tokenizer.json in {model_dir}")
    tokenizer = Tokenizer.from_file(tokenizer_path)
    if args.prompt is not None:
        prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=True).ids
    else:
        prompt_ids = args.prompt_ids

    from services.common.device_flag import ENV_DEVICE, check_device_name, resolved_device
    from services.common.settings import ConfigError, hf_overrides
    from services.common.speculative_flag import speculative_config

    device = args.device or os.environ.get(ENV_DEVICE) or "auto"
    try:  # what can be checked without torch first: a typo fails in a tenth of a second, not two
        check_device_name(device)
        speculative = speculative_config(args.speculative_config, "--speculative-config")
        overrides = hf_overrides(args.hf_overrides)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    try:
        config = EngineConfig(model=model_dir, dtype=args.dtype, device=resolved_device(device),
                              show_progress=sys.stderr.isatty(),
                              lora_modules=(("lora", args.lora),) if args.lora else (),
                              kv_cache_dtype=args.kv_cache_dtype, speculative=speculative, hf_overrides=overrides,
                              tensor_parallel_size=args.tensor_parallel_size)
    except (ValueError, ConfigError) as exc:
        raise UsageError(str(exc)) from None
    # One request needs only its own pages; a pool carved from a fraction of
    # free memory takes seconds to zero on a CPU. One spare block of slack.
    num_tokens = len(prompt_ids) + args.max_tokens
    from engine.checkpoint import read_model_config

    num_tokens = min(num_tokens, read_model_config(model_dir, config.hf_overrides).get("max_position_embeddings",
                                                                                         num_tokens))
    num_blocks = -(-num_tokens // config.block_size) + 1
    from engine.lora import LoRAError

    try:
        engine = LLMEngine(dataclasses.replace(config, num_kv_blocks=num_blocks))
    except (LoRAError, ValueError) as exc:  # ValueError: a model the config cannot split (--tensor-parallel-size)
        raise UsageError(str(exc)) from None
    # The engine and torch's modules live until exit: out of the collector's sight, as a worker's start-up heap is
    # (services/common/entrypoint.py), Python's exit no longer walks them (0.48-0.57 s of it here, 0.15-0.19 frozen).
    gc.freeze()

    start = time.perf_counter()
    from engine.streaming_text import StreamingText

    text = StreamingText(tokenizer, sys.stdout if not args.json else None)
    last = None
    for last in engine.generate([prompt_ids], params):
        text.update(last.token_ids)
    text.finish()
    elapsed = time.perf_counter() - start

    token_ids = list(last.token_ids) if last is not None else []
    finish_reason = last.finish_reason if last is not None else None
    if args.json:
        print(json.dumps({"prompt_token_ids": list(prompt_ids), "token_ids": token_ids,
                          "text": text.text, "finish_reason": finish_reason}))
    elif sys.stderr.isatty():
        rate = len(token_ids) / elapsed if elapsed > 0 else 0.0
        print(f"[{len(token_ids)} tokens, finish_reason={finish_reason}, {rate:.1f} tokens/s]", file=sys.stderr)
    return 0


def _up(args: argparse.Namespace) -> int:
    from pathlib import Path

    from services.launcher.command import run_up

    model_dir = Path(args.model).expanduser().resolve() if args.model else Path(_demo_model_dir())
    if not model_dir.is_dir():
        raise UsageError(f"model directory not found: {model_dir}")
    return run_up(args, model_dir)


def _bench(args: argparse.Namespace) -> int:
    from loadgen.command import run_bench

    return run_bench(args)


def _run_batch(args: argparse.Namespace) -> int:
    from loadgen.run_batch import run_batch_command

    return run_batch_command(args)


def _demo_model_dir() -> str:
    from engine.demo_model_dir import default_demo_model_dir, is_demo_model_dir

    if is_demo_model_dir(default_demo_model_dir()):  # made: its maker (and torch) not imported
        return str(default_demo_model_dir())
    print(f"baton: making the demo model in {default_demo_model_dir()} (first run only)", file=sys.stderr)
    from engine.demo_model import ensure_demo_model

    return str(ensure_demo_model())


if __name__ == "__main__":
    sys.exit(main())
