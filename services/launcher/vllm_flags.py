"""vLLM's serving flags that `baton up` takes as `vllm serve` takes them (and by SGLang's names for
some: `--max-running-requests`, `--chunked-prefill-size`, `--random-seed`, `--disable-radix-cache`,
`--max-total-tokens`, `--log-requests`) and hands to the services they belong to, so that the common
flags of a vLLM or SGLang command line start a mesh as they are: the gateway's model names, parsers,
request log and HTTP serving, the workers' batch and KV pool sizes. Each goes before the service's
own --KIND-args, which may set it otherwise; each service checks its value as it starts (a bad one
stops `baton up` with the service's reason)."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.launcher.vllm_checked_flags import BLOCK_SIZE


@dataclass(frozen=True)
class PassedFlag:
    flag: str
    kinds: tuple[str, ...]  # the services it goes to
    help: str
    type: Callable[[str], object] = str
    many: bool = False  # takes one value or more
    is_switch: bool = False  # takes none
    to: str = ""  # the services' own name for it, where it differs
    aliases: tuple[str, ...] = ()  # other names baton up takes it by (SGLang's)

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    def argv(self, value) -> tuple[str, ...]:
        name = self.to or self.flag
        if self.is_switch:
            return (name,) if value else ()
        if value is None:
            return ()
        return (name, *map(str, value)) if self.many else (name, str(value))


def _path(value: str) -> str:
    """A file's path as the services find it: they run in another directory."""
    return str(Path(value).expanduser().resolve())


