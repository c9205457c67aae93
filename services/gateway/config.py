"""The gateway's settings: one frozen dataclass, built from CLI flags and `BATON_*`
environment variables in one place (`from_args`).

`--port` is the public gRPC API's (with health and reflection, like every service);
`--http-port` the OpenAI HTTP API's. Worker addresses are comma-separated lists; a
host name that resolves to several addresses (a compose service with replicas)
stands for all of them. `--colocated` takes no prefill workers: the decode workers
prefill every prompt themselves (the layout disaggregation is measured against).
`--api-key` (or `$BATON_API_KEY`, better: not in the process list) makes both APIs ask
for a key (api_keys.py).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.limits import DEFAULT_MAX_MESSAGE_BYTES
from services.common.settings import (
    DEFAULT_SHUTDOWN_GRACE_S,
    ConfigError,
    add_bind_flags,
    add_limit_flags,
    add_lora_flag,
    add_tracing_flag,
    check_bind,
    check_limits,
    check_model_dir,
    check_positive,
    env_float,
    env_int,
    hf_overrides,
    lora_modules,
    model_arg,
    new_parser,
)
from services.gateway.generation_defaults import SOURCES_HELP, GenerationDefaults
from services.gateway.http_app import DEFAULT_MAX_BODY_BYTES
from services.gateway.http_serving import HttpServing
from services.gateway.reasoning_parsers import HARMONY, PARSERS as REASONING_PARSERS
from services.gateway.tool_parsers import PARSERS
from services.tokenizer.template_setting import add_chat_template_flag, chat_template_source

ENV_HOST = "BATON_GATEWAY_HOST"
ENV_PORT = "BATON_GATEWAY_PORT"
ENV_HTTP_PORT = "BATON_GATEWAY_HTTP_PORT"
ENV_TOKENIZER = "BATON_TOKENIZER_ADDRESS"
ENV_PREFILL = "BATON_PREFILL_ADDRESSES"
ENV_DECODE = "BATON_DECODE_ADDRESSES"
ENV_SERVED_MODEL_NAME = "BATON_SERVED_MODEL_NAME"
ENV_MAX_BODY_BYTES = "BATON_GATEWAY_MAX_BODY_BYTES"
ENV_KV_TRANSPORT = "BATON_KV_TRANSPORT"
ENV_REDIS = "BATON_REDIS_URL"
ENV_ROUTING = "BATON_ROUTING"
# prefix: where the prompt's prefix is cached, against load (needs --redis); load: least
# queued work; random: uniformly (a baseline for benchmarks).
ROUTING_POLICIES = ("prefix", "load", "random")
ENV_LOCAL_PREFILL = "BATON_LOCAL_PREFILL_MAX_TOKENS"
# Dynamo's default for prefilling on the decode worker is prompts under 1000 tokens; a
# model with a short context gets a proportionally shorter limit (an eighth of it).
LOCAL_PREFILL_AUTO = -1
ENV_OVERLAP_WEIGHT = "BATON_ROUTER_OVERLAP_WEIGHT"
ENV_LOCAL_TOKENIZE = "BATON_LOCAL_TOKENIZE_MAX_CHARS"
# The tokenizer service's own limit for encoding inline, on its event loop: shorter prompts
# cost less to encode than a round trip to it, so the gateway encodes them itself.
DEFAULT_LOCAL_TOKENIZE_MAX_CHARS = 2048
ENV_COLOCATED = "BATON_GATEWAY_COLOCATED"
ENV_PREFILL_CALLS = "BATON_PREFILL_CALLS"
ENV_API_KEY = "BATON_API_KEY"
ENV_MAX_NUM_REQUESTS = "BATON_GATEWAY_MAX_NUM_REQUESTS"
ENV_STREAM_INTERVAL = "BATON_GATEWAY_STREAM_INTERVAL"
ENV_TOOL_CALL_PARSER = "BATON_GATEWAY_TOOL_CALL_PARSER"
ENV_REASONING_PARSER = "BATON_GATEWAY_REASONING_PARSER"
ENV_RESOLVE_WORKERS = "BATON_GATEWAY_RESOLVE_WORKERS_S"
ENV_DISCOVER_WORKERS = "BATON_GATEWAY_DISCOVER_WORKERS"
ENV_RESPONSES_TTL = "BATON_GATEWAY_RESPONSES_TTL_S"
ENV_TRUST_REQUEST_CHAT_TEMPLATE = "BATON_GATEWAY_TRUST_REQUEST_CHAT_TEMPLATE"
ENV_GENERATION_CONFIG = "BATON_GENERATION_CONFIG"
ENV_OVERRIDE_GENERATION_CONFIG = "BATON_OVERRIDE_GENERATION_CONFIG"
# How often --prefill/--decode host names are resolved again, so a pool follows its replicas as a
# compose service or a Kubernetes headless service is scaled.
DEFAULT_RESOLVE_WORKERS_S = 5.0
DEFAULT_RESPONSES_TTL_S = 3600.0  # how long the Responses API keeps a stored response
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
    tokenizer_address: str
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
    overlap_weight: float = 4.0  # router: a block to compute against a block already queued (router.py)
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
    http_serving: HttpServing = HttpServing()  # the HTTP API's CORS and TLS (http_serving.py)
    # LoRA adapters the workers serve beside the model, (name, path): a request naming one as its
    # model is computed with it (the path is what its model card shows).
    lora_modules: tuple[tuple[str, str], ...] = ()
    # /v1/load_lora_adapter and /v1/unload_lora_adapter served (lora_updates.py): off, as in vLLM.
    allow_runtime_lora_updating: bool = False

    def __post_init__(self):
        object.__setattr__(self, "model_dir", check_model_dir(self.model_dir, "tokenizer.json"))
        if not self.served_model_names:
            object.__setattr__(self, "served_model_names", (self.model_dir.resolve().name,))
        if any(not name or name != name.strip() for name in self.served_model_names):
            raise ConfigError(f"--served-model-name: names must be non-empty, without surrounding spaces, got "
                              f"{list(self.served_model_names)}")
        check_bind(self.host, self.port, ENV_HOST)
        if not 0 <= self.http_port <= 65535:
            raise ConfigError(f"--http-port must be in [0, 65535], got {self.http_port}")
        if not self.tokenizer_address:
            raise ConfigError(f"no tokenizer: pass --tokenizer HOST:PORT or set ${ENV_TOKENIZER}")
        if self.discover_workers and not self.redis_url:
            raise ConfigError("--discover-workers finds workers in the instance registry: pass --redis URL too")
        _check_layout(self.prefill_addresses, self.is_colocated, self.local_prefill_max_tokens, self.discover_workers)
        if not self.decode_addresses and not self.discover_workers:
            raise ConfigError(f"no decode workers: pass --decode HOST:PORT[,HOST:PORT...] or set ${ENV_DECODE}, "
                              f"or --discover-workers to find them in the instance registry")
        for flag, addresses in (("--prefill", self.prefill_addresses), ("--decode", self.decode_addresses)):
            for address in addresses:
                _check_address(flag, address)
        _check_address("--tokenizer", self.tokenizer_address)
        check_positive("--max-body-bytes", self.max_body_bytes)
        if self.local_prefill_max_tokens < LOCAL_PREFILL_AUTO:
            raise ConfigError(f"--local-prefill-max-tokens must be >= 0 (or -1: auto), got "
                              f"{self.local_prefill_max_tokens}")
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
        if self.tool_call_parser == "openai" and self.reasoning_parser != HARMONY:
            raise ConfigError(f"--tool-call-parser openai reads gpt-oss's harmony messages, which --reasoning-parser "
                              f"{HARMONY} takes apart: it cannot go with {self.reasoning_parser!r}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ConfigError(f"--kv-transport must be one of {', '.join(KV_TRANSPORTS)}, got {self.kv_transport!r}")
        check_limits(self.max_model_len, self.max_message_bytes, self.grace_s)
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
        env = os.environ if env is None else env
        parser = new_parser("gateway")
        parser.description = "Baton's gateway: the OpenAI HTTP API and the public gRPC Generate API."
        add_bind_flags(parser, env, env_host=ENV_HOST, env_port=ENV_PORT,
                       model_help="model directory (its tokenizer detokenizes the output)")
        parser.add_argument("--http-port", type=int, default=env_int(env, ENV_HTTP_PORT, DEFAULT_HTTP_PORT),
                            help=f"OpenAI HTTP API port, 0 for any free one (${ENV_HTTP_PORT})")
        parser.add_argument("--tokenizer", default=env.get(ENV_TOKENIZER, ""),
                            help=f"the tokenizer service, HOST:PORT (${ENV_TOKENIZER})")
        parser.add_argument("--prefill", default=env.get(ENV_PREFILL, ""),
                            help=f"prefill workers, HOST:PORT[,HOST:PORT...] (${ENV_PREFILL})")
        parser.add_argument("--colocated", action="store_true",
                            default=env.get(ENV_COLOCATED, "") not in ("", "0"),
                            help=f"no prefill workers: the decode workers prefill every prompt themselves "
                                 f"(${ENV_COLOCATED}=1)")
        parser.add_argument("--decode", default=env.get(ENV_DECODE, ""),
                            help=f"decode workers, HOST:PORT[,HOST:PORT...] (${ENV_DECODE})")
        parser.add_argument("--served-model-name", nargs="+", metavar="NAME",
                            default=_split(env.get(ENV_SERVED_MODEL_NAME, "")),
                            help=f"the model names clients may send, the first the one responses give (the "
                                 f"others: aliases, e.g. while clients move to a new name); default: the model "
                                 f"directory's name (${ENV_SERVED_MODEL_NAME}, names separated by commas)")
        parser.add_argument("--max-body-bytes", type=int,
                            default=env_int(env, ENV_MAX_BODY_BYTES, DEFAULT_MAX_BODY_BYTES),
                            help=f"largest HTTP request body accepted; larger gets 413 (${ENV_MAX_BODY_BYTES})")
        parser.add_argument("--kv-transport", default=env.get(ENV_KV_TRANSPORT, "auto"),
                            help=f"how prefill sends KV pages to decode: {', '.join(KV_TRANSPORTS)} "
                                 f"(${ENV_KV_TRANSPORT})")
        parser.add_argument("--redis", default=env.get(ENV_REDIS, ""),
                            help=f"Redis URL of the prefix index and instance registry; empty: route prefill by "
                                 f"load only (${ENV_REDIS})")
        parser.add_argument("--routing", default=env.get(ENV_ROUTING, "prefix"),
                            help=f"how prefill workers are chosen: {', '.join(ROUTING_POLICIES)} (${ENV_ROUTING})")
        parser.add_argument("--router-overlap-weight", type=float,
                            default=env_float(env, ENV_OVERLAP_WEIGHT, 4.0),
                            help=f"prefix routing: the cost of a prompt block to compute, against one block of "
                                 f"queued work (${ENV_OVERLAP_WEIGHT})")
        parser.add_argument("--local-prefill-max-tokens", type=int,
                            default=env_int(env, ENV_LOCAL_PREFILL, LOCAL_PREFILL_AUTO),
                            help=f"conditional disaggregation: the decode worker prefills prompts up to this many "
                                 f"tokens itself (no prefill worker, no KV transfer); 0: never; -1 (default): "
                                 f"min(1000, context length / 8) (${ENV_LOCAL_PREFILL})")
        parser.add_argument("--local-tokenize-max-chars", type=int,
                            default=env_int(env, ENV_LOCAL_TOKENIZE, DEFAULT_LOCAL_TOKENIZE_MAX_CHARS),
                            help=f"prompts (or chat messages' content) up to this many characters are encoded here, "
                                 f"with the same tokenizer and chat template, instead of by the tokenizer service: "
                                 f"a round trip off their path; 0: the tokenizer service encodes every prompt "
                                 f"(${ENV_LOCAL_TOKENIZE})")
        parser.add_argument("--prefill-calls", default=env.get(ENV_PREFILL_CALLS, "preopened"),
                            help=f"how prompts reach the prefill workers: preopened (on a call kept open to each "
                                 f"worker ahead of the next request, where one is; not while tracing), new (a new "
                                 f"call each) (${ENV_PREFILL_CALLS})")
        parser.add_argument("--api-key", action="append", metavar="KEY",
                            help=f"require this key of every HTTP request but /health, /live and /metrics "
                                 f"(Authorization: Bearer KEY) and of gRPC Generate calls (authorization metadata); "
                                 f"repeat it to accept several (while rotating one); default ${ENV_API_KEY}, else no "
                                 f"key is asked for")
        parser.add_argument("--max-num-requests", type=int, default=env_int(env, ENV_MAX_NUM_REQUESTS, 0),
                            help=f"admission control: the most requests (each choice of n counts) the gateway "
                                 f"holds at once; more get 429 with Retry-After; 0: no limit (${ENV_MAX_NUM_REQUESTS})")
        parser.add_argument("--stream-interval", type=int, default=env_int(env, ENV_STREAM_INTERVAL, 1),
                            help=f"a decode worker sends a request's tokens in chunks of at least this many, but "
                                 f"the first and the last: fewer messages and SSE events per token, each event later "
                                 f"(as vLLM's and SGLang's); SGLang's sampling_params.stream_interval sets a "
                                 f"request's own; default 1, every step's (${ENV_STREAM_INTERVAL})")
        parser.add_argument("--tool-call-parser", default=env.get(ENV_TOOL_CALL_PARSER) or None,
                            help=f"the served model's tool-call syntax, read out of its text for tool_choice "
                                 f"\"auto\" (without it, \"auto\" is refused) (${ENV_TOOL_CALL_PARSER})")
        parser.add_argument("--reasoning-parser", default=env.get(ENV_REASONING_PARSER) or None,
                            help=f"the served model's way of thinking ({', '.join(REASONING_PARSERS)}): chat "
                                 f"replies give its thinking as `reasoning`, apart from the answer "
                                 f"(${ENV_REASONING_PARSER})")
        parser.add_argument("--resolve-workers-s", type=float,
                            default=env_float(env, ENV_RESOLVE_WORKERS, DEFAULT_RESOLVE_WORKERS_S),
                            help=f"how often the --prefill and --decode host names are resolved again: a name "
                                 f"that resolves to several addresses (a compose service's replicas, a Kubernetes "
                                 f"headless service) is a pool that follows them as they are scaled; 0: only at "
                                 f"start (${ENV_RESOLVE_WORKERS})")
        parser.add_argument("--discover-workers", action="store_true",
                            default=env.get(ENV_DISCOVER_WORKERS, "") not in ("", "0"),
                            help=f"also route to the prefill and decode workers that heartbeat in the instance "
                                 f"registry (--redis) serving this model, looked for every --resolve-workers-s: "
                                 f"--prefill and --decode may then be left out (${ENV_DISCOVER_WORKERS}=1)")
        parser.add_argument("--responses-ttl-s", type=float,
                            default=env_float(env, ENV_RESPONSES_TTL, DEFAULT_RESPONSES_TTL_S),
                            help=f"how long the Responses API keeps a response (for previous_response_id and GET "
                                 f"/v1/responses/ID): in Redis with --redis, shared by every gateway, else in this "
                                 f"process; 0: store none (${ENV_RESPONSES_TTL})")
        parser.add_argument("--trust-request-chat-template", action="store_true",
                            default=env.get(ENV_TRUST_REQUEST_CHAT_TEMPLATE, "") not in ("", "0"),
                            help=f"let chat requests bring their own Jinja template (`chat_template`); without it "
                                 f"such a request is a 400 (${ENV_TRUST_REQUEST_CHAT_TEMPLATE}=1)")
        parser.add_argument("--generation-config", default=env.get(ENV_GENERATION_CONFIG) or "auto",
                            help=f"sampling defaults for what a request leaves out (temperature, top_p, top_k, "
                                 f"min_p, repetition_penalty, max_new_tokens), as vLLM takes them: {SOURCES_HELP} "
                                 f"(${ENV_GENERATION_CONFIG}; default auto)")
        parser.add_argument("--override-generation-config", metavar="JSON",
                            default=env.get(ENV_OVERRIDE_GENERATION_CONFIG) or "",
                            help=f"defaults set over --generation-config's, a JSON object, e.g. "
                                 f"'{{\"temperature\": 0.5}}' (${ENV_OVERRIDE_GENERATION_CONFIG})")
        HttpServing.add_flags(parser, env)
        add_lora_flag(parser, env)
        add_chat_template_flag(parser, env)
        add_limit_flags(parser, env)
        add_tracing_flag(parser)
        args = parser.parse_args(argv)
        api_keys = args.api_key if args.api_key is not None else [env[ENV_API_KEY]] if env.get(ENV_API_KEY) else []
        return cls(model_dir=model_arg(args), tokenizer_address=args.tokenizer,
                   prefill_addresses=_split(args.prefill), decode_addresses=_split(args.decode),
                   served_model_names=tuple(args.served_model_name), host=args.host, port=args.port,
                   http_port=args.http_port, max_body_bytes=args.max_body_bytes, max_model_len=args.max_model_len,
                   hf_overrides=hf_overrides(args.hf_overrides),
                   max_message_bytes=args.max_message_bytes, kv_transport=args.kv_transport, redis_url=args.redis,
                   grace_s=args.shutdown_grace_s,
                   routing=args.routing, overlap_weight=args.router_overlap_weight,
                   local_prefill_max_tokens=args.local_prefill_max_tokens,
                   local_tokenize_max_chars=args.local_tokenize_max_chars, is_colocated=args.colocated,
                   prefill_calls=args.prefill_calls, otlp_endpoint=args.otlp_endpoint, api_keys=tuple(api_keys),
                   max_num_requests=args.max_num_requests,
                   stream_interval=args.stream_interval, tool_call_parser=args.tool_call_parser,
                   reasoning_parser=_reasoning_parser(args), resolve_workers_s=args.resolve_workers_s,
                   discover_workers=args.discover_workers, responses_ttl_s=args.responses_ttl_s,
                   chat_template=chat_template_source(args.chat_template),
                   generation_defaults=_generation_defaults(args), http_serving=HttpServing.from_args(args),
                   lora_modules=lora_modules(args.lora_modules),
                   allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                   trust_request_chat_template=args.trust_request_chat_template)


def _generation_defaults(args) -> GenerationDefaults:
    try:
        overrides = json.loads(args.override_generation_config) if args.override_generation_config else {}
    except json.JSONDecodeError as e:
        raise ConfigError(f"--override-generation-config is not JSON: {e}") from None
    if not isinstance(overrides, dict):
        raise ConfigError("--override-generation-config must be a JSON object")
    try:
        return GenerationDefaults.load(args.generation_config, model_arg(args), overrides)
    except ValueError as e:
        raise ConfigError(f"--generation-config: {e}") from None


def _split(addresses: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in addresses.split(",") if a.strip())


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


def _reasoning_parser(args) -> str | None:
    """The flag's parser; gpt-oss's tool calls (`--tool-call-parser openai`) bring their reasoning
    parser, as vLLM reads every harmony reply's channels."""
    if args.reasoning_parser is None and args.tool_call_parser == "openai":
        return HARMONY
    return args.reasoning_parser
