"""The processes of a model split across ranks (engine/tensor_parallel.py). Rank 0 is the engine's own
ModelRunner: it schedules, samples and hands each step's inputs to the others. Ranks 1..N-1 are
processes of their own, started here, that run their share of each step's forward and nothing else.

Every rank computes in one KV pool: rank 0's, in a file of shared memory the others map (each reads
and writes its own heads of every page), so the pages of a request are whole in rank 0's process,
where prefix-cache copies and KV transfers read them.

Each rank is a `python -m engine.tensor_parallel_workers` process, not a multiprocessing child: a
spawned child imports the parent's main module again, which a script without a `__main__` guard does
not survive. Control goes over a socket pair to each (a step's inputs pickled once); the sums inside a
step are RankGroup's (engine/tensor_parallel.py).
"""
from __future__ import annotations

import atexit
import functools
import math
import multiprocessing
import os
import pickle
import subprocess
import sys
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engine.attention_metadata import AttentionMetadata
from engine.kv_pool import PoolFile
from engine.memory_release import release_pages, unique_storages
from engine.model_config import ModelConfig
from engine.prompt_embeds import GivenEmbeddings
from engine.tensor_parallel import SHARED_DIR, RankGroup, split_vocabulary_size

if TYPE_CHECKING:  # the runner starts these processes: it imports this module
    from engine.model_runner import ModelRunner

REPO_ROOT = Path(__file__).resolve().parents[1]
REPLY_POLL_SECONDS = 1.0  # how often a wait for a rank's reply checks that the rank is still alive


@dataclass(frozen=True)
class RankArgs:
    """What a rank needs to build its share of the model."""

    model_dir: str
    model_config: ModelConfig  # the whole model's
    dtype: torch.dtype
    device: str
    max_positions: int
    num_threads: int | None


@dataclass(frozen=True)
class StepInputs:
    """What a step's forward reads besides the KV pool: ModelRunner._prepare's."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    given: GivenEmbeddings | None
    # The step's LoRA adapters, each with its token rows (a rank reads one it does not hold from its directory),
    # and every adapter rank 0 holds (a rank lets go of the others): (name, serial, directory, rows), (name,
    # serial). Empty where rank 0 holds none.
    loras: tuple[tuple[str, int, str, torch.Tensor], ...] = ()
    loras_held: frozenset[tuple[str, int]] = frozenset()
    # Where the vocabulary is split: the rows of each logits call rank 0 makes of the step's hidden states, in turn
    # (each rank makes its columns of them).
    logit_rows: tuple[torch.Tensor, ...] = ()


class RankError(RuntimeError):
    """A rank failed to start, to load its weights or to map the KV pool, or exited."""


def rank_command(pipe_fd: int) -> list[str]:
    """The command line of a rank's process, told what to do over `pipe_fd`."""
    return [sys.executable, "-m", "engine.tensor_parallel_workers", str(pipe_fd)]


def start_rank_process(pipe_fd: int, env: dict[str, str]) -> subprocess.Popen:
    """A rank's process, `pipe_fd` inherited. One function so that the tests can start ranks as forks of a Python
    that has imported torch already (tests/services/preloaded_python.py)."""
    return subprocess.Popen(rank_command(pipe_fd), pass_fds=(pipe_fd,), env=env)