def _pages_of(tokens: str) -> int:
    return -(-int(tokens) // BLOCK_SIZE)


GATEWAY, WORKERS, PREFILL = ("gateway",), ("prefill", "decode"), ("prefill",)
EVERY = (*GATEWAY, *WORKERS)
PASSED_FLAGS = (
    PassedFlag("--served-model-name", GATEWAY, "the model names clients may send, the first the one answers give",
               many=True),
    PassedFlag("--tool-call-parser", GATEWAY, "the model's tool-call syntax: tool_choice auto served"),
    PassedFlag("--enable-auto-tool-choice", GATEWAY, "as vLLM's: with --tool-call-parser", is_switch=True),
    PassedFlag("--reasoning-parser", GATEWAY, "the model's thinking apart from its answer"),
    PassedFlag("--reasoning-config", GATEWAY, "JSON: the thinking's tags, for thinking_token_budget"),
    PassedFlag("--enable-log-requests", GATEWAY, "log each request as it arrives and ends", is_switch=True),
    PassedFlag("--enable-log-outputs", GATEWAY, "... with its texts", is_switch=True),
    PassedFlag("--log-requests", GATEWAY, "SGLang's: log requests at --log-requests-level", is_switch=True),
    PassedFlag("--log-requests-level", GATEWAY, "SGLang's: how much a request's lines say, 0 to 3", type=int),
    PassedFlag("--root-path", GATEWAY, "the path prefix a proxy serves the HTTP API under and strips"),
    PassedFlag("--disable-uvicorn-access-log", GATEWAY, "no log line per HTTP request", is_switch=True),
    PassedFlag("--return-tokens-as-token-ids", GATEWAY, 'logprobs name tokens "token_id:N"', is_switch=True),
    PassedFlag("--enable-per-request-metrics", GATEWAY, "replies carry their timing, `metrics`", is_switch=True),
    PassedFlag("--per-request-spec-decode-metrics", ("gateway", "decode"),
               "replies carry their speculative steps: summary or detailed"),
    PassedFlag("--enable-per-request-output-token-metrics", GATEWAY, "replies time their thinking and answer apart",
               is_switch=True),
    PassedFlag("--sleep-idle-ttl", GATEWAY, "idle this many seconds, the mesh sleeps; it wakes for the next request",
               type=float),
    PassedFlag("--enable-force-include-usage", GATEWAY, "every stream ends with its usage", is_switch=True),
    PassedFlag("--enable-tokenizer-info-endpoint", GATEWAY, "GET /tokenizer_info served", is_switch=True),
    PassedFlag("--enable-prompt-embeds", GATEWAY, "completions take prompts given as embeddings", is_switch=True),
    PassedFlag("--allowed-local-media-path", GATEWAY, "a chat's file:// images are read under this directory"),
    PassedFlag("--allowed-media-domains", GATEWAY, "http(s) images are fetched only from these hosts", many=True),
    PassedFlag("--enable-mm-embeds", ("gateway", "prefill", "decode"),
               "chat messages may give images as their encoder's rows", is_switch=True),
    PassedFlag("--mm-processor-cache-gb", GATEWAY, "GiB of images kept as the image processor made them", type=float),
    PassedFlag("--mm-processor-kwargs", GATEWAY, "JSON: the image processor's settings over the model's"),
    PassedFlag("--media-io-kwargs", GATEWAY, "JSON: how media are read (a video's frames sampled)"),
    PassedFlag("--limit-mm-per-prompt", ("gateway", "prefill", "decode"),
               "JSON: a prompt's most images and videos; 0 images serves a multimodal model's text only"),
    PassedFlag("--response-role", GATEWAY, "the role of a chat reply's message"),
    PassedFlag("--exclude-tools-when-tool-choice-none", GATEWAY, "tools left out of the prompt for tool_choice none",
               is_switch=True),
    PassedFlag("--trust-request-chat-template", GATEWAY, "requests may bring their own chat template",
               is_switch=True),
    PassedFlag("--default-chat-template-kwargs", GATEWAY, "JSON: chat template variables requests leave out"),
    PassedFlag("--chat-template-content-format", GATEWAY, "messages' content to the template as text or as parts"),
    PassedFlag("--generation-config", GATEWAY, "where sampling defaults come from (auto, vllm, a folder)"),
    PassedFlag("--override-generation-config", GATEWAY, "JSON: sampling defaults over --generation-config's"),
    PassedFlag("--uvicorn-log-level", GATEWAY, "how much the HTTP server logs"),
    PassedFlag("--allowed-origins", GATEWAY, "CORS: a JSON list of origins"),
    PassedFlag("--allowed-methods", GATEWAY, "CORS: a JSON list of methods"),
    PassedFlag("--allowed-headers", GATEWAY, "CORS: a JSON list of headers"),
    PassedFlag("--allow-credentials", GATEWAY, "CORS: cookies and HTTP authentication", is_switch=True),
    PassedFlag("--ssl-keyfile", GATEWAY, "serve the HTTP API over TLS with this private key (PEM)", type=_path),
    PassedFlag("--ssl-certfile", GATEWAY, "... and this certificate chain (PEM)", type=_path),
    PassedFlag("--ssl-ca-certs", GATEWAY, "the CA certificates client certificates are checked by", type=_path),
    PassedFlag("--ssl-cert-reqs", GATEWAY, "client certificates: 0 not asked for, 1 checked if shown, 2 required",
               type=int),
    PassedFlag("--max-num-seqs", WORKERS, "most requests in a worker's batch", type=int,
               aliases=("--max-running-requests",)),
    PassedFlag("--max-num-batched-tokens", PREFILL, "a prefill step's tokens; longer prompts are chunked", type=int,
               aliases=("--chunked-prefill-size",)),
    PassedFlag("--long-prefill-token-threshold", WORKERS, "no prompt computes more than N tokens a step", type=int),
    PassedFlag("--kv-cache-memory-bytes", WORKERS, "each worker's KV pool in bytes, e.g. 8G"),
    PassedFlag("--num-gpu-blocks-override", WORKERS, "each worker's KV pool in pages", type=int, to="--kv-blocks"),
    PassedFlag("--max-total-tokens", WORKERS, "SGLang's: each worker's KV pool in tokens (pages of 16)",
               type=_pages_of, to="--kv-blocks"),
    PassedFlag("--no-enable-prefix-caching", PREFILL, "compute every prompt whole, reusing no cached prefix",
               is_switch=True, to="--no-prefix-caching", aliases=("--disable-radix-cache",)),
    PassedFlag("--seed", WORKERS, "seed each worker's random generator at start", type=int,
               aliases=("--random-seed",)),
    PassedFlag("--max-loras", WORKERS, "most LoRA adapters one step's batch computes with", type=int),
    PassedFlag("--max-lora-rank", WORKERS, "refuse LoRA adapters of a higher rank", type=int),
    PassedFlag("--max-cpu-loras", WORKERS, "most LoRA adapters kept in memory", type=int),
    PassedFlag("--kv-cache-dtype", WORKERS, "what the KV pages hold (auto, or an fp8 kind)"),
    PassedFlag("--max-logprobs", EVERY, "the most top logprobs a request may ask for per token; -1: any", type=int),
    PassedFlag("--logprobs-mode", WORKERS, "what reported logprobs are of (raw_logprobs, processed_logprobs, ...)"),
    PassedFlag("--tensor-parallel-size", WORKERS, "each worker's model split across N processes on its host (the "
               "models README.md's Tensor parallelism lists, on the CPU so far)", type=int,
               aliases=("-tp", "--tp-size", "--tp")),
)


def add_vllm_flags(up: argparse.ArgumentParser) -> None:
    group = up.add_argument_group("vLLM's serving flags, passed to the services they belong to")
    for passed in PASSED_FLAGS:
        where = " and ".join(passed.kinds)
        names = (passed.flag, *passed.aliases)
        if passed.is_switch:
            group.add_argument(*names, dest=passed.dest, action="store_true", help=f"{passed.help} ({where})")
        else:
            group.add_argument(*names, dest=passed.dest, type=passed.type, nargs="+" if passed.many else None,
                               help=f"{passed.help} ({where})")


def with_vllm_flags(args: argparse.Namespace, flags: dict[str, tuple[str, ...]]) -> None:
    """`flags` (by service kind) with the vLLM flags `args` gave put first."""
    for passed in reversed(PASSED_FLAGS):  # so that they come in PASSED_FLAGS' order
        argv = passed.argv(getattr(args, passed.dest))
        for kind in passed.kinds if argv else ():
            flags[kind] = (*argv, *flags[kind])
