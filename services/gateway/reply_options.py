"""What the gateway's replies carry beyond what a request asks for, with vLLM's flags for it.

--enable-force-include-usage: every streamed chat and completion ends with its usage, as with
stream_options.include_usage, whether the request asks or not (billing proxies count tokens so).

--enable-per-request-metrics: a chat, completion or Responses reply of one sequence carries its
timing, `metrics` (request_timing.py).

--per-request-spec-decode-metrics summary|detailed: such a reply's `metrics` also carries its
speculative steps, `speculative_decoding` (spec_decode_metrics.py), from decode workers given the
same flag (null from one with no speculative decoding).

--enable-per-request-output-token-metrics: a chat or Responses reply's `metrics` carries its timing
and `output_token_metrics`, its thinking's and its answer's (needs --reasoning-parser).

--return-tokens-as-token-ids: logprobs name each token "token_id:N" rather than by its text, unless
a request's `return_tokens_as_token_ids` says otherwise.
"""
from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass

from engine.spec_decode_stats import PER_REQUEST_SPEC_DECODE_METRICS
from services.common.settings import env_flag

ENV_FORCE_INCLUDE_USAGE = "BATON_GATEWAY_FORCE_INCLUDE_USAGE"
ENV_PER_REQUEST_METRICS = "BATON_GATEWAY_PER_REQUEST_METRICS"


@dataclass(frozen=True)
class ReplyOptions:
    force_include_usage: bool = False
    per_request_metrics: bool = False
    return_tokens_as_token_ids: bool = False
    spec_decode_metrics: str = "none"  # one of PER_REQUEST_SPEC_DECODE_METRICS
    output_token_metrics: bool = False  # timing too, and each kind of token's (output_token_metrics.py)

    @property
    def has_metrics(self) -> bool:
        """Whether replies carry `metrics`."""
        return self.per_request_metrics or self.spec_decode_metrics != "none" or self.output_token_metrics

    @property
    def has_timing(self) -> bool:
        return self.per_request_metrics or self.output_token_metrics

    def includes_usage(self, asked: bool) -> bool:
        """Whether a stream whose request asked for its usage or not (`asked`) ends with it."""
        return asked or self.force_include_usage

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
        parser.add_argument("--enable-force-include-usage", action="store_true",
                            default=env_flag(env, ENV_FORCE_INCLUDE_USAGE),
                            help=f"every streamed chat and completion ends with its usage, as with stream_options."
                                 f"include_usage, whether the request asks or not (as vLLM's flag; billing proxies "
                                 f"count tokens so) (${ENV_FORCE_INCLUDE_USAGE}=1)")
        parser.add_argument("--enable-per-request-metrics", action="store_true",
                            default=env_flag(env, ENV_PER_REQUEST_METRICS),
                            help=f"a chat, completion or Responses reply of one sequence carries its timing, "
                                 f"`metrics`: time to first token, generation time, queue time, mean inter-token "
                                 f"latency, tokens per second (as vLLM's flag) (${ENV_PER_REQUEST_METRICS}=1)")
        parser.add_argument("--per-request-spec-decode-metrics", choices=PER_REQUEST_SPEC_DECODE_METRICS,
                            default="none",
                            help="such a reply's `metrics` carries its speculative steps too: their drafts and "
                                 "what was accepted (summary), and each step's (detailed), from decode workers "
                                 "given the same flag (as vLLM's)")
        parser.add_argument("--enable-per-request-output-token-metrics", action="store_true",
                            help="a chat or Responses reply of one sequence carries its timing and its tokens' by "
                                 "kind, thinking and answer (needs --reasoning-parser; as vLLM's, experimental)")
        parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                            help="logprobs name each token \"token_id:N\" rather than by its text, unless a "
                                 "request's return_tokens_as_token_ids says otherwise (as vLLM's flag)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ReplyOptions:
        return cls(force_include_usage=args.enable_force_include_usage,
                   per_request_metrics=args.enable_per_request_metrics,
                   return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                   spec_decode_metrics=args.per_request_spec_decode_metrics,
                   output_token_metrics=args.enable_per_request_output_token_metrics)
