"""Each request for the model logged as it arrives and as it ends (off by default), as vLLM's
`--enable-log-requests` and SGLang's `--log-requests` log them, one line each on the
`baton.gateway.requests` logger at INFO:

    Received request chatcmpl-..-0: prompt_tokens=512, lora=tuned, params: temperature: 0.7 max_tokens: 16
    Finished request chatcmpl-..-0: finished (stop), prompt_tokens=512 cached_tokens=448 generated=16
        ttft_ms=71.2 e2e_ms=250.3 prefilled_on=prefill, phases_ms: ingress=0.16 tokenize=0.06 ...

The end's line carries the request's ledger (timeline.py): where its milliseconds went, in the log
an operator already reads. Embeddings, score, rerank, classify and pooling requests are logged too,
by the endpoint's name, their end with its status, inputs, tokens and e2e_ms (no texts: their
inputs may be many, and are not generated):

    Finished request embd-..: embeddings finished, inputs=3 prompt_tokens=24, e2e_ms=12.31

How much a generation request's lines say is SGLang's level: 0, what the request is (its id, sizes
and timings); 1, also its sampling parameters; 2, also its prompt and output text (a prompt given as
ids, or rendered from chat messages, decoded), each cut to `max_len` characters (ids: tokens), 2048
by default as SGLang cuts them; 3, those whole unless
`max_len` says. vLLM's flags set level 1 (`--enable-log-requests`) or 2 (`--enable-log-outputs`
too). SGLang's `POST /configure_logging` turns it on, off, or to another level while serving.
"""
from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from google.protobuf import text_format
from pydantic import BaseModel, ConfigDict

from protos import common_pb2
from services.common.metrics import RequestTimer
from services.common.settings import env_int
from services.gateway.deltas import Delta
from services.gateway.http_body import optional_body
from services.gateway.timeline import PhaseClock

log = logging.getLogger("baton.gateway.requests")

LEVELS = (0, 1, 2, 3)
PARTIAL_LEN = 2048  # SGLang's cut of texts at level 2
DEFAULT_LEVEL = 2  # SGLang's, when --log-requests (or /configure_logging) names none


@dataclass
class RequestLog:
    """`level`: None (nothing logged) or one of LEVELS; `max_len`: texts and id lists cut to this many
    characters or ids (None: level 2's 2048, level 3's none)."""

    level: int | None = None
    max_len: int | None = None
    # A prompt's ids as text, for one given as ids or rendered from chat messages (vLLM logs the
    # rendered prompt); None: such a prompt is logged by its ids alone.
    decode: Callable[[Sequence[int]], str] | None = None

    def __post_init__(self) -> None:
        self._level_when_on = self.level if self.level is not None else DEFAULT_LEVEL

    def configure(self, log_requests: bool | None, level: int | None) -> None:
        """SGLang's /configure_logging: on or off (None: as it is), at `level` (None: the last one chosen),
        from the next request on."""
        if level is not None:
            self._level_when_on = level
        is_on = self.is_on if log_requests is None else log_requests
        self.level = self._level_when_on if is_on else None

    @property
    def is_on(self) -> bool:
        return self.level is not None

    @property
    def logs_texts(self) -> bool:
        return self.level is not None and self.level >= 2

    def received(self, request_id: str, prompt: Sequence[int], params: common_pb2.SamplingParams,
                 prompt_text: str | None) -> None:
        if self.level is None:  # turned off (/configure_logging) since the request arrived
            return
        parts = [f"prompt_tokens={len(prompt)}"]
        if params.HasField("lora_name"):
            parts.append(f"lora={params.lora_name}")
        if self.level >= 1:
            parts.append(f"params: {text_format.MessageToString(params, as_one_line=True)}")
        if self.logs_texts:
            if prompt_text is None and self.decode is not None:
                prompt_text = self.decode(self._cut(list(prompt)))
            if prompt_text is not None:
                parts.append(f"prompt: {self._cut(prompt_text)!r}")
            parts.append(f"prompt_token_ids: {self._cut(list(prompt))}")
        log.info("Received request %s: %s", request_id, ", ".join(parts))

    def finished(self, request_id: str, clock: PhaseClock, timer: RequestTimer, last: Delta | None,
                 output: Sequence[str]) -> None:
        """`last`: the request's last delta (None: it ended before any); `output`: its texts, when logged."""
        status = clock.status
        if last is not None and last.finish_reason is not None:
            status += f" ({last.finish_reason})"
        usage = last.usage if last is not None else None
        counts = f"prompt_tokens={timer.num_prompt_tokens}"
        if usage is not None:
            counts += f" cached_tokens={usage.cached_tokens}"
        counts += f" generated={timer.num_generated}"
        first = timer.first_token_time
        ttft = "" if first is None else f"ttft_ms={(first - timer.arrival) * 1e3:.2f} "
        phases = " ".join(f"{phase}={seconds * 1e3:.2f}" for phase, seconds in clock.seconds.items() if seconds > 0)
        line = (f"{status}, {counts}, {ttft}e2e_ms={clock.e2e_seconds * 1e3:.2f} "
                f"prefilled_on={clock.prefilled_on}, phases_ms: {phases}")
        if self.logs_texts:
            line += f", output: {self._cut(''.join(output))!r}"
        log.info("Finished request %s: %s", request_id, line)

    def pooling_received(self, request_id: str, endpoint: str) -> None:
        """An embeddings, score, rerank, classify or pooling request's arrival."""
        if self.level is not None:
            log.info("Received request %s: %s", request_id, endpoint)

    def pooling_finished(self, request_id: str, endpoint: str, status: str, e2e_seconds: float,
                         num_inputs: int | None = None, num_tokens: int | None = None) -> None:
        """Its end: `status` (finished, failed (why), cancelled), its inputs and their tokens when answered."""
        if self.level is None:
            return
        counts = "" if num_inputs is None else f", inputs={num_inputs} prompt_tokens={num_tokens}"
        log.info("Finished request %s: %s %s%s, e2e_ms=%.2f", request_id, endpoint, status, counts, e2e_seconds * 1e3)

    def _cut(self, given: str | list[int]) -> str | list[int]:
        limit = self.max_len if self.max_len is not None else PARTIAL_LEN if self.level == 2 else None
        return given if limit is None or len(given) <= limit else given[:limit]


