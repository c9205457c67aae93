"""`baton up` as a subprocess for benchmarks: started, read until it is up, stopped."""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 300


def log(message: str) -> None:
    # The load average says how much a neighbour may have skewed what was just measured.
    print(f"{message}  [load {os.getloadavg()[0]:.2f}]", flush=True)


class LocalMesh:
    """`baton up --model DIR --port 0 *up_args`, its services configured further through
    BATON_* variables in `env`. Its OpenAI address, gRPC address and model name come from
    the banner, every process's address, process id and metrics address from the table after it."""

    def __init__(self, model_dir: Path, *up_args: str, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "up", "--model", str(model_dir), "--port", "0", *up_args],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env={**os.environ, **(env or {})})
        self.addresses: dict[str, str] = {}
        self.pids: dict[str, int] = {}
        self.metrics_addresses: dict[str, str] = {}
        deadline = time.monotonic() + START_TIMEOUT_S
        is_up = False  # the table follows the banner; the services' own lines come before it
        for line in self.proc.stdout:
            if match := re.match(r"Baton is up: OpenAI API at http://(\S+)/v1 \(model (.+)\); gRPC Generate at (\S+)",
                                 line):
                self.http, self.model_name, self.grpc = match.groups()
                is_up = True
            elif is_up and (match := re.match(r"\s+(\S+)\s+(\d+)\s+(\S+?),?\s", line)):
                name, pid, address = match.groups()
                self.pids[name] = int(pid)
                if re.fullmatch(r"\d+\.\d+\.\d+\.\d+:\d+", address):
                    self.addresses[name] = address
                if metrics := re.search(r"(\S+) \(metrics\)", line):
                    self.metrics_addresses[name] = metrics.group(1)
            elif line.startswith("Stop with Ctrl-C"):
                break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"baton up did not come up in {START_TIMEOUT_S} s")
        else:
            raise RuntimeError(f"baton up exited with {self.proc.wait()}")
        # Keep reading its output, so a full pipe never stalls the services.
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)


def completion_body(mesh: LocalMesh, prompt: list[int], max_tokens: int) -> dict:
    """A streamed greedy completion of `prompt`, every token generated (no early EOS)."""
    return {"model": mesh.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}


def streamed_ttft(client: httpx.Client, mesh: LocalMesh, prompt: list[int], max_tokens: int = 2) -> float:
    """Seconds from sending a streamed greedy completion of `prompt` to its first chunk (read to the end),
    by httpx, as the `openai` client sends it."""
    start = time.perf_counter()
    first = None
    with client.stream("POST", f"http://{mesh.http}/v1/completions",
                       json=completion_body(mesh, prompt, max_tokens)) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    return first


def streamed_ttft_stdlib(conn: http.client.HTTPConnection, mesh: LocalMesh, prompt: list[int], request_id: str,
                         max_tokens: int = 2) -> float:
    """The same by the standard library's HTTP client, whose own cost is a fraction of httpx's: on
    this VM httpx (building the request, h11 parsing the response) took about 1.3 ms more of a
    request's time to its first chunk, paired request by request with the same mesh. The
    gateway names the request `request_id` (its `x-request-id`), e.g. to read its ledger."""
    body = json.dumps(completion_body(mesh, prompt, max_tokens))
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body,
                 headers={"content-type": "application/json", "x-request-id": request_id})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    first = None
    while line := response.readline():
        if first is None and line.startswith(b"data: {"):
            first = time.perf_counter() - start
    return first