class RankWorkers:
    """Ranks 1..size-1, from rank 0's side: started at once (each loads its own weights while rank 0 loads
    its), then told what to do."""

    def __init__(self, size: int, store_port: int, args: RankArgs) -> None:
        self._pipes: list[Connection] = []
        self._processes: list[subprocess.Popen] = []
        self._group: RankGroup | None = None
        self._broken: str | None = None  # why the ranks can take no step (break_off)
        # `-m engine...` wherever the caller runs from, Baton installed or not.
        python_path = os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH"))))
        env = {**os.environ, "PYTHONPATH": python_path}
        for rank in range(1, size):
            ours, theirs = multiprocessing.Pipe()
            process = start_rank_process(theirs.fileno(), env)
            theirs.close()
            ours.send((rank, size, store_port, args))
            self._pipes.append(ours)
            self._processes.append(process)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    def wait_loaded(self) -> None:
        """Returns once every rank holds its weights; RankError naming the first that could not."""
        for rank in range(1, len(self._pipes) + 1):
            self._reply(rank)

    def join(self, store: dist.TCPStore) -> RankGroup:
        """Rank 0's place in the ranks' group (made at `store`), once every rank holds its weights; it closes with
        them."""
        self._group = RankGroup(0, len(self._pipes) + 1, store.port, store,
                                check_peers=functools.partial(self.raise_if_exited, 0))
        return self._group

    def start_loading(self, model_dir: str) -> None:
        """Every rank starts reading its share of `model_dir`'s checkpoint again (`wait_loaded` waits for them)."""
        self._send(("weights", model_dir))

    def release_weights(self) -> int:
        """Every rank gives its weights' memory back (engine/memory_release.py); the bytes they gave, together."""
        self._send(("release",))
        return sum(self._reply(rank) for rank in range(1, len(self._pipes) + 1))

    def shared_pool(self, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
        """A KVPool TensorFactory: the whole pool, zero-filled, in a new file of shared memory every rank maps."""
        path = os.path.join(SHARED_DIR, f"baton-kv-pool-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            _allocate(path, math.prod(shape) * torch.empty((), dtype=dtype).element_size())
            pool = _mapped_pool(PoolFile(path), shape, dtype)
            self.share_pool(PoolFile(path), shape, dtype)
        finally:
            # Mapped by every rank by now (or failed): its name is not needed, and no file outlives them.
            os.unlink(path)
        return pool

    def share_pool(self, pool: PoolFile, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Every rank maps the KV pool in `pool` (the whole of it, every head)."""
        self._send(("pool", pool, shape, dtype))
        for rank in range(1, len(self._pipes) + 1):
            self._reply(rank)

    def step(self, inputs: StepInputs) -> None:
        """Starts the other ranks on a step; their sums with rank 0's inside the forward end it."""
        if self._broken is not None:
            raise RankError(self._broken)
        self._send(("step", inputs))

    def break_off(self, reason: str) -> None:
        """Rank 0's step failed part way: the other ranks wait for sums it will never make, and every later step's
        would pair with theirs wrongly. They are killed, and each later step refused naming `reason`."""
        self._broken = f"a step failed part way ({reason}): the model's ranks are out of step; start the engine again"
        for process in self._processes:
            process.kill()
        self.close()

    def raise_if_exited(self, grace_seconds: float = 1.0) -> None:
        """RankError naming a rank that has exited (its connections close before it is gone: it gets
        `grace_seconds`)."""
        for rank, process in enumerate(self._processes, start=1):
            try:
                code = process.wait(timeout=grace_seconds)
            except subprocess.TimeoutExpired:
                continue
            raise RankError(f"tensor-parallel rank {rank} has exited (exit code {code})")

    def close(self) -> None:
        """Stops every rank; waits for them a little, then kills what is left."""
        for pipe in self._pipes:
            try:
                pipe.send_bytes(pickle.dumps(("stop",)))
            except OSError:
                pass  # exited already
        for process in self._processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for pipe in self._pipes:
            pipe.close()
        self._pipes, self._processes = [], []
        if self._group is not None:
            self._group.close()

    def _send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, pipe in enumerate(self._pipes, start=1):
            try:
                pipe.send_bytes(data)
            except OSError:
                raise RankError(f"tensor-parallel rank {rank} has exited "
                                f"(exit code {self._processes[rank - 1].poll()})") from None

    def _reply(self, rank: int):
        """What rank `rank` answered the last message with; RankError where it failed or exited."""
        pipe, process = self._pipes[rank - 1], self._processes[rank - 1]
        while not pipe.poll(REPLY_POLL_SECONDS):
            if process.poll() is not None:
                raise RankError(f"tensor-parallel rank {rank} exited (exit code {process.returncode})")
        try:
            kind, detail = pipe.recv()
        except EOFError:
            raise RankError(f"tensor-parallel rank {rank} exited (exit code {process.wait()})") from None
        if kind == "error":
            raise RankError(f"tensor-parallel rank {rank}: {detail}")
        return detail


def _allocate(path: str, num_bytes: int) -> None:
    """A new file of shared memory holding `num_bytes`, allocated now: a /dev/shm too small fails here with
    OSError, not with SIGBUS in a rank's first write to a page past its end."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, num_bytes)
    except OSError as e:
        raise OSError(e.errno, f"cannot allocate a {num_bytes}-byte KV pool in {SHARED_DIR}: {e.strerror}") from None
    finally:
        os.close(fd)


def _mapped_pool(pool: PoolFile, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The KV pool in `pool`'s file of shared memory (zeros until written)."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    mapped = torch.from_file(pool.path, shared=True, size=pool.offset + num_bytes, dtype=torch.uint8)
    return mapped[pool.offset:].view(dtype).view(shape)


def _exit_if_orphaned(parent: int) -> Callable[[], None]:
    """A RankGroup's check_peers for ranks 1..N-1: rank 0 gone (this process orphaned), this one goes too."""
    def check() -> None:
        if os.getppid() != parent:
            raise SystemExit("tensor-parallel rank 0 has exited")
    return check


def _serve_rank(pipe: Connection) -> None:
    """A rank's process: its share of the model, then steps until rank 0 stops it or goes away."""
    from engine.model_runner import ModelRunner  # here: the runner starts these processes

    rank, size, store_port, args = pipe.recv()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    try:
        # Images are encoded by rank 0, whole, and come in a step's inputs as rows of the prompt.
        runner = ModelRunner(args.model_dir, args.model_config, args.dtype, args.device, args.max_positions,
                             loads_image_encoder=False, tensor_parallel_size=size, rank=rank)
    except Exception as e:
        pipe.send(("error", f"{type(e).__name__}: {e}"))
        return
    pipe.send(("loaded", None))
    group = RankGroup(rank, size, store_port, check_peers=_exit_if_orphaned(os.getppid()))
    runner.model.sum_across_ranks(group.all_reduce, size, rank, split_vocabulary_size(args.model_config))
    try:
        _serve_steps(runner, pipe)
    finally:
        group.close()


def _serve_steps(runner: ModelRunner, pipe: Connection) -> None:
    """Rank 0's messages, each done in turn, until it says stop or goes away."""
    while True:
        try:
            message = pickle.loads(pipe.recv_bytes())
        except EOFError:  # rank 0 has gone
            return
        kind = message[0]
        if kind == "stop":
            return
        if kind == "step":
            runner.forward_shard(message[1])
        elif kind == "pool":
            _, pool_file, shape, dtype = message
            pool = _mapped_pool(pool_file, shape, dtype)
            runner.allocate_kv_pool(shape[3], shape[4], dtype, lambda *_: pool,
                                    extra_layers=shape[0] - runner.model_config.num_kv_layers)  # an EAGLE head's
            pipe.send(("attached", None))
        elif kind == "release":
            pipe.send(("released", sum(release_pages(p) for p in unique_storages(runner.model.parameters()))))
        elif kind == "weights":
            try:
                runner.load_weights(message[1])
            except Exception as e:
                traceback.print_exc()
                pipe.send(("error", f"{type(e).__name__}: {e}"))
                continue
            pipe.send(("loaded", None))


if __name__ == "__main__":
    _serve_rank(Connection(int(sys.argv[1])))
    # The interpreter's own teardown of torch and the model's modules would take most of a second more, and has
    # nothing of this process's to finish: ended here once its exit handlers have run, as multiprocessing ends its
    # children.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