ENV_LOG_REQUESTS = "BATON_GATEWAY_LOG_REQUESTS"
ENV_MAX_LOG_LEN = "BATON_GATEWAY_MAX_LOG_LEN"


def add_request_log_flags(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    parser.add_argument("--enable-log-requests", action="store_true",
                        help="log each request as it arrives and ends (level 1: with its sampling "
                             "parameters, without texts), as vLLM's flag does")
    parser.add_argument("--enable-log-outputs", action="store_true",
                        help="... with its prompt and output texts too (level 2), as vLLM's flag does")
    parser.add_argument("--log-requests", action="store_true",
                        help="SGLang's flag: log requests at --log-requests-level (default 2)")
    parser.add_argument("--log-requests-level", type=int, choices=LEVELS, default=None,
                        help=f"how much a request's lines say: 0 what it is (sizes, timings and where its time "
                             f"went), 1 also its sampling parameters, 2 also its texts cut to --max-log-len (default "
                             f"{PARTIAL_LEN}), 3 its texts whole (${ENV_LOG_REQUESTS}=LEVEL)")
    parser.add_argument("--max-log-len", type=int, default=env_int(env, ENV_MAX_LOG_LEN, None),
                        help=f"logged texts cut to this many characters, and id lists to this many ids "
                             f"(${ENV_MAX_LOG_LEN})")


def log_level_of(args: argparse.Namespace, env: Mapping[str, str]) -> int | None:
    """The level the flags ask for (None: no request logged)."""
    if args.log_requests_level is not None:
        return args.log_requests_level
    if args.log_requests or args.enable_log_outputs:
        return DEFAULT_LEVEL
    if args.enable_log_requests:
        return 1
    return env_int(env, ENV_LOG_REQUESTS, None)


class ConfigureLoggingRequest(BaseModel):
    """SGLang's /configure_logging body: its request-log fields (its dumps to folders are not served)."""

    model_config = ConfigDict(extra="forbid")

    log_requests: bool | None = None
    log_requests_level: Literal[LEVELS] | None = None
    dump_requests_folder: None = None
    dump_requests_threshold: None = None
    crash_dump_folder: None = None


def add_request_log_routes(app: FastAPI, request_log: RequestLog) -> None:
    async def configure_logging(request: Request) -> Response:
        body = await optional_body(request, ConfigureLoggingRequest)
        request_log.configure(body.log_requests, body.log_requests_level)
        log.info("request logging %s", "off" if request_log.level is None else f"at level {request_log.level}")
        return Response(status_code=200)

    app.add_route("/configure_logging", configure_logging, methods=["GET", "POST"])  # SGLang's, either
