"""The gateway's settings: one frozen dataclass, each value checked in `__post_init__`.

`GatewayConfig.from_args` builds it from CLI flags and `BATON_*` environment variables, in one
place: config_flags.py, which holds every flag and the variable it falls back to.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import DEFAULT_MAX_LOGPROBS
from services.common.limits import DEFAULT_MAX_MESSAGE_BYTES
from services.common.logprobs_flag import check_max_logprobs
from services.common.settings import (
    DEFAULT_SHUTDOWN_GRACE_S,
    ConfigError,
    check_bind,
    check_limits,
    check_model_dir,
    check_positive,
)
from services.common.tokenizer_dir_flag import tokenizer_dir
from services.gateway.chat_serving import ChatServing
from services.gateway.generation_defaults import GenerationDefaults
from services.gateway.http_app import DEFAULT_MAX_BODY_BYTES
from services.gateway.http_serving import HttpServing
from services.gateway.idle_sleep import IdleSleepConfig
from services.gateway.reasoning_config import ReasoningConfig
from services.gateway.reasoning_parsers import HARMONY, PARSERS as REASONING_PARSERS
from services.gateway.reply_options import ReplyOptions
from services.gateway.request_log import ENV_LOG_REQUESTS, LEVELS as LOG_LEVELS
from services.gateway.tool_parsers import PARSERS
from services.tokenizer.chat_template import check_template_kwargs

# The variables the checks' messages point to; every other flag's is in config_flags.py.
ENV_HOST = "BATON_GATEWAY_HOST"
ENV_TOKENIZER = "BATON_TOKENIZER_ADDRESS"
ENV_PREFILL = "BATON_PREFILL_ADDRESSES"
ENV_DECODE = "BATON_DECODE_ADDRESSES"
ENV_LOCAL_PREFILL = "BATON_LOCAL_PREFILL_MAX_TOKENS"
ENV_API_KEY = "BATON_API_KEY"

# prefix: where the prompt's prefix is cached, against load (needs --redis); load: least
# queued work; random: uniformly (a baseline for benchmarks).
ROUTING_POLICIES = ("prefix", "load", "random")
# Dynamo's default for prefilling on the decode worker is prompts under 1000 tokens; a
# model with a short context gets a proportionally shorter limit (an eighth of it).
LOCAL_PREFILL_AUTO = -1
# The tokenizer service's own limit for encoding inline, on its event loop: shorter prompts
# cost less to encode than a round trip to it, so the gateway encodes them itself.
DEFAULT_LOCAL_TOKENIZE_MAX_CHARS = 2048
# How often --prefill/--decode host names are resolved again, so a pool follows its replicas as a
# compose service or a Kubernetes headless service is scaled.
DEFAULT_RESOLVE_WORKERS_S = 5.0
DEFAULT_RESPONSES_TTL_S = 3600.0  # how long the Responses API keeps a stored response
DEFAULT_OVERLAP_WEIGHT = 4.0  # router.py's RouterConfig says why 4
# preopened: a prompt goes to its prefill worker on a call kept open ahead of it where one
# is (services/gateway/kept_calls.py); new: on a new call each.
PREFILL_CALLS = ("preopened", "new")

# "auto": prefill picks by where the decode worker is (shared memory on the same host,
# else the gRPC page stream); the others force one, for tests and benchmarks.
KV_TRANSPORTS = ("auto", "shared-memory", "grpc-stream", "cuda-ipc")

DEFAULT_HTTP_PORT = 8000


@dataclass(frozen=True)
class GatewayConfig:
    model_dir: Path
    tokenizer_addresses: tuple[str, ...]
    prefill_addresses: tuple[str, ...]
    decode_addresses: tuple[str, ...]
    # The names clients may send (vLLM's --served-model-name a b): responses give the first. (): the
    # model directory's name.
    served_model_names: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 0  # the gRPC API; 0: any free port, printed on the listening line
    http_port: int = DEFAULT_HTTP_PORT  # 0: any free port, printed on the http listening line
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_model_len: int | None = None
    hf_overrides: dict[str, Any] | None = None  # config.json keys replaced (vLLM's --hf-overrides)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_s: float = DEFAULT_SHUTDOWN_GRACE_S  # after SIGTERM, how long in-flight calls may finish
    kv_transport: str = "auto"  # how prefill sends KV to decode; see KV_TRANSPORTS
    redis_url: str = ""  # the prefix index and instance registry; "": route by load only
    routing: str = "prefix"  # see ROUTING_POLICIES; prefix without --redis routes by load
    overlap_weight: float = DEFAULT_OVERLAP_WEIGHT  # router: a block to compute against one already queued
    local_prefill_max_tokens: int = LOCAL_PREFILL_AUTO  # decode prefills prompts this short itself; 0: never
    local_tokenize_max_chars: int = DEFAULT_LOCAL_TOKENIZE_MAX_CHARS  # encoded here, not by the tokenizer service
    is_colocated: bool = False  # no prefill workers: decode prefills every prompt itself
    prefill_calls: str = "preopened"  # see PREFILL_CALLS
    otlp_endpoint: str = ""  # OTLP gRPC collector for trace spans; "": as the OTEL_* variables say
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # (): no key asked for; repr: not in a log line
    max_num_requests: int = 0  # requests (choices) held at once, more get 429; 0: no limit
    # Tokens a decode worker puts in each chunk it sends at least, but the first and the last (vLLM's
    # and SGLang's --stream-interval): fewer messages and SSE events per token; 1: every step's.
    stream_interval: int = 1
    tool_call_parser: str | None = None  # tool_parsers.py: reads the model's own tool calls; None: "auto" refused
    reasoning_parser: str | None = None  # reasoning_parsers.py: reads a reasoning model's thinking; None: all content
    # vLLM's --reasoning-config: the thinking's tags a thinking_token_budget is kept by (reasoning_config.py).
    reasoning_config: ReasoningConfig | None = None
    resolve_workers_s: float = DEFAULT_RESOLVE_WORKERS_S  # workers' host names resolved again this often; 0: once
    # Prefill and decode workers also found in the Redis instance registry (those serving this model),
    # as often as names are resolved: pools scaled by starting and stopping workers anywhere.
    discover_workers: bool = False
    # Responses API responses are stored this long (in Redis with --redis, else in the process); 0: none are.
    responses_ttl_s: float = DEFAULT_RESPONSES_TTL_S
    chat_template: str | None = None  # Jinja source replacing the model's templates (--chat-template)
    # A chat request may bring its own template (`chat_template`), run by the tokenizer service: Jinja
    # in a sandbox, yet nothing bounds its time or memory, so only for clients the operator trusts.
    trust_request_chat_template: bool = False
    # Sampling defaults for what a request leaves out (generation_defaults.py); from_args reads them.
    generation_defaults: GenerationDefaults = GenerationDefaults()
    http_serving: HttpServing = HttpServing()  # the HTTP API's CORS, TLS, root path, access log (http_serving.py)
    chat_serving: ChatServing = ChatServing()  # the reply's role, tools left out (chat_serving.py)
    # LoRA adapters the workers serve beside the model, (name, path): a request naming one as its
    # model is computed with it (the path is what its model card shows).
    lora_modules: tuple[tuple[str, str], ...] = ()
    # /v1/load_lora_adapter and /v1/unload_lora_adapter served (lora_updates.py): off, as in vLLM.
    allow_runtime_lora_updating: bool = False
    # Generation requests logged as they arrive and end, at this level (request_log.py); None: none are.
    log_requests_level: int | None = None
    # Chat template variables a request's chat_template_kwargs leaves out (vLLM's --default-chat-template-kwargs).
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Messages' content as text or as text parts to the template; auto: as it reads it (content_format.py).
    chat_template_content_format: str = "auto"
    reply_options: ReplyOptions = ReplyOptions()  # usage forced, timing, token ids (reply_options.py)
    sleep_when_idle: IdleSleepConfig = IdleSleepConfig()  # vLLM's --sleep-idle-ttl (idle_sleep.py)
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info served (vLLM's flag)
    enable_prompt_embeds: bool = False  # completions' prompt_embeds taken (vLLM's flag; off, as vLLM's)
    allowed_local_media_path: Path | None = None  # file:// images are read under it (vLLM's flag); None: none are
    enable_mm_embeds: bool = False  # chat's image_embeds parts taken (vLLM's flag; off, as vLLM's)
    # The hosts http(s) images are fetched from (vLLM's --allowed-media-domains); None: any.
    allowed_media_domains: frozenset[str] | None = None
    limit_images: int | None = None  # a prompt's most images (vLLM's --limit-mm-per-prompt); None: any
    limit_videos: int | None = None  # its videos' (0 where images are)
    mm_processor_cache_gb: float = 4.0  # processed images kept, GiB of pixels (vLLM's flag and default); 0: none
    mm_processor_kwargs: dict = field(default_factory=dict)  # the image processor's settings over the model's
    media_io_kwargs: dict = field(default_factory=dict)  # how media are read (vLLM's --media-io-kwargs), by modality
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # top logprobs a request may ask for per token (vLLM's); -1: any
    max_log_len: int | None = None  # logged texts cut to this many characters (ids: this many); None: the level's
    tokenizer_dir: Path | None = None  # where the tokenizer is, when not in model_dir (vLLM's --tokenizer)

    def __post_init__(self):
        object.__setattr__(self, "tokenizer_dir", tokenizer_dir(self.tokenizer_dir))
        object.__setattr__(self, "model_dir", check_model_dir(
            self.model_dir, "config.json" if self.tokenizer_dir is not None else "tokenizer.json"))
        if not self.served_model_names:
            object.__setattr__(self, "served_model_names", (self.model_dir.resolve().name,))
        if any(not name or name != name.strip() for name in self.served_model_names):
            raise ConfigError(f"--served-model-name: names must be non-empty, without surrounding spaces, got "
                              f"{list(self.served_model_names)}")
        check_bind(self.host, self.port, ENV_HOST)
        if not 0 <= self.http_port <= 65535:
            raise ConfigError(f"--http-port must be in [0, 65535], got {self.http_port}")
        if not self.tokenizer_addresses:
            raise ConfigError(f"no tokenizer: pass --tokenizer HOST:PORT[,HOST:PORT...] or set ${ENV_TOKENIZER}")
        if self.discover_workers and not self.redis_url:
            raise ConfigError("--discover-workers finds workers in the instance registry: pass --redis URL too")
        _check_layout(self.prefill_addresses, self.is_colocated, self.local_prefill_max_tokens, self.discover_workers)
        if not self.decode_addresses and not self.discover_workers:
            raise ConfigError(f"no decode workers: pass --decode HOST:PORT[,HOST:PORT...] or set ${ENV_DECODE}, "
                              f"or --discover-workers to find them in the instance registry")
        for flag, addresses in (("--prefill", self.prefill_addresses), ("--decode", self.decode_addresses),
                                ("--tokenizer", self.tokenizer_addresses)):
            for address in addresses:
                _check_address(flag, address)
        check_positive("--max-body-bytes", self.max_body_bytes)
        if self.local_prefill_max_tokens < LOCAL_PREFILL_AUTO:
            raise ConfigError(f"--local-prefill-max-tokens must be >= 0 (or -1: auto), got "
                              f"{self.local_prefill_max_tokens}")
        if not self.mm_processor_cache_gb >= 0:
            raise ConfigError(f"--mm-processor-cache-gb must be >= 0, got {self.mm_processor_cache_gb}")
        if self.local_tokenize_max_chars < 0:
            raise ConfigError(f"--local-tokenize-max-chars must be >= 0, got {self.local_tokenize_max_chars}")
        if self.routing not in ROUTING_POLICIES:
            raise ConfigError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing!r}")
        if self.overlap_weight < 0:
            raise ConfigError(f"--router-overlap-weight must be >= 0, got {self.overlap_weight}")
        if self.prefill_calls not in PREFILL_CALLS:
            raise ConfigError(f"--prefill-calls must be one of {', '.join(PREFILL_CALLS)}, got {self.prefill_calls!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ConfigError(f"--tool-call-parser must be one of {', '.join(PARSERS)}, got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, "
                              f"got {self.reasoning_parser!r}")
        if self.reply_options.output_token_metrics and self.reasoning_parser is None:
            raise ConfigError("--enable-per-request-output-token-metrics tells thinking from answer: it needs "
                              "--reasoning-parser")
        if self.tool_call_parser == "openai" and self.reasoning_parser != HARMONY:
            raise ConfigError(f"--tool-call-parser openai reads gpt-oss's harmony messages, which --reasoning-parser "
                              f"{HARMONY} takes apart: it cannot go with {self.reasoning_parser!r}")
        if self.reasoning_config is not None:
            self.reasoning_config.tags(self.reasoning_parser)  # the two name the same parser
        if self.kv_transport not in KV_TRANSPORTS:
            raise ConfigError(f"--kv-transport must be one of {', '.join(KV_TRANSPORTS)}, got {self.kv_transport!r}")
        check_limits(self.max_model_len, self.max_message_bytes, self.grace_s)
        if self.log_requests_level is not None and self.log_requests_level not in LOG_LEVELS:
            raise ConfigError(f"${ENV_LOG_REQUESTS} must be one of {', '.join(map(str, LOG_LEVELS))}, got "
                              f"{self.log_requests_level}")
        try:
            check_template_kwargs(self.default_chat_template_kwargs)
        except ValueError as e:
            raise ConfigError(f"--default-chat-template-kwargs: {e}") from None
        check_max_logprobs(self.max_logprobs)
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ConfigError(f"--max-log-len must be >= 0, got {self.max_log_len}")
        if self.max_num_requests < 0:
            raise ConfigError(f"--max-num-requests must be >= 0 (0: no limit), got {self.max_num_requests}")
        if not 1 <= self.stream_interval < 2**31:
            raise ConfigError(f"--stream-interval must be in [1, 2^31), got {self.stream_interval}")
        if not self.resolve_workers_s >= 0:  # NaN too
            raise ConfigError(f"--resolve-workers-s must be >= 0 (0: only at start), got {self.resolve_workers_s}")
        if not self.responses_ttl_s >= 0:
            raise ConfigError(f"--responses-ttl-s must be >= 0 (0: store none), got {self.responses_ttl_s}")
        if self.discover_workers and not self.resolve_workers_s > 0:
            raise ConfigError("--discover-workers looks for workers every --resolve-workers-s: it must be > 0")
        clash = set(self.served_model_names) & {name for name, _ in self.lora_modules}
        if clash:
            raise ConfigError(f"--lora-modules: {sorted(clash)} already name the model (--served-model-name)")
        for key in self.api_keys:
            # A header value is trimmed, so a key with spaces or none at all could never match.
            if not key or key != "".join(key.split()):
                raise ConfigError(f"--api-key (or ${ENV_API_KEY}) must be non-empty, without spaces")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def served_model_name(self) -> str:
        """The name responses give."""
        return self.served_model_names[0]

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> GatewayConfig:
        """From flags and variables: config_flags.config_from_args, which says how."""
        from services.gateway.config_flags import config_from_args  # not at the top: it imports this module

        return config_from_args(argv, env)


def _check_layout(prefill_addresses: tuple[str, ...], is_colocated: bool, local_prefill_max_tokens: int,
                  discover_workers: bool) -> None:
    """Prefill workers (given, or discovered), or --colocated (which prefills everything on decode), never both."""
    if is_colocated:
        if prefill_addresses:
            raise ConfigError(f"--colocated runs no prefill workers: drop --prefill (and ${ENV_PREFILL})")
        if local_prefill_max_tokens != LOCAL_PREFILL_AUTO:
            raise ConfigError(f"--colocated prefills every prompt on the decode workers: drop "
                              f"--local-prefill-max-tokens (and ${ENV_LOCAL_PREFILL})")
    elif not prefill_addresses and not discover_workers:
        raise ConfigError(f"no prefill workers: pass --prefill HOST:PORT[,HOST:PORT...] or set ${ENV_PREFILL}, "
                          f"--discover-workers to find them in the instance registry, or --colocated to prefill "
                          f"every prompt on the decode workers")


def _check_address(flag: str, address: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ConfigError(f"{flag}: {address!r} is not HOST:PORT")


def local_prefill_limit(configured: int, max_model_len: int | None) -> int:
    """The flag's value, or for auto Dynamo's 1000 tokens, shortened for a short context."""
    if configured != LOCAL_PREFILL_AUTO:
        return configured
    return min(1000, (max_model_len or 8000) // 8)
