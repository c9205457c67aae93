"""`RequestDeltas`: one request's steps, as its workers give them, made into the `Delta`s its
client gets: the text detokenized and cut at stop strings (by a `TextOutput`, made once the prompt
is on its way: not on its critical path), the prompt and its logprobs with the first delta, the
usage and the timing with the last.

Each step is counted (`RequestTimer`) and marked on the request's ledger (`PhaseClock`) as it
arrived, but only once it is handed out: the histograms and the workers' figures are not on the
tokens' way. The last is counted before it goes out: its consumer may close the stream there."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from protos import common_pb2
from services.common.metrics import RequestTimer
from services.gateway.deltas import Delta, TextOutput, Usage
from services.gateway.request_timing import request_timing
from services.gateway.request_trace import RequestTrace
from services.gateway.timeline import PhaseClock
from services.gateway.worker_steps import Progress, Step


class RequestDeltas:
    def __init__(self, make_output: Callable[[], TextOutput], prompt: Sequence[int],
                 params: common_pb2.SamplingParams, timer: RequestTimer, clock: PhaseClock, spans: RequestTrace,
                 progress: Progress) -> None:
        self._make_output = make_output
        self.output: TextOutput | None = None
        self.prompt = prompt
        self.params = params
        self.timer = timer
        self.clock = clock
        self.spans = spans
        self.progress = progress
        self.is_past_first = False  # its first delta has been handed out

    def start(self) -> bool:
        """Make the text output, once the prompt is on its way; False if it was made already (the prompt
        went to another prefill worker after the first went away)."""
        if self.output is not None:
            return False
        self.output = self._make_output()
        return True

    def of(self, step: Step, arrived: float) -> Delta:
        """The delta of `step`, which arrived at `arrived` (a `time.perf_counter()`). The last one (a
        finish reason, or its text stopped here) is counted and marked already."""
        output = self.output
        text = output.add(step.token_ids, is_stopped_by_last=step.finish_reason == "stop")
        if output.stops.is_stopped or step.finish_reason is not None:
            return self._last(step, text, arrived)
        if self.is_past_first:
            return Delta(text, step.token_ids, step.logprobs, arrived=arrived)
        self.spans.first_token()
        return Delta(text, step.token_ids, step.logprobs, prompt_token_ids=self.prompt,
                     prompt_logprobs=step.prompt_logprobs, arrived=arrived)

    def handed_out(self, step: Step, arrived: float) -> None:
        """Count and mark `step` (not the last) now that its delta is out."""
        step.settle(self.clock, arrived)
        self.timer.add_tokens(len(step.token_ids), arrived)
        self.clock.mark("detokenize_egress" if self.is_past_first else "first_token")
        self.is_past_first = True

    def _last(self, step: Step, text: str, arrived: float) -> Delta:
        output, timer, clock, progress = self.output, self.timer, self.clock, self.progress
        timer.add_tokens(len(step.token_ids), arrived)
        if not output.stops.is_stopped:
            text += output.finish()
        progress.is_stopped_here = step.finish_reason is None
        usage = Usage(len(self.prompt), output.num_tokens, progress.num_cached_tokens)
        last = output.last_delta(text, step.token_ids, step.logprobs, step.finish_reason, usage)
        if not self.is_past_first:
            last.prompt_token_ids, last.prompt_logprobs = self.prompt, step.prompt_logprobs
        self.spans.finish_reason(last.finish_reason, progress.num_cached_tokens)
        step.settle(clock, arrived)
        last.timing, last.spec_decode, last.arrived = request_timing(clock, timer), step.spec_decode, arrived
        timer.finish(last.finish_reason, last.timing.scheduled_at, self.params.max_tokens)
        if not self.is_past_first:
            clock.handing_out = "first_token"
        return last
