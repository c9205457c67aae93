"""The Prefill gRPC service (protos/prefill.proto) over one EngineLoop.

One call: validate, run the prompt as a prefill-only request (the engine chunks it
and batches it with others), then write its held pages into the KV target and
release them. The pages are released on every path: success, a failed write, an
error and client cancellation (which also aborts a prompt still computing).

Status codes:
- INVALID_ARGUMENT: empty request id, no tokens, a token outside the vocabulary, a
  prompt longer than the context, sampling values out of range, a request id in use,
  a target missing its shm name or layout, or too few (or bad) target blocks.
- FAILED_PRECONDITION: the target's layout or model fingerprint is not ours, or its
  segment does not exist or disagrees with its layout (checked before computing).
- UNIMPLEMENTED: a transport other than SHARED_MEMORY (for now).
- UNAVAILABLE: the engine is still loading and warming up.
- ABORTED: the request was aborted in the engine.

Timings: `queue_seconds` runs from the call's arrival until the engine thread took
the request (validation, attaching, waiting out the step in progress);
`prefill_seconds` from then until the first token (it includes any wait for a batch
slot: the engine does not report when a request was first scheduled);
`kv_transfer_seconds` is the page copy.

The copy runs on a worker thread, not the engine thread: held pages are neither
reallocated nor written until `release`, so the copy is safe there, and the engine
keeps stepping other requests meanwhile instead of stalling the batch for it.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
import torch

from protos import common_pb2, prefill_pb2, prefill_pb2_grpc
from services.common.engine_loop import EngineLoop
from services.kvstore.layout import LayoutMismatchError, PageLayout
from services.kvstore.shared_memory import SharedKVPool
from services.prefill.converters import layout_from_proto, response_from_output, sampling_params_from_proto
from services.prefill.kv_writer import SharedMemoryTargets, write_pages

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name
log = logging.getLogger("baton.prefill")

_LATER_TRANSPORTS = {
    common_pb2.KV_TRANSPORT_GRPC_STREAM: "GRPC_STREAM",
    common_pb2.KV_TRANSPORT_CUDA_IPC: "CUDA_IPC",
}


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    """`attach` is called once the engine is loaded; until then every call is UNAVAILABLE."""

    def __init__(self) -> None:
        self.engine_loop: EngineLoop | None = None
        self.layout: PageLayout | None = None
        self.vocab_size = 0
        self._pool_tensor: torch.Tensor | None = None  # our KV pool [L, 2, Hkv, N, bs, D]
        self._targets: SharedMemoryTargets | None = None

    def attach(self, engine_loop: EngineLoop, pool_tensor: torch.Tensor, layout: PageLayout,
               vocab_size: int) -> None:
        self.engine_loop = engine_loop
        self._pool_tensor = pool_tensor
        self.layout = layout
        self.vocab_size = vocab_size
        self._targets = SharedMemoryTargets(layout)

    def close(self) -> None:
        """Unmap the decode pools; after the server stopped (no copy in flight)."""
        if self._targets is not None:
            self._targets.close()
        self._pool_tensor = None

    async def _ready(self, context) -> EngineLoop:
        if self.engine_loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill engine is still loading")
        return self.engine_loop

    async def Prefill(self, request, context):
        arrival = time.perf_counter()
        engine_loop = await self._ready(context)
        request_id = request.request_id
        prompt = list(request.token_ids)
        if not request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
        if not prompt:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "token_ids must not be empty")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        try:
            params = sampling_params_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        num_blocks = -(-len(prompt) // self.layout.block_size)
        target, dst_blocks = await self._target(request.target, num_blocks, context)

        is_added = True  # unknown until `add_request` returns: cancelled meanwhile, it may have run
        pending_copy: asyncio.Future | None = None
        try:
            try:
                outputs = await engine_loop.add_request(request_id, prompt, params, prefill_only=True)
            except ValueError as e:
                is_added = False
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            accepted = time.perf_counter()
            out = await outputs.get()
            computed = time.perf_counter()
            if isinstance(out, Exception):
                await context.abort(grpc.StatusCode.INTERNAL, f"the prefill engine failed: {out}")
            if out.finish_reason == "abort":
                await context.abort(grpc.StatusCode.ABORTED, f"request {request_id!r} was aborted")
            num_bytes = 0
            if out.finish_reason == "prefilled":
                src_blocks = (await engine_loop.held_block_ids(request_id))[:num_blocks]
                # Shielded: a cancelled call must not release the pages while the thread still reads them.
                pending_copy = asyncio.get_running_loop().run_in_executor(
                    None, write_pages, self._pool_tensor, src_blocks, target, dst_blocks)
                try:
                    num_bytes = await asyncio.shield(pending_copy)
                except ValueError as e:  # refused before writing anything (copy_pages checks first)
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot write the KV target: {e}")
            done = time.perf_counter()
            timings = prefill_pb2.PrefillTimings(queue_seconds=accepted - arrival, prefill_seconds=computed - accepted,
                                                 kv_transfer_seconds=done - computed, kv_transfer_bytes=num_bytes)
            return response_from_output(out, params.logprobs, timings)
        finally:
            if is_added:
                self._release_after(request_id, pending_copy)

    def _release_after(self, request_id: str, pending_copy: asyncio.Future | None) -> None:
        """Abort or release `request_id` in the engine, once no copy reads its pages any more."""
        if pending_copy is None or pending_copy.done():
            self.engine_loop.cancel_soon(request_id)
        else:
            pending_copy.add_done_callback(lambda _: self.engine_loop.cancel_soon(request_id))

    async def _target(self, target: prefill_pb2.KVTarget, num_blocks: int, context
                      ) -> tuple[SharedKVPool, list[int]]:
        """The attached target pool and the first `num_blocks` target block ids; aborts the call if unusable."""
        if target.transport in _LATER_TRANSPORTS:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                f"KV transport {_LATER_TRANSPORTS[target.transport]} is not implemented yet; "
                                "use SHARED_MEMORY")
        if target.transport != common_pb2.KV_TRANSPORT_SHARED_MEMORY:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"target.transport must be set, got {target.transport}")
        if not target.HasField("layout"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "target.layout must be set")
        try:
            self.layout.check_compatible(layout_from_proto(target.layout, num_blocks=1))
        except ValueError as e:  # LayoutMismatchError, or a layout that is not one at all
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"the KV target does not match this prefill worker: {e}")
        if not target.shm_name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "target.shm_name must be set for SHARED_MEMORY")
        if len(target.block_ids) < num_blocks:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the prompt needs {num_blocks} KV blocks, the target has {len(target.block_ids)}")
        dst_blocks = list(target.block_ids[:num_blocks])
        if len(set(dst_blocks)) != len(dst_blocks):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "target.block_ids has duplicates")
        try:
            pool = self._targets.attach(target.shm_name)
        except (FileNotFoundError, LayoutMismatchError) as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot attach the KV target: {e}")
        bad = next((b for b in dst_blocks if not 0 <= b < pool.num_blocks), None)
        if bad is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"target block id {bad} is outside the target pool [0, {pool.num_blocks})")
        return pool, dst_blocks
