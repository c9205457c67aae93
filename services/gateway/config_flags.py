"""The gateway's command line: every flag, the `BATON_*` variable each falls back to, and the
`GatewayConfig` they make. This is the one place the settings are read; `GatewayConfig.from_args`
calls `config_from_args`.

`--port` is the public gRPC API's (with health and reflection, like every service);
`--http-port` the OpenAI HTTP API's. Worker addresses are comma-separated lists; a
host name that resolves to several addresses (a compose service with replicas)
stands for all of them. `--colocated` takes no prefill workers: the decode workers
prefill every prompt themselves (the layout disaggregation is measured against).
`--api-key` (or `$BATON_API_KEY`, better: not in the process list) makes both APIs ask
for a key (api_keys.py).
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from services.common.logprobs_flag import add_max_logprobs_flag
from services.common.lora_flags import add_lora_flag, lora_modules
from services.common.mm_limits import (
    add_limit_mm_flag,
    add_media_io_kwargs_flag,
    add_mm_embeds_flag,
    add_mm_processor_kwargs_flag,
    image_limit,
    media_io_kwargs,
    processor_kwargs,
    video_limit,
)
from services.common.settings import (
    ConfigError,
    add_bind_flags,
    add_limit_flags,
    add_tracing_flag,
    env_flag,
    env_float,
    env_int,
    hf_overrides,
    json_object,
    model_arg,
    new_parser,
)
from services.common.tokenizer_dir_flag import add_tokenizer_dir_flag
from services.gateway.chat_serving import ChatServing
from services.gateway.config import (
    DEFAULT_HTTP_PORT,
    DEFAULT_LOCAL_TOKENIZE_MAX_CHARS,
    DEFAULT_OVERLAP_WEIGHT,
    DEFAULT_RESOLVE_WORKERS_S,
    DEFAULT_RESPONSES_TTL_S,
    ENV_API_KEY,
    ENV_DECODE,
    ENV_HOST,
    ENV_LOCAL_PREFILL,
    ENV_PREFILL,
    ENV_TOKENIZER,
    KV_TRANSPORTS,
    LOCAL_PREFILL_AUTO,
    ROUTING_POLICIES,
    GatewayConfig,
)
from services.gateway.generation_defaults import SOURCES_HELP, GenerationDefaults
from services.gateway.http_app import DEFAULT_MAX_BODY_BYTES
from services.gateway.http_serving import HttpServing
from services.gateway.idle_sleep import IdleSleepConfig
from services.gateway.parser_flags import add_parser_flags, reasoning_config, reasoning_parser, tool_call_parser
from services.gateway.reply_options import ReplyOptions
from services.gateway.request_log import add_request_log_flags, log_level_of
from services.tokenizer.content_format import CONTENT_FORMATS
from services.tokenizer.template_setting import add_chat_template_flag, chat_template_source

# The variable each flag falls back to; those config.py's checks name in their messages are defined there.
ENV_PORT = "BATON_GATEWAY_PORT"
ENV_HTTP_PORT = "BATON_GATEWAY_HTTP_PORT"
ENV_SERVED_MODEL_NAME = "BATON_SERVED_MODEL_NAME"
ENV_MAX_BODY_BYTES = "BATON_GATEWAY_MAX_BODY_BYTES"
ENV_KV_TRANSPORT = "BATON_KV_TRANSPORT"
ENV_REDIS = "BATON_REDIS_URL"
ENV_ROUTING = "BATON_ROUTING"
ENV_OVERLAP_WEIGHT = "BATON_ROUTER_OVERLAP_WEIGHT"
ENV_LOCAL_TOKENIZE = "BATON_LOCAL_TOKENIZE_MAX_CHARS"
ENV_COLOCATED = "BATON_GATEWAY_COLOCATED"
ENV_PREFILL_CALLS = "BATON_PREFILL_CALLS"
ENV_MAX_NUM_REQUESTS = "BATON_GATEWAY_MAX_NUM_REQUESTS"
ENV_STREAM_INTERVAL = "BATON_GATEWAY_STREAM_INTERVAL"
ENV_MAX_LOGPROBS = "BATON_GATEWAY_MAX_LOGPROBS"
ENV_RESOLVE_WORKERS = "BATON_GATEWAY_RESOLVE_WORKERS_S"
ENV_DISCOVER_WORKERS = "BATON_GATEWAY_DISCOVER_WORKERS"
ENV_RESPONSES_TTL = "BATON_GATEWAY_RESPONSES_TTL_S"
ENV_TRUST_REQUEST_CHAT_TEMPLATE = "BATON_GATEWAY_TRUST_REQUEST_CHAT_TEMPLATE"
ENV_GENERATION_CONFIG = "BATON_GENERATION_CONFIG"
ENV_OVERRIDE_GENERATION_CONFIG = "BATON_OVERRIDE_GENERATION_CONFIG"
ENV_DEFAULT_CHAT_TEMPLATE_KWARGS = "BATON_DEFAULT_CHAT_TEMPLATE_KWARGS"


def config_from_args(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> GatewayConfig:
    """The config `argv` (default: sys.argv[1:]) asks for, each flag left out taken from its variable in
    `env` (default: os.environ); ConfigError for a bad value, argparse's exit for a bad flag."""
    env = os.environ if env is None else env
    args = new_gateway_parser(env).parse_args(argv)
    api_keys = args.api_key if args.api_key is not None else [env[ENV_API_KEY]] if env.get(ENV_API_KEY) else []
    return GatewayConfig(
        model_dir=model_arg(args), tokenizer_addresses=_split(args.tokenizer),
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
        stream_interval=args.stream_interval, tool_call_parser=tool_call_parser(args),
        reasoning_parser=reasoning_parser(args), reasoning_config=reasoning_config(args),
        resolve_workers_s=args.resolve_workers_s,
        discover_workers=args.discover_workers, responses_ttl_s=args.responses_ttl_s,
        chat_template=chat_template_source(args.chat_template),
        generation_defaults=_generation_defaults(args), http_serving=HttpServing.from_args(args),
        chat_serving=ChatServing.from_args(args),
        default_chat_template_kwargs=json_object(args.default_chat_template_kwargs,
                                                 "--default-chat-template-kwargs") or {},
        chat_template_content_format=args.chat_template_content_format,
        log_requests_level=log_level_of(args, env), max_log_len=args.max_log_len,
        reply_options=ReplyOptions.from_args(args), sleep_when_idle=IdleSleepConfig.from_args(args),
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint, max_logprobs=args.max_logprobs,
        enable_prompt_embeds=args.enable_prompt_embeds, allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=frozenset(d.lower() for d in args.allowed_media_domains)
        if args.allowed_media_domains else None, enable_mm_embeds=args.enable_mm_embeds,
        limit_images=image_limit(args.limit_mm_per_prompt), limit_videos=video_limit(args.limit_mm_per_prompt),
        mm_processor_cache_gb=args.mm_processor_cache_gb,
        mm_processor_kwargs=processor_kwargs(args.mm_processor_kwargs),
        media_io_kwargs=media_io_kwargs(args.media_io_kwargs),
        lora_modules=lora_modules(args.lora_modules),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        trust_request_chat_template=args.trust_request_chat_template, tokenizer_dir=args.tokenizer_dir)


