"""vLLM's `--sleep-idle-ttl`: the mesh goes to sleep (memory_release_api.py: at level 1 every worker
gives back its KV pages, at level 2 its weights too) once no request has been in flight for that
many seconds, and wakes when the next one arrives, which waits at the gateway meanwhile, as it would
for any sleep. Only a sleep begun here is ended so: one an operator asked for (/sleep, SGLang's
release) waits for their /wake_up, and a /wake_up of an idle sleep ends it as well."""
from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from services.common.settings import ConfigError, env_float
from services.gateway.errors import APIError
from services.gateway.memory_release_api import VLLM_LEVELS, MeshMemory

log = logging.getLogger("baton.gateway.idle_sleep")
ENV_SLEEP_IDLE_TTL = "BATON_GATEWAY_SLEEP_IDLE_TTL"


@dataclass(frozen=True)
class IdleSleepConfig:
    ttl_s: float = 0.0  # idle this long, the mesh sleeps; 0: never
    level: int = 1  # vLLM's sleep levels: 1 the KV cache, 2 the weights as well

    def __post_init__(self) -> None:
        if self.ttl_s < 0:
            raise ConfigError(f"--sleep-idle-ttl must be >= 0 seconds (0: never), got {self.ttl_s}")
        if self.level not in VLLM_LEVELS:
            raise ConfigError(f"--sleep-idle-level must be one of {sorted(VLLM_LEVELS)}, got {self.level}")

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
        parser.add_argument("--sleep-idle-ttl", type=float, metavar="SECONDS",
                            default=env_float(env, ENV_SLEEP_IDLE_TTL, 0.0),
                            help=f"put the mesh to sleep once no request has been in flight this long, and wake "
                                 f"it for the next (as vLLM's flag; 0: never, the default) (${ENV_SLEEP_IDLE_TTL})")
        parser.add_argument("--sleep-idle-level", type=int, default=1, choices=sorted(VLLM_LEVELS),
                            help="the level it sleeps at: 1 gives back the KV cache, 2 the weights too (default 1)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> IdleSleepConfig:
        return cls(ttl_s=args.sleep_idle_ttl, level=args.sleep_idle_level)


class IdleSleep:
    """Watches the gateway's requests (those in flight, and those held at its pause), puts the mesh to
    sleep when they have been none for `ttl_s`, and wakes it when one is held while it sleeps."""

    def __init__(self, memory: MeshMemory, config: IdleSleepConfig) -> None:
        self.memory = memory
        self.pipeline = memory.pipeline
        self.ttl_s = config.ttl_s
        self.kinds = VLLM_LEVELS[config.level]
        self.is_asleep = False  # put to sleep here, not yet woken
        self._last_busy = time.monotonic()
        self._poll_s = min(max(config.ttl_s / 10, 0.01), 5.0)
        self._lock = asyncio.Lock()  # one transition at a time: a wake waits for a sleep under way
        self._watching: asyncio.Task | None = None
        self._waking: asyncio.Task | None = None
        self.pipeline.pause.on_wait = self._wake_soon

    def start(self) -> None:
        """Watch from now (on the gateway's event loop)."""
        self._watching = asyncio.ensure_future(self._watch())

    async def aclose(self) -> None:
        for task in (self._watching, self._waking):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (self._watching, self._waking) if t is not None), return_exceptions=True)

    @property
    def _is_busy(self) -> bool:
        return self.pipeline.num_requests > 0 or self.pipeline.pause.num_waiting > 0

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a worker that failed to sleep or wake: tried again a whole ttl later
                log.warning("idle sleep: %s: %s", type(e).__name__, e)
                self._last_busy = time.monotonic()

    async def _step(self) -> None:
        if self.is_asleep:
            if not self.memory.is_sleeping:  # woken by /wake_up
                self.is_asleep, self._last_busy = False, time.monotonic()
            elif self.pipeline.pause.num_waiting:  # a wake that failed: again
                self._wake_soon()
            return
        if self._is_busy or self.memory.is_sleeping:
            self._last_busy = time.monotonic()
            return
        if time.monotonic() - self._last_busy < self.ttl_s:
            return
        async with self._lock:
            if self._is_busy or self.memory.is_sleeping:
                return
            try:
                await self.memory.release(self.kinds)
            except APIError:  # a request got in first (409)
                self._last_busy = time.monotonic()
                return
            self.is_asleep = True
            log.info("idle for %.1f s: the mesh sleeps (%s given back)", self.ttl_s, ", ".join(self.kinds))
        if self.pipeline.pause.num_waiting:  # one arrived while it fell asleep
            self._wake_soon()

    def _wake_soon(self) -> None:
        """A request waits at the pause: wake the mesh if it sleeps by this."""
        if self.is_asleep and self._waking is None:
            self._waking = asyncio.ensure_future(self._wake())

    async def _wake(self) -> None:
        try:
            async with self._lock:
                if self.is_asleep:
                    started = time.monotonic()
                    await self.memory.resume(self.kinds)
                    self.is_asleep, self._last_busy = False, time.monotonic()
                    log.info("a request came: the mesh woke in %.2f s", self._last_busy - started)
        except Exception as e:  # the watcher tries again while requests wait
            log.warning("idle sleep: waking failed: %s: %s", type(e).__name__, e)
        finally:
            self._waking = None
