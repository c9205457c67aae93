"""A worker's --logprobs-mode (vLLM's): what the logprobs it reports are of (engine/sampled_logprobs.py).
The prefill worker reports a reply's first token, the decode worker the rest: both must say the same."""
from __future__ import annotations

import argparse
from collections.abc import Mapping

from engine.config import LOGPROBS_MODES
from services.common.settings import ConfigError


def add_logprobs_mode_flag(parser: argparse.ArgumentParser, env: Mapping[str, str], *, env_var: str) -> None:
    parser.add_argument("--logprobs-mode", default=env.get(env_var) or LOGPROBS_MODES[0],
                        help=f"what reported logprobs are of, vLLM's: raw_logprobs (the model's), processed_logprobs "
                             f"(those the token was drawn from, after penalties, temperature, top-k and top-p), or "
                             f"either as logits (raw_logits, processed_logits); prefill and decode workers must "
                             f"agree (${env_var})")


def check_logprobs_mode(mode: str) -> None:
    if mode not in LOGPROBS_MODES:
        raise ConfigError(f"--logprobs-mode must be one of {', '.join(LOGPROBS_MODES)}, got {mode!r}")
