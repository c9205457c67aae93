"""The tokenizer service's settings: one frozen dataclass, built from CLI flags and
`BATON_*` environment variables in one place (`from_args`).

The flags and checks every service shares (model, host, port, context override,
message limit) come from services/common/settings.py; host and port carry the
service's name (`BATON_TOKENIZER_PORT`).
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.limits import DEFAULT_MAX_MESSAGE_BYTES
from services.common.settings import (
    DEFAULT_SHUTDOWN_GRACE_S,
    ENV_MAX_MESSAGE_BYTES as ENV_MAX_MESSAGE_BYTES,
    ENV_MAX_MODEL_LEN as ENV_MAX_MODEL_LEN,
    ENV_MODEL as ENV_MODEL,
    ConfigError as ConfigError,
    add_bind_flags,
    add_limit_flags,
    add_metrics_flag,
    add_tracing_flag,
    check_bind,
    check_limits,
    check_metrics_port,
    check_model_dir,
    hf_overrides,
    model_arg,
    new_parser,
)
from services.common.tokenizer_dir_flag import add_tokenizer_dir_flag, tokenizer_dir
from services.tokenizer.template_setting import add_chat_template_flag, chat_template_source

ENV_HOST = "BATON_TOKENIZER_HOST"
ENV_PORT = "BATON_TOKENIZER_PORT"
ENV_METRICS_PORT = "BATON_TOKENIZER_METRICS_PORT"


@dataclass(frozen=True)
class TokenizerServiceConfig:
    model_dir: Path
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port, printed on the listening line
    metrics_port: int = 0  # Prometheus /metrics; 0: any free port (printed), -1: none
    max_model_len: int | None = None  # None: the model's own context length
    hf_overrides: dict[str, Any] | None = None  # config.json keys replaced (vLLM's --hf-overrides)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_s: float = DEFAULT_SHUTDOWN_GRACE_S  # after SIGTERM, how long in-flight calls may finish
    otlp_endpoint: str = ""  # OTLP gRPC collector for trace spans; "": as the OTEL_* variables say
    chat_template: str | None = None  # Jinja source replacing the model's templates (--chat-template)
    tokenizer_dir: Path | None = None  # where the tokenizer is, when not in model_dir (vLLM's --tokenizer)

    def __post_init__(self):
        object.__setattr__(self, "tokenizer_dir", tokenizer_dir(self.tokenizer_dir))
        object.__setattr__(self, "model_dir", check_model_dir(
            self.model_dir, "config.json" if self.tokenizer_dir is not None else "tokenizer.json"))
        check_bind(self.host, self.port, ENV_HOST)
        check_metrics_port(self.metrics_port)
        check_limits(self.max_model_len, self.max_message_bytes, self.grace_s)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
                  ) -> TokenizerServiceConfig:
        """Parse `argv` (default: sys.argv[1:]) over `env` (default: os.environ).
        Raises ConfigError for a missing or invalid setting; argparse exits on a malformed flag."""
        env = os.environ if env is None else env
        parser = new_parser("tokenizer")
        add_bind_flags(parser, env, env_host=ENV_HOST, env_port=ENV_PORT,
                       model_help="model directory holding tokenizer.json")
        add_metrics_flag(parser, env, env_metrics_port=ENV_METRICS_PORT)
        add_limit_flags(parser, env)
        add_tracing_flag(parser)
        add_chat_template_flag(parser, env)
        add_tokenizer_dir_flag(parser, env)
        args = parser.parse_args(argv)
        return cls(model_dir=model_arg(args), host=args.host, port=args.port, metrics_port=args.metrics_port,
                   max_model_len=args.max_model_len,
                   hf_overrides=hf_overrides(args.hf_overrides), max_message_bytes=args.max_message_bytes,
                   grace_s=args.shutdown_grace_s,
                   otlp_endpoint=args.otlp_endpoint, chat_template=chat_template_source(args.chat_template),
                   tokenizer_dir=args.tokenizer_dir)
