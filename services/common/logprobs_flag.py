"""Workers' logprobs flags, vLLM's: --logprobs-mode, what the logprobs they report are of
(engine/sampled_logprobs.py), and --max-logprobs, how many top logprobs a request may ask for per
token (the gateway takes it too, to refuse more at the door). The prefill worker reports a reply's
first token, the decode worker the rest: both must say the same."""
from __future__ import annotations

import argparse
from collections.abc import Mapping

from engine.config import DEFAULT_MAX_LOGPROBS, LOGPROBS_MODES
from services.common.settings import ConfigError, env_int


def add_logprobs_mode_flag(parser: argparse.ArgumentParser, env: Mapping[str, str], *, env_var: str) -> None:
    parser.add_argument("--logprobs-mode", default=env.get(env_var) or LOGPROBS_MODES[0],
                        help=f"what reported logprobs are of, vLLM's: raw_logprobs (the model's), processed_logprobs "
                             f"(those the token was drawn from, after penalties, temperature, top-k and top-p), or "
                             f"either as logits (raw_logits, processed_logits); prefill and decode workers must "
                             f"agree (${env_var})")


def add_max_logprobs_flag(parser: argparse.ArgumentParser, env: Mapping[str, str], *, env_var: str) -> None:
    parser.add_argument("--max-logprobs", type=int, default=env_int(env, env_var, DEFAULT_MAX_LOGPROBS),
                        help=f"the most top logprobs a request may ask for per token, vLLM's; -1: the whole "
                             f"vocabulary (${env_var})")


def check_logprobs_mode(mode: str) -> None:
    if mode not in LOGPROBS_MODES:
        raise ConfigError(f"--logprobs-mode must be one of {', '.join(LOGPROBS_MODES)}, got {mode!r}")


def check_max_logprobs(max_logprobs: int) -> None:
    if max_logprobs < -1:
        raise ConfigError(f"--max-logprobs must be >= -1 (-1: the whole vocabulary), got {max_logprobs}")
