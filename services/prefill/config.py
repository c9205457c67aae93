"""The prefill service's settings: one frozen dataclass, built from CLI flags and
`BATON_*` environment variables in one place (`from_args`).

A flag wins over its environment variable, which wins over the default. Host, port
and engine sizes carry the service's name (`BATON_PREFILL_PORT`); the model and the
message limit are shared by every service on purpose.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.common.limits import DEFAULT_MAX_MESSAGE_BYTES

ENV_MODEL = "BATON_MODEL"
ENV_HOST = "BATON_PREFILL_HOST"
ENV_PORT = "BATON_PREFILL_PORT"
ENV_KV_BLOCKS = "BATON_PREFILL_KV_BLOCKS"
ENV_MAX_NUM_BATCHED_TOKENS = "BATON_PREFILL_MAX_NUM_BATCHED_TOKENS"
ENV_MAX_NUM_SEQS = "BATON_PREFILL_MAX_NUM_SEQS"
ENV_MAX_MODEL_LEN = "BATON_MAX_MODEL_LEN"
ENV_MAX_MESSAGE_BYTES = "BATON_MAX_MESSAGE_BYTES"

DEFAULT_KV_BLOCKS = 1024
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # the token budget of one step: longer prompts are chunked
DEFAULT_MAX_NUM_SEQS = 64


class ConfigError(ValueError):
    """A missing or invalid setting; `__main__` prints it on one line and exits 2."""


@dataclass(frozen=True)
class PrefillServiceConfig:
    model_dir: Path
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (the listening line says which)
    num_kv_blocks: int = DEFAULT_KV_BLOCKS  # the local pool: prompts in flight plus the prefix cache
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int | None = None  # None: the model's own context length
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_s: float = 5.0  # how long in-flight calls may finish after SIGTERM

    def __post_init__(self):
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        if not (self.model_dir / "config.json").is_file():
            raise ConfigError(f"--model {self.model_dir}: no config.json there (set --model or ${ENV_MODEL})")
        if not self.host:
            raise ConfigError(f"--host must not be empty (or ${ENV_HOST})")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        if self.num_kv_blocks < 1:
            raise ConfigError(f"--kv-blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.max_message_bytes < 1:
            raise ConfigError(f"--max-message-bytes must be >= 1, got {self.max_message_bytes}")
        if self.grace_s < 0:
            raise ConfigError(f"grace_s must be >= 0, got {self.grace_s}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
                  ) -> PrefillServiceConfig:
        """Parse `argv` (default: sys.argv[1:]) over `env` (default: os.environ).
        Raises ConfigError for a missing or invalid setting; argparse exits on a malformed flag."""
        env = os.environ if env is None else env
        parser = argparse.ArgumentParser(prog="python -m services.prefill",
                                         description="Baton's prefill service (gRPC).")
        parser.add_argument("--model", default=env.get(ENV_MODEL), help=f"model directory (${ENV_MODEL})")
        parser.add_argument("--host", default=env.get(ENV_HOST, "127.0.0.1"), help=f"bind host (${ENV_HOST})")
        parser.add_argument("--port", type=int, default=_env_int(env, ENV_PORT, 0),
                            help=f"bind port, 0 for any free one (${ENV_PORT})")
        parser.add_argument("--kv-blocks", type=int, default=_env_int(env, ENV_KV_BLOCKS, DEFAULT_KV_BLOCKS),
                            help=f"local KV pool size in pages (${ENV_KV_BLOCKS})")
        parser.add_argument("--max-num-batched-tokens", type=int,
                            default=_env_int(env, ENV_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_BATCHED_TOKENS),
                            help=f"tokens per step; longer prompts are chunked (${ENV_MAX_NUM_BATCHED_TOKENS})")
        parser.add_argument("--max-num-seqs", type=int, default=_env_int(env, ENV_MAX_NUM_SEQS, DEFAULT_MAX_NUM_SEQS),
                            help=f"most prompts in one batch (${ENV_MAX_NUM_SEQS})")
        parser.add_argument("--max-model-len", type=int, default=_env_int(env, ENV_MAX_MODEL_LEN, None),
                            help=f"shorten the model's context length (${ENV_MAX_MODEL_LEN})")
        parser.add_argument("--max-message-bytes", type=int,
                            default=_env_int(env, ENV_MAX_MESSAGE_BYTES, DEFAULT_MAX_MESSAGE_BYTES),
                            help=f"largest gRPC message sent or received (${ENV_MAX_MESSAGE_BYTES})")
        args = parser.parse_args(argv)
        if not args.model:
            raise ConfigError(f"no model: pass --model DIR or set ${ENV_MODEL}")
        return cls(model_dir=Path(args.model).expanduser(), host=args.host, port=args.port,
                   num_kv_blocks=args.kv_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
                   max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                   max_message_bytes=args.max_message_bytes)


def _env_int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"${name} must be an integer, got {value!r}") from None
