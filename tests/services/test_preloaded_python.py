"""The tests start services as forks of one preloaded Python (preloaded_python.py): a fork must run a
command as a fresh `python` process would, and report its end as `subprocess.Popen` does."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.services.preloaded_python import forkable, spawn

# Arguments, working directory, environment, both streams, a non-daemon thread the interpreter waits
# for, an atexit handler, a file written and never closed, and an ending.
_SCRIPT = """
import atexit, os, sys, threading, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("PRELOADED_CHECK"), os.environ.get("HOME"))
print("to stderr", file=sys.stderr)
atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread finished"))).start()
sys.left_open = open("written", "w")  # held to the end, as a service's module might hold it
sys.left_open.write("never closed")
"""


@pytest.mark.parametrize("ending, code", [("sys.exit(3)", 3), ("sys.exit('a message')", 1), ("pass", 0),
                                          ("raise ValueError('uncaught')", 1)])
def test_a_forked_command_runs_and_exits_as_a_fresh_python_does(tmp_path, ending, code):
    args = [sys.executable, "-c", _SCRIPT + ending, "one", "two words"]
    env = {"PRELOADED_CHECK": "given", "PATH": "/usr/bin"}
    assert forkable(args)
    (tmp_path / "fresh").mkdir()
    (tmp_path / "forked").mkdir()
    fresh = subprocess.run(args, cwd=tmp_path / "fresh", env=env, capture_output=True, text=True, timeout=30)
    forked = spawn(args, cwd=tmp_path / "forked", env=env)
    assert forked.wait(timeout=30) == fresh.returncode == code
    assert forked.stdout.read().replace(str(tmp_path / "forked"), str(tmp_path / "fresh")) == fresh.stdout
    forked_stderr = forked.stderr.read()
    if ending.startswith("raise"):  # the traceback's frames above the command's are the fork's own
        assert forked_stderr.endswith("ValueError: uncaught\n") and fresh.stderr.endswith("ValueError: uncaught\n")
    else:
        assert forked_stderr == fresh.stderr
    assert "thread finished\natexit ran" in fresh.stdout and str(tmp_path) in fresh.stdout
    assert (tmp_path / "forked" / "written").read_text() == (tmp_path / "fresh" / "written").read_text() == \
        "never closed"


def test_a_signalled_fork_has_popens_negative_returncode():
    forked = spawn([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"])
    assert forked.stdout.readline() == "up\n"
    assert forked.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        forked.wait(timeout=0.1)
    forked.send_signal(signal.SIGKILL)
    assert forked.wait(timeout=10) == -signal.SIGKILL
    forked.terminate()  # after its end: nothing to signal, as with Popen


def test_other_commands_start_as_plain_processes():
    assert not forkable([sys.executable, "-m", "cli", "up"])
    done = spawn([sys.executable, "-m", "cli", "--help"])
    assert isinstance(done, subprocess.Popen) and done.wait(timeout=60) == 0
    done.stdout.close()
    done.stderr.close()


def test_passed_descriptors_are_at_their_numbers_and_output_is_inherited(capfd):
    """As Popen's pass_fds: a tensor-parallel rank is told its pipe's number (tests/parity/conftest.py's
    forked_ranks)."""
    pipes = [os.pipe() for _ in range(3)]
    write_ends = tuple(w for _, w in reversed(pipes))
    code = ("import os, sys\n"
            "for fd in map(int, sys.argv[1:]):\n"
            "    os.write(fd, str(fd).encode())\n"
            "print('on our stdout', flush=True)\n")
    forked = spawn([sys.executable, "-c", code, *map(str, write_ends)], pass_fds=write_ends, inherit_output=True)
    assert forked.stdout is None and forked.wait(timeout=30) == 0
    for r, w in pipes:
        os.close(w)
        assert os.read(r, 64) == str(w).encode()
        os.close(r)
    assert "on our stdout" in capfd.readouterr().out


def test_a_fork_has_every_services_modules_imported_already():
    """What the preloading is for: a worker's own modules (torch and the engine, which its __main__ imports only
    once its flags are read) are in the fork before it runs, not imported again by each one."""
    services = ("services.prefill.service", "services.decode.service", "services.kvstore.service",
                "services.gateway.http_app", "torch", "engine.llm_engine")
    forked = spawn([sys.executable, "-c", f"import sys; print(*[m in sys.modules for m in {services!r}])"])
    assert forked.wait(timeout=60) == 0
    assert forked.stdout.read().split() == ["True"] * len(services)
