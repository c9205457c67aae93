"""The gateway's HTTP address, once printed, takes connections: a client (or `baton up`) that
connects the moment it reads the line waits in the backlog instead of being refused."""
from __future__ import annotations

import socket
import subprocess
import sys

from tests.services.service_process import REPO_ROOT, read_line, stop_process


def test_a_connection_made_as_the_address_is_printed_is_not_refused(tiny_demo_model):
    # Workers that are not there: the gateway binds and prints before it reaches any of them.
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.gateway", "--model", str(tiny_demo_model), "--tokenizer", "127.0.0.1:9",
         "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:9", "--port", "0", "--http-port", "0"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        read_line(proc, "gateway listening on ")
        host, port = read_line(proc, "gateway http listening on ").rsplit(":", 1)
        socket.create_connection((host, int(port)), timeout=5).close()
    finally:
        stop_process(proc)
