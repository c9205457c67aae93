"""`python -m services.<name>` for the tests, forked from one Python that has imported every
service's modules already.

Each test mesh is real processes, and each used to spend most of its start-up importing: about
3 s of CPU for torch and the engine in a prefill or decode worker, 1.5 s in a gateway, on a
2-core CI machine that runs some hundreds of them. This process imports them once; each service
the tests start is then a fork of it that runs the service's `__main__` as `python -m` does, with
its own arguments, environment, working directory and stdout/stderr pipes, and exits as the
interpreter does (threads joined, atexit handlers run, stdio flushed, SystemExit's code) but without tearing its
modules down: each fork holds every service's imports, and their teardown took 0.15 s of CPU at each of the tests'
thousand-odd exits (the entry points' own exits are `baton up`'s tests', unforked). It imports modules
only: no thread, gRPC channel or OpenMP team exists here to be forked half-made. What the forks
do share is set once per interpreter: Python's hash seed (no Baton value depends on hash():
tests/unit/test_block_hash.py runs under two seeds) and what native libraries read from the
environment as they load (GOMP_SPINCOUNT, GRPC_EXPERIMENTS: here as every service sets them).

`spawn` hands a test a `subprocess.Popen`-like handle. The service entry points themselves run
unforked too: `baton up` and its tests start `python -m services.<name>` as ever.

Protocol: the test process holds one end of a seqpacket socket pair; per spawn it sends the command (JSON)
with the child's stdout, stderr and exit-status pipes' write ends and any file descriptors passed to it
(SCM_RIGHTS; the child finds those at their numbers in the test process), and reads the
child's pid back; this process writes the child's exit code (as Popen's returncode) into its
status pipe once it has reaped it. End of file on the socket: the tests are done; this process
exits (its children, if any are left, go on as `Popen` children would).
"""
from __future__ import annotations

import atexit
import fcntl
import functools
import gc
import importlib
import importlib.util
import io
import json
import os
import runpy
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("tokenizer", "prefill", "decode", "kvstore", "gateway")
# What runs forked besides the services: a tensor-parallel rank (engine/tensor_parallel_workers.py).
FORKABLE_MODULES = frozenset({*(f"services.{name}" for name in SERVICES), "engine.tensor_parallel_workers"})
MAX_PASSED_FDS = 4
_MAX_COMMAND_BYTES = 1 << 17  # a seqpacket message: the command line and environment


