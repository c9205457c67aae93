"""Executes a ScheduledBatch: builds the flat token batch, runs the model, samples."""
from __future__ import annotations

import contextlib
import functools
import os
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from engine import int4_weights, mxfp4_weights as mxfp4
from engine.attention_metadata import AttentionMetadata, PrefillChunk
from engine.batch import ScheduledBatch
from engine.checkpoint import WeightsError, checkpoint_files
from engine.fp8_weights import dequantized
from engine.kv_pool import KVPool, SharedTensorFactory, TensorFactory, pool_shape
from engine.lora import LoRAAdapter, Sharding
from engine.model_config import ModelConfig
from engine.models import MODEL_REGISTRY
from engine.prompt_embeds import GivenEmbeddings, given_in, spans_in
from engine.prompt_images import encode_pending_images, multimodal_positions
from engine.recurrent_state import StatePages, step_states, stepped_states
from engine.sampled_logprobs import reported
from engine.sampler import Sampler, SamplerOutput
from engine.sequence import Sequence
from engine.tensor_parallel import (
    check_shardable,
    checkpoint_shards,
    listening_store,
    lora_shard,
    rank_heads,
    shard_config,
    split_vocabulary_size,
)
from engine.tensor_parallel_workers import RankArgs, RankWorkers, StepInputs
from engine.vision.image_encoders import image_encoder
from engine.weights import check_every_tensor_is_read, iter_tensors, renamed
from kernels.registry import select_kernels