def new_gateway_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    """Every gateway flag, its default read from `env` (so --help shows what a flag left out becomes)."""
    parser = new_parser("gateway")
    parser.description = "Baton's gateway: the OpenAI HTTP API and the public gRPC Generate API."
    add_bind_flags(parser, env, env_host=ENV_HOST, env_port=ENV_PORT,
                   model_help="model directory (its tokenizer detokenizes the output)")
    parser.add_argument("--http-port", type=int, default=env_int(env, ENV_HTTP_PORT, DEFAULT_HTTP_PORT),
                        help=f"OpenAI HTTP API port, 0 for any free one (${ENV_HTTP_PORT})")
    parser.add_argument("--tokenizer", default=env.get(ENV_TOKENIZER, ""),
                        help=f"tokenizer services, HOST:PORT[,HOST:PORT...]: each long prompt to the least loaded "
                             f"(${ENV_TOKENIZER})")
    parser.add_argument("--prefill", default=env.get(ENV_PREFILL, ""),
                        help=f"prefill workers, HOST:PORT[,HOST:PORT...] (${ENV_PREFILL})")
    parser.add_argument("--colocated", action="store_true",
                        default=env_flag(env, ENV_COLOCATED),
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
                        default=env_float(env, ENV_OVERLAP_WEIGHT, DEFAULT_OVERLAP_WEIGHT),
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
    add_parser_flags(parser, env)
    parser.add_argument("--resolve-workers-s", type=float,
                        default=env_float(env, ENV_RESOLVE_WORKERS, DEFAULT_RESOLVE_WORKERS_S),
                        help=f"how often the --prefill and --decode host names are resolved again: a name "
                             f"that resolves to several addresses (a compose service's replicas, a Kubernetes "
                             f"headless service) is a pool that follows them as they are scaled; 0: only at "
                             f"start (${ENV_RESOLVE_WORKERS})")
    parser.add_argument("--discover-workers", action="store_true",
                        default=env_flag(env, ENV_DISCOVER_WORKERS),
                        help=f"also route to the prefill and decode workers that heartbeat in the instance "
                             f"registry (--redis) serving this model, looked for every --resolve-workers-s: "
                             f"--prefill and --decode may then be left out (${ENV_DISCOVER_WORKERS}=1)")
    parser.add_argument("--responses-ttl-s", type=float,
                        default=env_float(env, ENV_RESPONSES_TTL, DEFAULT_RESPONSES_TTL_S),
                        help=f"how long the Responses API keeps a response (for previous_response_id and GET "
                             f"/v1/responses/ID): in Redis with --redis, shared by every gateway, else in this "
                             f"process; 0: store none (${ENV_RESPONSES_TTL})")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        default=env_flag(env, ENV_TRUST_REQUEST_CHAT_TEMPLATE),
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
    parser.add_argument("--default-chat-template-kwargs", metavar="JSON",
                        default=env.get(ENV_DEFAULT_CHAT_TEMPLATE_KWARGS) or "",
                        help=f"chat template variables for what a request's chat_template_kwargs leaves out, a "
                             f"JSON object, e.g. '{{\"enable_thinking\": false}}' (as vLLM's flag) "
                             f"(${ENV_DEFAULT_CHAT_TEMPLATE_KWARGS})")
    parser.add_argument("--chat-template-content-format", choices=CONTENT_FORMATS, default="auto",
                        help="messages' content to the chat template as one text (string: parts joined by "
                             "newlines) or as OpenAI's list of text parts (openai); auto, the default, as the "
                             "template reads it: parts where it loops over a message's content (as vLLM's flag)")
    parser.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="serve GET /tokenizer_info: the tokenizer's configuration and chat template "
                             "(as vLLM's flag; off, as the template may be private)")
    parser.add_argument("--enable-prompt-embeds", action="store_true",
                        help="take /v1/completions' prompt_embeds: prompts given as embeddings, the base64 of "
                             "torch.save'd [tokens, hidden_size] tensors (as vLLM's flag; off, as vLLM's: "
                             "reading them takes torch into the gateway)")
    add_limit_mm_flag(parser)
    add_mm_processor_kwargs_flag(parser)
    add_media_io_kwargs_flag(parser)
    parser.add_argument("--mm-processor-cache-gb", type=float, default=4.0, metavar="GIB",
                        help="GiB of images kept as the model's image processor made them, by their encoded bytes: "
                             "a conversation's images, sent again each turn, are decoded and resized once (as "
                             "vLLM's flag; default 4; 0: none kept)")
    parser.add_argument("--allowed-local-media-path", type=Path, metavar="DIR",
                        help="a chat's file:// image URLs are read under this directory (as vLLM's flag; none "
                             "are without it)")
    add_mm_embeds_flag(parser)
    parser.add_argument("--allowed-media-domains", nargs="+", metavar="HOST",
                        help="http(s) image URLs are fetched only from these hosts, and redirected only to them (as "
                             "vLLM's flag; default: any), against requests that name internal services")
    add_max_logprobs_flag(parser, env, env_var=ENV_MAX_LOGPROBS)
    HttpServing.add_flags(parser, env)
    ChatServing.add_flags(parser)
    ReplyOptions.add_flags(parser, env)
    IdleSleepConfig.add_flags(parser, env)
    add_request_log_flags(parser, env)
    add_lora_flag(parser, env)
    add_chat_template_flag(parser, env)
    add_tokenizer_dir_flag(parser, env)
    add_limit_flags(parser, env)
    add_tracing_flag(parser)
    return parser


def _split(addresses: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in addresses.split(",") if a.strip())


def _generation_defaults(args) -> GenerationDefaults:
    overrides = json_object(args.override_generation_config, "--override-generation-config") or {}
    try:
        return GenerationDefaults.load(args.generation_config, model_arg(args), overrides)
    except ValueError as e:
        raise ConfigError(f"--generation-config: {e}") from None