class ForkedProcess:
    """The part of `subprocess.Popen` the tests use, for a child of the preloaded Python."""

    def __init__(self, args: list[str], pid: int, stdout: io.TextIOWrapper | None, stderr: io.TextIOWrapper | None,
                 status_fd: int):
        self.args = args
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._status_fd = status_fd
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        if not self._lock.acquire(blocking=False):  # another thread waits for it (as Popen.poll does)
            return self.returncode
        try:
            return self._read_status(0)
        finally:
            self._lock.release()

    def wait(self, timeout: float | None = None) -> int:
        with self._lock:
            if self._read_status(timeout) is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _read_status(self, timeout: float | None) -> int | None:
        if self.returncode is None and select.select([self._status_fd], [], [], timeout)[0]:
            status = os.read(self._status_fd, 64)
            os.close(self._status_fd)
            if not status:
                raise RuntimeError(f"the preloaded Python went away before its child {self.pid} ({self.args}) exited")
            self.returncode = int(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # exited, not yet reaped
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class PreloadedPython:
    """The preloaded process, started on the first spawn; it exits when the test process does (end of
    file on its socket)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._socket = ours
        self._lock = threading.Lock()
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.services.preloaded_python", str(theirs.fileno())],
                                     cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     pass_fds=[theirs.fileno()])
        theirs.close()

    def spawn(self, args: list[str], cwd: Path, env: dict[str, str], pass_fds: tuple[int, ...] = (),
              inherit_output: bool = False) -> ForkedProcess:
        if inherit_output:  # this process's stdout and stderr, as Popen's children without pipes get them
            (out_r, out_w), (err_r, err_w) = (None, os.dup(1)), (None, os.dup(2))
        else:
            (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
        status_r, status_w = os.pipe()
        command = json.dumps({"args": args[1:], "cwd": str(cwd), "env": env, "pass_fds": list(pass_fds)}).encode()
        try:
            with self._lock:
                socket.send_fds(self._socket, [command], [out_w, err_w, status_w, *pass_fds])
                reply = self._socket.recv(16)
            if not reply:
                raise RuntimeError(f"the preloaded Python exited ({self.proc.wait()})")
        except BaseException:
            for fd in (out_r, err_r, status_r):
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in (out_w, err_w, status_w):
                os.close(fd)
        return ForkedProcess(args, int(reply), out_r and open(out_r, encoding="utf-8"),
                             err_r and open(err_r, encoding="utf-8"), status_r)


_preloaded: PreloadedPython | None = None
_preloaded_lock = threading.Lock()


def forkable(args: list[str]) -> bool:
    """`python -m services.<name> ...`, a tensor-parallel rank or `python -c CODE ...`: what the preloaded Python
    runs (where the kernel gives process file descriptors, Linux 5.4 and later, by which it waits for its
    children)."""
    return len(args) >= 3 and args[0] == sys.executable and _has_pidfds() and (
        args[1] == "-c" or (args[1] == "-m" and args[2] in FORKABLE_MODULES))


@functools.cache
def _has_pidfds() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return hasattr(os, "P_PIDFD")


def spawn(args: list[str], cwd: Path = REPO_ROOT, env: dict[str, str] | None = None, pass_fds: tuple[int, ...] = (),
          inherit_output: bool = False):
    """`subprocess.Popen(args, cwd=cwd, env=env, pass_fds=pass_fds, stdout=PIPE, stderr=PIPE, text=True)` (without
    the pipes where `inherit_output`), forked from the preloaded Python where it runs the command (else started
    so)."""
    global _preloaded
    if len(pass_fds) > MAX_PASSED_FDS:
        raise ValueError(f"at most {MAX_PASSED_FDS} file descriptors pass to a forked child, not {len(pass_fds)}")
    if not forkable(args):
        pipe = None if inherit_output else subprocess.PIPE
        return subprocess.Popen(args, cwd=cwd, env=env, pass_fds=pass_fds, stdout=pipe, stderr=pipe, text=True)
    with _preloaded_lock:
        if _preloaded is None or _preloaded.proc.poll() is not None:
            _preloaded = PreloadedPython()
        preloaded = _preloaded
    return preloaded.spawn(args, cwd, dict(os.environ if env is None else env), pass_fds, inherit_output)


# The preloaded process's side.

def _serve(control: socket.socket) -> dict | None:
    """Fork a child per command; report each one's exit. Returns the command in a child, None at the end."""
    status_fds: dict[int, int] = {}  # pidfd -> the child's status pipe
    with selectors.DefaultSelector() as selector:
        selector.register(control, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is control:
                    message, fds, _, _ = socket.recv_fds(control, _MAX_COMMAND_BYTES, 3 + MAX_PASSED_FDS)
                    if not message:
                        return None
                    command = json.loads(message)
                    out_w, err_w, status_w, *passed = fds
                    sys.stdout.flush()
                    sys.stderr.flush()
                    pid = os.fork()
                    if pid == 0:
                        for fd in (*status_fds, *status_fds.values(), status_w):
                            os.close(fd)
                        control.close()  # and the selector, on the way out
                        os.dup2(out_w, 1)
                        os.dup2(err_w, 2)
                        os.close(out_w)
                        os.close(err_w)
                        _place_passed_fds(passed, command["pass_fds"])
                        return command
                    for fd in (out_w, err_w, *passed):
                        os.close(fd)
                    pidfd = os.pidfd_open(pid)
                    status_fds[pidfd] = status_w
                    selector.register(pidfd, selectors.EVENT_READ)
                    control.send(str(pid).encode())
                else:
                    pidfd = key.fileobj
                    selector.unregister(pidfd)
                    waited = os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
                    returncode = waited.si_status if waited.si_code == os.CLD_EXITED else -waited.si_status
                    status_w = status_fds.pop(pidfd)
                    os.close(pidfd)
                    os.write(status_w, str(returncode).encode())
                    os.close(status_w)


def _place_passed_fds(received: list[int], numbers: list[int]) -> None:
    """Each received file descriptor at the number it had in the test process, as Popen's pass_fds keeps them (the
    child is told its number). Moved above every wanted number first, so that none is overwritten before it moves."""
    above = max(numbers, default=0) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, above) for fd in received]
    for fd in received:
        os.close(fd)
    for fd, number in zip(moved, numbers, strict=True):
        os.dup2(fd, number)
        os.close(fd)


def _run(command: dict, grpc_env, openmp_env) -> None:
    """Run the command as `python ARGS` would, in this (forked) interpreter."""
    os.chdir(command["cwd"])
    os.environ.clear()
    os.environ.update(command["env"])
    flag, target, *args = command["args"]
    # What the service's own first imports set in its environment (they ran here once, before the fork).
    importlib.reload(grpc_env)
    if flag == "-c" or target in ("services.prefill", "services.decode"):
        importlib.reload(openmp_env)
    if flag == "-c":
        sys.argv = ["-c", *args]
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        sys.argv = [target, *args]  # run_module puts the module's path first, as -m does
        runpy.run_module(target, run_name="__main__", alter_sys=True)


def main() -> None:
    # First, as in every service's __main__: before grpc (and, for the workers, torch) loads.
    from services.common import grpc_env, openmp_env
    for name in SERVICES:
        importlib.import_module(f"services.{name}.__main__")
        del sys.modules[f"services.{name}.__main__"]  # run afresh as __main__, as runpy wants it
        # A worker's __main__ imports its service (torch and the engine) only once its flags are read.
        if importlib.util.find_spec(f"services.{name}.service") is not None:
            importlib.import_module(f"services.{name}.service")
    control = socket.socket(fileno=int(sys.argv[1]))
    command = _serve(control)
    if command is not None:
        _run_and_exit(command, grpc_env, openmp_env)


def _run_and_exit(command: dict, grpc_env, openmp_env) -> None:
    try:
        _run(command, grpc_env, openmp_env)
        code = 0
    except SystemExit as e:
        code = _system_exit_code(e)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # what finalizing does first, then the atexit handlers
    atexit._run_exitfuncs()
    # A file left open is written out as finalizing would (20 ms: the heap's objects looked over once), stdio last.
    for obj in gc.get_objects():  # by exact type: isinstance would ask some objects' __class__ (torch's warn)
        if type(obj) in (io.BufferedWriter, io.TextIOWrapper) and obj is not sys.stdout and obj is not sys.stderr:
            _flush(obj)
    _flush(sys.stdout)
    _flush(sys.stderr)
    os._exit(code)


def _flush(stream) -> None:
    try:
        if not stream.closed:
            stream.flush()
    except (OSError, ValueError):
        pass


def _system_exit_code(e: SystemExit) -> int:
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    main()