# Prompt rows whose logits are made at once when a prompt's logprobs are asked for: a chunk's worth
# of full-vocabulary rows (2048 x 150k floats) would take more than a gigabyte.
PROMPT_LOGPROB_ROWS = 256


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        model_config: ModelConfig,
        dtype: torch.dtype,
        device: str,
        max_positions: int,
        show_progress: bool = False,
        logprobs_mode: str = "raw_logprobs",
        loads_image_encoder: bool = True,  # False: images come as their encoder's rows alone
        tensor_parallel_size: int = 1,  # the ranks the model is split across (engine/tensor_parallel.py)
        rank: int = 0,  # this runner's; rank 0 starts the others, and alone schedules and samples
        num_threads: int | None = None,  # the other ranks' torch threads
    ) -> None:
        check_shardable(model_config, tensor_parallel_size, device)
        self.model_config = model_config  # the whole model's, even where this rank holds a share of it
        self.device = device
        self.kernels = select_kernels(device)
        self.rank, self.tensor_parallel_size = rank, tensor_parallel_size
        # Started first, so that every rank loads its weights at once.
        self.rank_workers: RankWorkers | None = None
        if rank == 0 and tensor_parallel_size > 1:
            store = listening_store(tensor_parallel_size)
            self.rank_workers = RankWorkers(tensor_parallel_size, store.port, RankArgs(
                model_dir, model_config, dtype, device, max_positions, num_threads))
            self._finalizer = weakref.finalize(self, self.rank_workers.close)
        arch = MODEL_REGISTRY[model_config.architecture]
        with torch.device(device):
            shard = shard_config(model_config, rank, tensor_parallel_size)
            self.model = arch(shard, self.kernels, dtype, max_positions)
            # What turns a request's images into rows of the prompt (a multimodal checkpoint's, where served).
            self.image_encoder = image_encoder(model_config.vision, model_config.hidden_size, dtype) \
                if model_config.vision is not None and loads_image_encoder else None
        start_ns = time.time_ns()
        start = time.perf_counter()
        self._load_shard(model_dir, show_progress)
        if self.rank_workers is not None:
            self.rank_workers.wait_loaded()
            group = self.rank_workers.join(store)
            self.model.sum_across_ranks(group.all_reduce, group.size, 0, split_vocabulary_size(model_config))
        self.weight_loading_seconds = time.perf_counter() - start
        self.weight_loading_ns = (start_ns, time.time_ns())  # wall clock, for trace spans
        self.sampler = Sampler(model_config.eos_token_ids, logprobs_mode)
        self.kv_pool: KVPool | None = None
        self.state_pages: StatePages | None = None  # a hybrid model's recurrent states, in pages of the pool
        # Each sequence's states at block ends, for its prefix cache to keep: at its steps' ends, and inside a prompt
        # chunk every `snapshot_interval` tokens (None: not kept).
        self.snapshot_interval: int | None = None
        self.loras: dict[str, LoRAAdapter] = {}  # what a request may compute with, by name (engine/lora_manager.py)
        self.dtype = dtype
        # An EAGLE head drafting for this model (engine/eagle.py): after each forward, every sequence's (first row,
        # rows) of the step, and the model's hidden states there (or the layer inputs it captured).
        self.hidden_listener: Callable[[list[tuple[Sequence, int, int]], torch.Tensor], None] | None = None

    def load_weights(self, model_dir: str) -> None:
        """Read `model_dir`'s checkpoint into the model's tensors, in place (engine/llm_engine.py's
        `update_weights` reads a later one so); every rank's share, where the model is split."""
        if self.rank_workers is None:
            self._load_shard(model_dir)
            return
        self.rank_workers.start_loading(model_dir)
        self._load_shard(model_dir)
        self.rank_workers.wait_loaded()

    def _load_shard(self, model_dir: str, show_progress: bool = False) -> None:
        """This rank's share of `model_dir`'s checkpoint (the whole of it, unsplit) into its tensors."""
        files, stored_names = checkpoint_files(model_dir), None
        if self.model_config.multimodal is not None:  # the text model's tensors, by the names the model reads
            stored_names = {}
            for name in files:
                text_name = self.model_config.multimodal.text_name(name)
                if text_name is not None:
                    stored_names[text_name] = name
            files = {text_name: files[name] for text_name, name in stored_names.items()}
        elif any(name.startswith("backbone.") for name in files):  # Nemotron-H's as released: its model `backbone.`
            stored_names = {"model." + name.removeprefix("backbone.") if name.startswith("backbone.") else name: name
                            for name in files}
            files = {model_name: files[name] for model_name, name in stored_names.items()}
        elif ("model.embed_tokens.weight" not in files and "embed_tokens.weight" in files
              and not getattr(self.model, "reads_bare_names", False)):
            # Saved as the bare model (Qwen3-Embedding's checkpoints are): read by the causal LM's names.
            stored_names = {f"model.{name}": name for name in files}
            files = {model_name: files[name] for model_name, name in stored_names.items()}
        elif getattr(self.model, "bare_model_prefix", None) and "wte.weight" in files:
            # GPT-2's releases hold its bare model (`wte`, `h.0...`): read under the causal LM's prefix.
            prefix = self.model.bare_model_prefix
            stored_names = {prefix + name: name for name in files}
            files = {model_name: files[name] for model_name, name in stored_names.items()}
        renames = getattr(self.model, "renames", ())  # its names against Llama's, as the model reads them
        if renames:
            stored_names = {renamed(name, renames): (stored_names or {}).get(name, name) for name in files}
            files = {renamed(name, renames): path for name, path in files.items()}
        # (a tensor a release may lack is filled in its place: A.X K1's router without its correction bias)
        names = [name for name in self.model.checkpoint_names() if name in files or not self.model.fill_absent(name)]
        fp8 = self.model_config.fp8_weights
        scale_names = [n + fp8.scale_suffix for n in names if n + fp8.scale_suffix in files] if fp8 else []
        if self.model_config.mxfp4_weights:  # read as their blocks, their scales beside them
            packed = set(mxfp4.packed_names(names, files))
            names = [n + mxfp4.BLOCKS if n in packed else n for n in names]
            scale_names = [n + mxfp4.SCALES for n in packed]
        int4 = self.model_config.int4_weights
        if int4:  # read as their packed numbers, their zero points and scales beside them
            packed = set(int4_weights.packed_names(names, files, int4.method))
            names = [int4_weights.packed_name(n, int4.method) if n in packed else n for n in names]
            scale_names = [part for n in packed for part in int4_weights.stored_parts(n, int4.method, files)]
            spare = int4_weights.spare_biases(packed, names, files)
            for name, bias in iter_tensors(files, spare, stored_names):
                if bias.any():
                    raise WeightsError(f"{name} is not zeros, and Baton's {self.model_config.architecture} "
                                       f"has no such bias")
            scale_names += spare
        check_every_tensor_is_read({n: f for n, f in files.items() if not self.model.is_unused_tensor(n)},
                                   names + scale_names, self.model_config.architecture)
        tensors = iter_tensors(files, names, stored_names)
        if fp8:
            tensors = dequantized(tensors, dict(iter_tensors(files, scale_names, stored_names)), fp8)
        elif self.model_config.mxfp4_weights:
            tensors = mxfp4.dequantized(tensors, dict(iter_tensors(files, scale_names, stored_names)))
        elif int4:
            tensors = int4_weights.dequantized(tensors, dict(iter_tensors(files, scale_names, stored_names)), int4)
        tensors = checkpoint_shards(tensors, self.model_config, self.rank, self.tensor_parallel_size)
        if show_progress:
            tensors = tqdm(tensors, total=len(names), desc="Loading weights", unit="tensor", leave=False)
        with torch.no_grad():
            self.model.load_weights(tensors)
            if self.image_encoder is not None:
                self._load_image_encoder(checkpoint_files(model_dir))

    def _load_image_encoder(self, files: dict[str, Path]) -> None:
        """Its tensors, by its own names (the text model's loading leaves them out), an FP8 checkpoint's
        dequantized by their scales as the text model's are. WeightsError for one it cannot read: a weight
        quantized otherwise (a packed 4-bit one is not there by its own name, an FP8 one without scales would
        be read as its raw numbers)."""
        names = {stored: name for stored in files if (name := self.image_encoder.checkpoint_name(stored)) is not None}
        tensors = dict(iter_tensors(files, list(names)))
        fp8 = self.model_config.fp8_weights
        if fp8 is not None:
            scales = {name: tensors.pop(name) for name in list(tensors) if name.endswith(fp8.scale_suffix)}
            tensors = dict(dequantized(iter(tensors.items()), scales, fp8))
        quantized = sorted(name for name, t in tensors.items() if t.dtype.is_floating_point and t.element_size() == 1)
        if quantized:
            raise WeightsError(f"{quantized[0]}: the image encoder's weights are FP8 without scales Baton reads")
        try:
            self.image_encoder.load_weights({names[stored]: tensor for stored, tensor in tensors.items()})
        except KeyError as e:
            raise WeightsError(f"the image encoder's tensor {e.args[0]} is not in the checkpoint (its vision tower "
                               "is read unquantized, or in FP8 with scales)") from None

    def allocate_kv_pool(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, tensor_factory: TensorFactory | None = None,
        shared_factory: SharedTensorFactory | None = None, extra_layers: int = 0,
    ) -> KVPool:
        """The KV pool of every head, placed by `tensor_factory` or `shared_factory` (private memory where neither
        is given); this rank computes with its own heads of it. Where the model is split, the other ranks map the
        pool too: `shared_factory`'s file, or a file of its own (ValueError for a `tensor_factory`'s).
        `extra_layers`: an EAGLE head's, in every page past the model's (engine/eagle.py)."""
        if shared_factory is not None:
            shared, pool_file = shared_factory(pool_shape(self.model_config, num_blocks, block_size, extra_layers),
                                               dtype, self.device)
            tensor_factory = lambda *_: shared  # noqa: E731
        elif self.rank_workers is not None:
            if tensor_factory is not None:
                raise ValueError("a KV pool placed in memory the other tensor-parallel ranks cannot map is not "
                                 "split across them")
            tensor_factory = self.rank_workers.shared_pool
        self.kv_pool = KVPool(self.model_config, num_blocks, block_size, dtype, self.device, tensor_factory,
                              rank_heads(self.model_config, self.rank, self.tensor_parallel_size), extra_layers)
        if shared_factory is not None and self.rank_workers is not None:
            self.rank_workers.share_pool(pool_file, self.kv_pool.tensor.shape, dtype)
        if self.model_config.state_shape is not None:
            self.state_pages = StatePages(self.model_config.state_shape, self.kv_pool.tensor)
        return self.kv_pool

    def close(self) -> None:
        """Stops the other ranks of a split model (they stop too when this process ends)."""
        if self.rank_workers is not None:
            self._finalizer()

    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], SamplerOutput | None]:
        """Runs one step; returns the sequences that were sampled and their tokens."""
        sampled_seqs, logits = self.forward(batch)
        if not sampled_seqs:
            return [], None
        return sampled_seqs, self.sampler(logits, sampled_seqs)

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor | None]:
        """Runs the model over the batch; returns the sequences whose chunk ended
        at their last token, and their next-token logits [S, V]: a drafted sequence's
        rows after its last token and after each of its drafts, in turn."""
        sampled_seqs, hidden = self.forward_hidden(batch)
        if not sampled_seqs:
            return [], None
        if self.rank_workers is None:
            return sampled_seqs, self.model.compute_logits(hidden)
        if self.model.vocabulary is not None:  # every rank makes its columns
            with self._in_step():
                return sampled_seqs, self.model.compute_logits(hidden)
        with every_core():  # the LM head is rank 0's alone, the other ranks waiting for the next step
            return sampled_seqs, self.model.compute_logits(hidden)

    @torch.inference_mode()
    def forward_hidden(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor | None]:
        """`forward`'s sequences, and the hidden states its logits are made of (an EAGLE head's own are its next
        drafts' features). A model whose vocabulary is split has its other ranks make their logits for them too:
        `forward` makes rank 0's."""
        pool = self.kv_pool
        input_ids, positions, meta, sample_rows, sampled_seqs, prompt_rows, embed_rows, token_rows, given, \
            seq_rows = self._prepare(batch, pool.block_size)
        if self.loras:
            self.model.lora_batch.active = self._lora_rows(batch)
        prompt_logprob_rows = [row for seq, first, n in prompt_rows for row in self._prompt_logprob_rows(seq, first, n)]
        logit_rows = ()  # the rows of each logits call the step makes, in turn, where every rank makes them
        if self.rank_workers is not None and self.model.vocabulary is not None:
            logit_rows = (*(torch.arange(lo, hi) for _, lo, hi, _ in prompt_logprob_rows),
                          *((sample_rows,) if sampled_seqs else ()))
        hidden = self._model_forward(input_ids, positions, meta, given, logit_rows)
        if meta.recurrent is not None:
            stepped_states(self.state_pages, meta.recurrent, seq_rows,
                           self.kv_pool.block_size if self.snapshot_interval is not None else None)
        if self.hidden_listener is not None:
            self.hidden_listener(seq_rows, self.model.captured if self.model.captured_layers else hidden)
        if prompt_logprob_rows:  # (most steps have none: no context entered for them)
            with self._in_step():
                for seq, lo, hi, position in prompt_logprob_rows:
                    self._record_prompt_logprobs(seq, hidden[lo:hi], position)
        for seq, first, last in embed_rows:
            seq.embedding = self._pooled(hidden[first:last + 1]).float().tolist()
        for seq, row, n, position in token_rows:
            if seq.token_embeddings is None:
                seq.token_embeddings = hidden.new_empty((seq.num_prompt_tokens, hidden.shape[1]), dtype=torch.float32)
            seq.token_embeddings[position:position + n] = hidden[row:row + n]
        if not sampled_seqs:
            return [], None
        return sampled_seqs, hidden[sample_rows]

    def _model_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       given: GivenEmbeddings | None, logit_rows: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        """The model's hidden states for the step, every rank computing its share where it is split (and then its
        columns of the logits at each of `logit_rows`, where its vocabulary is)."""
        if self.rank_workers is None:
            return self.model(input_ids, positions, meta, self.kv_pool.layers, given)
        loras = tuple((adapter.name, adapter.serial, str(adapter.path), rows)
                      for adapter, rows in self.model.lora_batch.active) if self.loras else ()
        held = frozenset((adapter.name, adapter.serial) for adapter in self.loras.values())
        self.rank_workers.step(StepInputs(input_ids, positions, meta, given, loras, held, logit_rows))
        with self._in_step():
            return self.model(input_ids, positions, meta, self.kv_pool.layers, given)

    @contextlib.contextmanager
    def _in_step(self) -> Iterator[None]:
        """Rank 0's part of a step the other ranks take part in (where the model is split): failing part way, it
        breaks them off, as they would wait for sums it will not make."""
        if self.rank_workers is None:
            yield
            return
        try:
            yield
        except BaseException as e:
            if isinstance(e, RuntimeError):  # a sum across ranks broke off: say which rank went, where one did
                self.rank_workers.raise_if_exited()
            self.rank_workers.break_off(f"{type(e).__name__}: {e}")
            raise

    @torch.inference_mode()
    def forward_shard(self, inputs: StepInputs) -> None:
        """A rank other than 0's share of a step's forward (its KV written, its sums made with the others')."""
        if inputs.loras_held or self.loras:
            self.model.lora_batch.active = self._rank_loras(inputs)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_pool.layers, inputs.given)
        for rows in inputs.logit_rows:  # its columns of each of rank 0's logits calls, in turn
            self.model.compute_logits(hidden[rows])

    def _rank_loras(self, inputs: StepInputs) -> list[tuple[LoRAAdapter, torch.Tensor]]:
        """A rank other than 0's share of the step's adapters, read where it does not hold them; those rank 0 no
        longer holds let go."""
        for name in [name for name, adapter in self.loras.items() if (name, adapter.serial) not in inputs.loras_held]:
            del self.loras[name]
        active = []
        for name, serial, path, rows in inputs.loras:
            if name not in self.loras or self.loras[name].serial != serial:
                self.loras[name] = LoRAAdapter.load(name, path, self.model.lora_target, self.dtype, self.device,
                                                    self.lora_sharding(), self.model.lora_matrices)
                self.loras[name].serial = serial  # rank 0's: what names this read of it
                self.model.serve_loras()
            active.append((self.loras[name], rows))
        return active

    def lora_sharding(self) -> Sharding | None:
        """This rank's share of a LoRA adapter's matrices, where the model is split (engine/lora.py)."""
        if self.tensor_parallel_size == 1:
            return None
        return functools.partial(lora_shard, config=self.model_config, rank=self.rank,
                                 size=self.tensor_parallel_size)

    def _pooled(self, rows: torch.Tensor) -> torch.Tensor:
        """A prompt's embedding from its chunk's last hidden states (an encoder's chunk is its whole prompt)."""
        pooling = self.model_config.pooling
        return rows[0] if pooling == "cls" else rows.mean(dim=0) if pooling == "mean" else rows[-1]

    @staticmethod
    def _prompt_logprob_rows(seq: Sequence, first_row: int, n: int) -> list[tuple[Sequence, int, int, int]]:
        """The logits calls for the prompt tokens a chunk of `n` rows from `first_row` predicts (row i, at position
        p, predicts the token at p + 1) and `seq` has no record of yet (a chunk run again after a preemption makes
        none): (seq, first row, end row, the first row's position) each, at most PROMPT_LOGPROB_ROWS rows."""
        first_position = seq.num_computed_tokens
        first = len(seq.prompt_logprobs) - 1 - first_position  # the first row whose token has no record
        last = min(n, seq.num_prompt_tokens - 1 - first_position)  # rows past it predict output tokens
        return [(seq, first_row + lo, first_row + min(lo + PROMPT_LOGPROB_ROWS, last), first_position + lo)
                for lo in range(max(first, 0), last, PROMPT_LOGPROB_ROWS)]

    def _record_prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor, position: int) -> None:
        """Append the records of the prompt tokens `hidden`'s rows (from `position` on) predict."""
        num_top = seq.sampling_params.prompt_logprobs
        named = list(seq.sampling_params.logprob_token_ids)  # their logprobs at every position too
        # A prompt token is drawn from nothing: its processed logits are its raw ones.
        logprobs = reported(self.model.compute_logits(hidden).float(), self.sampler.reports_logits)
        targets = seq.token_ids[position + 1:position + 1 + hidden.shape[0]]
        chosen = logprobs.gather(1, torch.tensor(targets, device=logprobs.device).unsqueeze(1)).squeeze(1).tolist()
        top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (None, None)
        named_values = logprobs[:, named].tolist() if named else None
        for r, (target, logprob) in enumerate(zip(targets, chosen)):
            record = dict(zip(top_ids[r].tolist(), top_values[r].tolist())) if num_top else {}
            record.setdefault(target, logprob)
            if named:
                record.update((t, lp) for t, lp in zip(named, named_values[r]) if t not in record)
            seq.prompt_logprobs.append(record)

    def _lora_rows(self, batch: ScheduledBatch) -> list[tuple[LoRAAdapter, torch.Tensor]]:
        """Each adapter of the step's requests, with its token rows (decodes first, as `_prepare` lays them)."""
        rows: dict[str, list[int]] = {}
        decodes = [(seq, n) for seq, n in zip(batch.seqs, batch.num_new_tokens) if _is_decode(seq, n)]
        chunks = [(seq, n) for seq, n in zip(batch.seqs, batch.num_new_tokens) if not _is_decode(seq, n)]
        start = 0
        for seq, n in decodes + chunks:
            if seq.sampling_params.lora_name is not None:
                rows.setdefault(seq.sampling_params.lora_name, []).extend(range(start, start + n))
            start += n
        return [(self.loras[name], torch.tensor(taken, dtype=torch.int64, device=self.device))
                for name, taken in rows.items()]

    def _prepare(self, batch: ScheduledBatch, block_size: int):
        decodes: list[tuple[Sequence, int]] = []
        prefills: list[tuple[Sequence, int]] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            (decodes if _is_decode(seq, n) else prefills).append((seq, n))
            if seq.pending_images:
                encode_pending_images(self.image_encoder, seq, seq.num_computed_tokens, n, self.device)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sampled_seqs: list[Sequence] = []
        # (sequence, first row, rows) of each chunk that predicts prompt tokens whose logprobs are asked for
        prompt_rows: list[tuple[Sequence, int, int]] = []
        # (embedding request, the first and last rows of its chunk: its prompt's last token's the last)
        embed_rows: list[tuple[Sequence, int, int]] = []
        # (request pooling every token, first row, rows, the first row's position) of each of its chunks
        token_rows: list[tuple[Sequence, int, int, int]] = []
        # (first row, its embeddings) of each run of prompt rows given as embeddings
        given: list[tuple[int, torch.Tensor]] = []
        # Decode rows first: one a token, each attending to its sequence's pages up to itself (a
        # drafted sequence's last token and drafts are rows of their own: speculative.py).
        context_lens: list[int] = []
        row_seqs: list[Sequence] = []
        seq_rows: list[tuple[Sequence, int, int]] = []  # each sequence's (first row, rows)
        for seq, n in decodes:
            first, c = len(input_ids), seq.num_computed_tokens
            seq_rows.append((seq, first, n))
            if seq.given_embeddings:  # a one-token prompt chunk
                given += given_in(seq.given_embeddings, first, c, n)
            for pos in range(c, c + n):
                input_ids.append(seq.token_ids[pos])
                positions.append(pos)
                slots.append(seq.block_table[pos // block_size] * block_size + pos % block_size)
                context_lens.append(pos + 1)
                row_seqs.append(seq)
            if c + n == seq.num_tokens:
                sample_rows.extend(range(first, first + n))
                sampled_seqs.append(seq)
                if seq.sampling_params.embed:  # a prompt cached but for its last token, or of one token
                    embed_rows.append((seq, first, first))
                    if seq.sampling_params.embed_tokens:  # of one token: none of it is read from a cache
                        token_rows.append((seq, first, 1, c))
            elif seq.prompt_logprobs is not None and c < seq.num_prompt_tokens - 1:  # a one-token prompt chunk
                prompt_rows.append((seq, first, 1))
        decode_tables = decode_lens = None
        if decodes:
            max_blocks = (max(context_lens) + block_size - 1) // block_size
            # Filled row by row through numpy: torch.tensor on nested lists costs ~4x more, every step.
            tables = np.zeros((len(row_seqs), max_blocks), dtype=np.int64)
            for row, seq in enumerate(row_seqs):
                used = seq.block_table[:max_blocks]
                tables[row, : len(used)] = used
            decode_tables = torch.from_numpy(tables).to(self.device)
            decode_lens = torch.tensor(context_lens, dtype=torch.int64, device=self.device)
        chunks: list[PrefillChunk] = []
        start = len(input_ids)
        for seq, n in prefills:
            c = seq.num_computed_tokens
            seq_rows.append((seq, start, n))
            if seq.given_embeddings:
                given += given_in(seq.given_embeddings, start, c, n)
            input_ids.extend(seq.token_ids[c : c + n])
            positions.extend(range(c, c + n))
            table = seq.block_table
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(c, c + n))
            chunks.append(PrefillChunk(start, start + n, c, torch.tensor(table, dtype=torch.int64, device=self.device),
                                       spans_in(seq.bidirectional_spans, c, n)))
            if seq.prompt_logprobs is not None and c < seq.num_prompt_tokens - 1:
                prompt_rows.append((seq, start, n))
            if seq.sampling_params.embed_tokens:
                token_rows.append((seq, start, n, c))
            start += n
            if c + n == seq.num_tokens:
                sample_rows.append(start - 1)
                sampled_seqs.append(seq)
                if seq.sampling_params.embed:
                    embed_rows.append((seq, start - n, start - 1))
        position_tensor = torch.tensor(positions, dtype=torch.int64, device=self.device)
        rope_positions = position_tensor
        if any(seq.rope_positions is not None for seq in batch.seqs):  # a prompt with Qwen-VL's images
            rope_positions = multimodal_positions((*decodes, *prefills), position_tensor)
        recurrent = step_states(self.state_pages, seq_rows, self.snapshot_interval) \
            if self.state_pages is not None else None
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            num_decode_tokens=len(row_seqs),
            decode_block_tables=decode_tables,
            decode_context_lens=decode_lens,
            prefills=tuple(chunks),
            positions=position_tensor,
            recurrent=recurrent,
        )
        return (
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            rope_positions,
            meta,
            torch.tensor(sample_rows, dtype=torch.int64, device=self.device),
            sampled_seqs,
            prompt_rows,
            embed_rows,
            token_rows,
            GivenEmbeddings.of(given, self.device),
            seq_rows,
        )


@contextlib.contextmanager
def every_core() -> Iterator[None]:
    """torch computes on every core of the host for a while (a split model's rank 0, which shares them with
    its other ranks, alone at work)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or threads)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _is_decode(seq: Sequence, num_new_tokens: int) -> bool:
    """Its step's tokens are decode rows: one new token, or a last token and its drafts."""
    return num_new_tokens == 1 or seq.num_draft_tokens > 0
