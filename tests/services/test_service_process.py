"""The tests' service starter (service_process.py) reads a service's log as it comes: a service that
logs more than a pipe holds must not block on its next line, and what it logged stays readable."""
from __future__ import annotations

import sys

from services.tokenizer.servicer import SERVICE_NAME as TOKENIZER_SERVICE
from tests.services.service_process import ServiceProcess

PIPE_BYTES = 64 * 1024
# The tokenizer service, after logging four pipes' worth (a worker's log of a long test).
_CHATTY_TOKENIZER = f"""
import sys
for _ in range({4 * PIPE_BYTES // 100}):
    print("x" * 99, file=sys.stderr)
print("done chattering", file=sys.stderr, flush=True)
from services.tokenizer.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_service_that_logs_more_than_a_pipe_holds_still_starts_and_its_log_is_kept(tiny_demo_model):
    svc = ServiceProcess("tokenizer", TOKENIZER_SERVICE, tiny_demo_model,
                         command=[sys.executable, "-c", _CHATTY_TOKENIZER])
    try:
        assert svc.address  # its listening line came after the log's 256 KiB
    finally:
        assert svc.terminate() == 0
    logged = svc.stderr_text()
    assert len(logged) > 4 * PIPE_BYTES - 100 and "done chattering" in logged
