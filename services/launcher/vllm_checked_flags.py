"""vLLM's flags (and SGLang's) that `baton up` takes from a `vllm serve` or `sglang.launch_server` command
line without passing them on: those that ask for what Baton always does, and those whose only value
here is the one Baton runs with (checked, a clear refusal otherwise, rather than argparse's
"unrecognized arguments" for a whole command line)."""
from __future__ import annotations

import argparse

# Asked for, and what Baton does anyway.
ALWAYS = (
    ("--enforce-eager", "every step runs eagerly here: no CUDA graphs are captured yet"),
    ("--trust-remote-code", "only Baton's own model code runs, never a checkpoint's"),
    ("--enable-chunked-prefill", "prompts are always computed in chunks of --max-num-batched-tokens"),
    ("--enable-prefix-caching", "on unless --no-enable-prefix-caching"),
    ("--enable-prompt-tokens-details", "usage always gives prompt_tokens_details.cached_tokens"),
    ("--disable-log-requests", "requests are logged only with --enable-log-requests"),
    ("--disable-log-stats", "no stats are logged periodically: they are at each service's /metrics"),
    ("--enable-lora", "LoRA adapters are served wherever --lora-modules names them or runtime loading is on"),
    ("--enable-sleep-mode", "/sleep and /wake_up are always served"),
    ("--disable-fastapi-docs", "the HTTP API serves no /docs nor /openapi.json"),
    ("--enable-metrics", "SGLang's: every service serves Prometheus metrics at its /metrics"),
    ("--enable-cache-report", "SGLang's: usage always gives prompt_tokens_details.cached_tokens"),
    ("--disable-cuda-graph", "SGLang's: no CUDA graphs are captured yet"),
)
# vLLM's parallelism within one engine besides tensor parallelism (vllm_flags.py passes that on): a Baton
# worker runs its layers in one pipeline stage, and scales out.
SCALE_OUT = "scale out with --prefill N and --decode M instead (workers spread over the GPUs)"
ONE_STAGE = (("--pipeline-parallel-size", "-pp", "--pp-size"),
              ("--data-parallel-size", "-dp", "--dp-size"))  # vLLM's names, then SGLang's
BLOCK_SIZE = 16  # the tokens a KV page holds: the block hashes the router, workers and kvstore nodes share
LOAD_FORMATS = ("auto", "safetensors")


def add_checked_vllm_flags(up: argparse.ArgumentParser) -> None:
    group = up.add_argument_group("vLLM's flags for what Baton always does, or must be as given here")
    for flag, does in ALWAYS:
        group.add_argument(flag, action="store_true", help=f"taken: {does}")
    for names in ONE_STAGE:
        group.add_argument(*names, type=int, metavar="1", help=f"1 only: {SCALE_OUT}")
    group.add_argument("--block-size", "--page-size", type=int, metavar=str(BLOCK_SIZE),
                       help=f"{BLOCK_SIZE} only: the tokens of a KV page, which the block hashes shared by the "
                            f"router, the workers and the kvstore nodes are of")
    group.add_argument("--load-format", choices=LOAD_FORMATS, help="weights are read from safetensors files")


def check_vllm_flags(args: argparse.Namespace) -> None:
    """ValueError, naming the flag and what to do instead, for a value Baton does not run with."""
    for flag, *_ in ONE_STAGE:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value is not None and value != 1:
            raise ValueError(f"{flag} {value}: each Baton worker runs its model's layers in one stage; {SCALE_OUT}")
    if args.block_size is not None and args.block_size != BLOCK_SIZE:
        raise ValueError(f"--block-size {args.block_size}: Baton's KV pages hold {BLOCK_SIZE} tokens (the block "
                         f"hashes its router, workers and kvstore nodes share are of {BLOCK_SIZE})")
