"""`baton bench` as a user runs it: a subprocess against a real mesh, or against nothing."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from cli import main
from tests.services.service_process import REPO_ROOT

NUM_REQUESTS = 12
PROMPT_LEN = 64
OUTPUT_LEN = 8


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", "bench", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout)


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


def test_bench_a_mesh_with_a_shared_prefix(mesh, tmp_path):
    plot_dir = tmp_path / "plots"
    args = ["--base-url", f"{mesh.gateway.base_url}/v1", "--num-requests", str(NUM_REQUESTS),
            "--prompt-len", str(PROMPT_LEN), "--output-len", str(OUTPUT_LEN), "--shared-prefix-ratio", "0.5",
            "--concurrency", "1", "--request-rate", "inf,50", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000",
            "--json"]
    try:
        import matplotlib  # noqa: F401
        args += ["--plot", str(plot_dir)]
    except ImportError:
        plot_dir = None
    done = bench(*args)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)  # stdout holds the JSON document alone
    assert doc["model"] == mesh.model_name  # learnt from GET /v1/models
    assert doc["workload"]["prompt_format"] == "ids"
    assert [run["request_rate"] for run in doc["runs"]] == [None, 50.0]
    for run in doc["runs"]:
        assert (run["num_requests"], run["completed"], run["num_errors"], run["errors"]) == (NUM_REQUESTS,
                                                                                             NUM_REQUESTS, 0, {})
        assert run["max_concurrency"] == 1
        # Token-id prompts and ignore_eos: every length is exact.
        assert run["total_input_tokens"] == NUM_REQUESTS * PROMPT_LEN
        assert run["total_output_tokens"] == NUM_REQUESTS * OUTPUT_LEN
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert 0 <= run[name]["min"] <= run[name]["p50"] <= run[name]["p95"] <= run[name]["p99"]
        assert run["e2e_ms"]["min"] >= run["ttft_ms"]["min"]
        # One prefix of 32 tokens (two blocks of 16) for all: every request after the first finds it cached.
        assert (NUM_REQUESTS - 1) * PROMPT_LEN // 2 <= run["total_cached_tokens"] < run["total_input_tokens"]
        assert run["slo_attainment"] == 1.0 and run["goodput_rps"] == pytest.approx(run["request_throughput"])
    # Every run met the SLO: goodput is the highest rate, the run at "inf" counting at the rate it reached.
    unbounded = doc["runs"][0]["request_throughput"]
    assert doc["goodput"] == {"attainment_target": 0.9, "request_rate": max(50.0, unbounded)}
    if plot_dir is not None:
        names = sorted(p.name for p in plot_dir.iterdir())
        assert names == ["e2e.png", "itl.png", "tpot.png", "ttft.png"]
        assert all((plot_dir / n).read_bytes().startswith(b"\x89PNG") for n in names)


def test_human_report_of_a_chat_run(mesh):
    done = bench("--base-url", f"{mesh.gateway.base_url}/v1", "--model", mesh.model_name, "--endpoint", "chat",
                 "--num-requests", "4", "--prompt-len", "16", "--output-len", "4", "--concurrency", "2")
    assert done.returncode == 0, done.stderr
    assert "Requests sent / completed / failed:" in done.stdout and "4 / 4 / 0" in done.stdout
    assert "TTFT" in done.stdout and "Traceback" not in done.stderr


def test_nothing_listening_counts_errors_without_a_traceback():
    done = bench("--base-url", closed_port_url(), "--model", "m", "--num-requests", "3", "--json")
    assert done.returncode == 1
    run = json.loads(done.stdout)["runs"][0]
    assert (run["completed"], run["num_errors"], run["errors"]) == (0, 3, {"ConnectError": 3})
    assert run["ttft_ms"] is None
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"baton bench: every request failed at all at once: ConnectError x3 ({run['error_examples']['ConnectError']})"]


def test_nothing_listening_without_a_model_is_one_line(capsys):
    assert main(["bench", "--base-url", closed_port_url()]) == 2
    err = capsys.readouterr().err
    assert err.startswith("baton: error: cannot learn the model from http://127.0.0.1:")
    assert err.count("\n") == 1 and "pass --model" in err


@pytest.mark.parametrize("args, message", [
    (["--prompt-len", "zipf:2"], "unknown length distribution"),
    (["--request-rate", "0"], "request rate must be above 0"),
    (["--concurrency", "1.5"], "--concurrency takes whole numbers"),
    (["--endpoint", "chat", "--prompt-format", "ids"], "chat takes text prompts only"),
    (["--shared-prefix-ratio", "2"], "shared-prefix ratio must be in [0, 1]"),
    (["--extra-body", "[1]"], "--extra-body must be a JSON object"),
    (["--percentiles", "50,101"], "percentiles must be within [0, 100]"),
])
def test_bad_flags_fail_before_any_request(capsys, args, message):
    assert main(["bench", "--base-url", closed_port_url(), "--model", "m", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("baton: error: ") and message in err and err.count("\n") == 1
