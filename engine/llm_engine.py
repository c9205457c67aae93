"""`LLMEngine`: add_request → step → outputs, over one model directory."""
from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from engine import offline_generation, weight_update
from engine.admission import check_new_request, check_reservation, salted
from engine.block_manager import BlockManager
from engine.checkpoint import kv_fingerprint
from engine.config import EngineConfig
from engine.continued_requests import prefilled_sequence, resume_guide
from engine.draft_model import DraftModel
from engine.drafters import make_drafter
from engine.dtypes import TORCH_DTYPES, kv_cache_dtype
from engine.guided_decoding import GuideFactory
from engine.host_memory import retain_freed_memory
from engine.kv_pool import SharedTensorFactory, TensorFactory, device_pool_bytes, num_pool_blocks
from engine.lora_manager import LoRAManager
from engine.model_config_loader import load_model_config
from engine.model_runner import ModelRunner
from engine.output_streams import OutputStreams, computed_pages
from engine.outputs import ComputedPages, RequestOutput
from engine.prompt_embeds import WithheldEmbeddings
from engine.prompt_images import ImageInput, WithheldImage, placed_images
from engine.recurrent_state import check_state_pages, settle_draft_states
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.state_snapshots import StateSnapshots, keep_state_snapshots
from engine.step_times import sequences_to_time
from engine.vocabulary import load_tokenizer, vocabulary_ids


class LLMEngine:
    def __init__(self, config: EngineConfig, kv_tensor_factory: TensorFactory | None = None,
                 kv_shared_factory: SharedTensorFactory | None = None) -> None:
        """`kv_tensor_factory` places the KV pool's one tensor, or `kv_shared_factory` places it in a file of
        shared memory that the model's other tensor-parallel ranks map too (a decode worker's); by default it is
        private, zero-filled memory (shared with the other ranks where the model is split)."""
        start = time.perf_counter()
        start_ns = time.time_ns()
        self.config = config
        # A model split across ranks on one host: each rank its share of the cores, unless told.
        num_threads = config.num_threads or (
            max(1, (os.cpu_count() or 1) // config.tensor_parallel_size) if config.tensor_parallel_size > 1 else None)
        if num_threads:
            torch.set_num_threads(num_threads)
        if config.seed is not None:
            torch.manual_seed(config.seed)
        if config.device == "cpu" and config.retain_freed_host_memory:
            retain_freed_memory()
        model_dir = Path(config.model)
        self.model_config = load_model_config(model_dir, config.hf_overrides)
        if config.limit_images == 0 and self.model_config.vision is not None and not config.enable_mm_embeds:
            self.model_config = dataclasses.replace(self.model_config, vision=None)  # text only
        self.fingerprint = kv_fingerprint(model_dir, config.max_model_len, config.hf_overrides)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        dtype = TORCH_DTYPES[config.dtype]
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype)  # what the pages hold
        self.runner = ModelRunner(
            config.model, self.model_config, dtype, config.device,
            max_positions=self.max_model_len, show_progress=config.show_progress, logprobs_mode=config.logprobs_mode,
            loads_image_encoder=config.limit_images != 0, tensor_parallel_size=config.tensor_parallel_size,
            num_threads=num_threads,
        )
        self.weights_dir = config.model  # the checkpoint served: the model's, or the last weight update's
        self.released_memory: set[str] = set()  # memory_release.py's kinds given back to the host now
        # Made before the pools are sized, so that a draft model's weights are in memory by then.
        drafter = make_drafter(config.speculative, self.runner, config.model, dtype, config.device, self.max_model_len)
        draft_model = self.draft_model = drafter if isinstance(drafter, DraftModel) else None
        pool_bytes = config.kv_cache_memory_bytes
        if pool_bytes is None and config.gpu_memory_utilization is not None and config.device.startswith("cuda"):
            pool_bytes = device_pool_bytes(config.device, config.gpu_memory_utilization)
        self.num_kv_blocks = num_pool_blocks(
            self.model_config, config.block_size, kv_dtype, config.device, pool_bytes,
            config.num_kv_blocks, config.kv_memory_fraction,
            draft_model.kv_block_bytes(config.block_size) if draft_model is not None else 0)
        kv_pool_start_ns = time.time_ns()
        head_layers = draft_model.pool_layers if draft_model is not None else 0  # an EAGLE head's, in every page
        self.runner.allocate_kv_pool(self.num_kv_blocks, config.block_size, kv_dtype, kv_tensor_factory,
                                     kv_shared_factory, extra_layers=head_layers)
        if draft_model is not None:  # as many pages as the target's; a sequence finding none left decodes plainly
            draft_model.allocate_kv_pool(self.num_kv_blocks, config.block_size,
                                         self.runner.kv_pool if head_layers else None)
        kv_pool_end_ns = time.time_ns()
        # An encoder's tokens attend to later ones too: no prefix of a prompt is the same computed alone. An
        # embedding pooled from every token (mean, [CLS]) needs every token's hidden state: its prompt is
        # computed whole, none of it read from a cache.
        self.is_encoder = self.model_config.encoder is not None
        self.pools_whole_prompts = self.is_encoder or self.model_config.pooling != "last"
        state_pages = self.runner.state_pages
        num_state_blocks = state_pages.num_pages if state_pages is not None else 0
        check_state_pages(self.num_kv_blocks, num_state_blocks)
        caches_prefixes = config.enable_prefix_caching and not self.pools_whole_prompts
        # A hybrid model continues a cached prefix from the recurrent states kept at its end.
        self.state_snapshots = StateSnapshots(config.state_cache_bytes) if num_state_blocks and caches_prefixes \
            else None
        if self.state_snapshots is not None:
            self.runner.snapshot_interval = -(-config.state_snapshot_interval // config.block_size) * config.block_size
        self.block_manager = BlockManager(self.num_kv_blocks, config.block_size, self.fingerprint, caches_prefixes,
                                          config.kv_cache_metrics_sample, num_state_blocks=num_state_blocks,
                                          snapshots=self.state_snapshots)
        self.loras = LoRAManager(self.runner.loras, self.runner.model, dtype, self.block_manager, config.max_lora_rank,
                                 config.max_cpu_loras, in_use=lambda name: self.is_adapter_in_use(name),
                                 sharding=self.runner.lora_sharding())
        self.eos_token_ids = self.model_config.eos_token_ids
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
            self.max_model_len, self.eos_token_ids, config.scheduling_policy, drafter, config.max_loras,
            whole_embeddings=self.pools_whole_prompts,
            per_request_spec_decode=config.per_request_spec_decode_metrics,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
        )
        self.tokenizer = load_tokenizer(Path(config.tokenizer) if config.tokenizer is not None else model_dir)
        if self.model_config.classifier_tokens:
            self.runner.model.make_classifier(vocabulary_ids(self.model_config.classifier_tokens, self.tokenizer))
        sep = self.model_config.encoder.sep_token if self.is_encoder else None
        if sep is not None and self.tokenizer is not None:
            self.runner.model.sep_token_id = self.tokenizer.token_to_id(sep)
        self._guides: GuideFactory | None = None
        self._guides_lock = threading.Lock()
        self._seqs: dict[str, Sequence] = {}
        self._page_reports: set[str] = set()  # prefill-only requests whose computed pages each step reports
        for name, path in config.lora_modules:
            self.loras.add(self.loras.read(name, path))
        self.output_streams = OutputStreams()
        self._request_counter = itertools.count()
        self.init_seconds = time.perf_counter() - start
        # Start-up phases as wall-clock (start_ns, end_ns): "engine_init" holds the other two.
        self.boot_times: dict[str, tuple[int, int]] = {
            "engine_init": (start_ns, time.time_ns()),
            "weights": self.runner.weight_loading_ns,
            "kv_pool": (kv_pool_start_ns, kv_pool_end_ns),
        }

    # --- requests ----------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prefill_only: bool = False,
        output_token_ids: list[int] | tuple[int, ...] = (),
        reports_pages: bool = False,
        prompt_embeds: torch.Tensor | None = None,
        images: list[ImageInput] | tuple[ImageInput, ...] = (),
        prompt_embeds_digest: str = "",
    ) -> None:
        """Queues a request; raises ValueError for one that can never be served.

        `prefill_only`: stop after the first token; unless that token already
        ends the request, it finishes as "prefilled" and keeps its pages until
        `release` (another worker decodes the rest from a copy of them). With
        `reports_pages`, each step that computes a chunk of its prompt but not the last
        returns its `ComputedPages` too, so they can be copied out meanwhile.
        `output_token_ids`: its output so far, made by another engine (a request that
        moved): computed after the prompt, and from then on as if made here.
        `prompt_embeds`: the prompt given as embeddings, a [P, hidden_size] tensor read in place of
        the embeddings of its P `prompt_token_ids` (placeholders then). `images`: each one, resized by the
        model's image processor, for its run of image tokens in the prompt. `prompt_embeds_digest`: what names
        the embeddings, where their sender hashed them (engine/admission.py's `salted`).
        """
        start_ns = time.time_ns()
        if isinstance(prompt_embeds, WithheldEmbeddings) or any(isinstance(image, WithheldImage) for image in images):
            raise ValueError("a prompt's embeddings and images' pixels are needed to prefill it: only a request "
                             "prefilled elsewhere takes their sizes and digests alone")
        check_new_request(self, request_id, prompt_token_ids, sampling_params, output_token_ids, prompt_embeds,
                          images, prefill_only)
        pending, spans, rope = placed_images(self.model_config.vision, prompt_token_ids, images)
        sampling_params = salted(sampling_params, prompt_embeds, images, prompt_embeds_digest)
        if sampling_params.lora_name is not None:
            self.loras.ensure_loaded(sampling_params.lora_name)
        seq = Sequence(request_id, prompt_token_ids, sampling_params, self.config.block_size,
                       is_prefill_only=prefill_only, output_token_ids=output_token_ids, prompt_embeds=prompt_embeds,
                       images=pending, bidirectional_spans=spans, rope_positions=rope)
        resume_guide(self, seq, output_token_ids)
        self._seqs[request_id] = seq
        if reports_pages and prefill_only:
            self._page_reports.add(request_id)
        self.output_streams.open(request_id, len(output_token_ids))
        self.scheduler.add(seq)
        seq.step_times.admit_ns = (start_ns, time.time_ns())

    def has_request(self, request_id: str) -> bool:
        """Whether a request of this id is here: waiting, running, or holding its pages (a prefilled one's,
        until they are handed on)."""
        return request_id in self._seqs or request_id in self.scheduler.held

    @property
    def guides(self) -> GuideFactory:
        """Guides over this model's vocabulary, made on first use (any thread: the services compile
        a request's index before they add it). ValueError for a model without a tokenizer.json."""
        with self._guides_lock:
            if self._guides is None:
                if self.tokenizer is None:
                    raise ValueError("guided decoding needs the model's tokenizer.json")
                self._guides = GuideFactory(self.tokenizer, self.eos_token_ids[0], self.model_config.vocab_size)
            return self._guides

    def reset_prefix_cache(self) -> int | None:
        """Forget every cached prefix block: the number forgotten; None while any request holds pages."""
        return self.block_manager.reset_prefix_cache()

    def update_weights(self, model_dir: str | Path) -> int | None:
        """Serve the weights in `model_dir` (SGLang's update_weights_from_disk: a trainer's next
        checkpoint of this model) and forget every cached prefix, KV of the weights before: the
        number of blocks forgotten. None, nothing changed, while any request holds pages. ValueError
        for a directory whose model is not this one's shape (its dtype on disk may differ); a checkpoint
        that fails part way through is raised after the one served before is read back. LoRA adapters
        and a draft model stay as they are; a multi-token prediction layer drafting from the served
        checkpoint is read from the new one too."""
        return weight_update.update_weights(self, model_dir)

    def reload_weights(self) -> None:
        """Read the served checkpoint (`weights_dir`) into the model's tensors again."""
        weight_update.reload_weights(self)

    def kv_pool_tensors(self) -> list[torch.Tensor]:
        """The KV pools' tensors: the model's, and its draft model's where it has one."""
        pools = [self.runner.kv_pool, self.draft_model.runner.kv_pool if self.draft_model is not None else None]
        return [pool.tensor for pool in pools if pool is not None]

    def close(self) -> None:
        """Stops the processes of the model's other tensor-parallel ranks, where it has them (they stop too
        when this process ends)."""
        self.runner.close()

    # --- disaggregated serving: pages handed from a prefill engine to a decode engine ---

    def held_block_ids(self, request_id: str) -> list[int]:
        """The pages of a "prefilled" request, in order; its KV covers the prompt (and its recurrent states follow,
        where the model has them)."""
        seq = self.scheduler.held[request_id]
        if not seq.state_blocks:
            return list(seq.block_table)
        return [*seq.block_table[:-(-seq.num_computed_tokens // self.config.block_size)], *seq.state_blocks]

    def release(self, request_id: str) -> bool:
        """Frees a "prefilled" request's pages once they were copied out."""
        return self.scheduler.release(request_id)

    def reserve(self, request_id: str, num_prompt_tokens: int) -> list[int]:
        """Sets aside pages for a prompt whose KV another worker will write; returns their ids."""
        num_blocks = check_reservation(self, request_id, num_prompt_tokens)
        return self.block_manager.reserve(request_id, num_blocks)

    def release_reservation(self, request_id: str) -> bool:
        return self.block_manager.release(request_id)

    def rename_reservation(self, request_id: str, new_id: str) -> bool:
        """Hold `request_id`'s reserved pages under `new_id` (freed by `release_reservation(new_id)`)."""
        return self.block_manager.rename_reservation(request_id, new_id)

    def add_prefilled_request(
        self, request_id: str, prompt_token_ids: list[int], first_token_id: int, sampling_params: SamplingParams,
        output_token_ids: list[int] | tuple[int, ...] = (),
        prompt_embeds: torch.Tensor | WithheldEmbeddings | None = None,
        images: list[ImageInput | WithheldImage] | tuple[ImageInput | WithheldImage, ...] = (),
        prompt_embeds_digest: str = "",
        draft_token_ids: list[int] | tuple[int, ...] = (),
    ) -> None:
        """Continues a request whose prompt KV (and its `output_token_ids`' after it, as
        `add_request` takes them) was written into the pages reserved under `request_id` and
        whose next token was sampled elsewhere. It joins the running batch, or, with max_num_seqs
        running, waits for a place in it holding its pages (the reservation admitted them).
        `prompt_embeds` and `images` as `add_request` takes them: a preempted request computes its prompt again.
        Its prompt embeddings and images may be withheld (`WithheldEmbeddings`, `WithheldImage`: not sent):
        preempted, it is computed again only where its prefix cache still holds their tokens, else it finishes
        "withheld". `draft_token_ids`: the prefill worker's drafts for what follows `first_token_id`, which its first
        step verifies (with speculative decoding on)."""
        check_new_request(self, request_id, prompt_token_ids, sampling_params, output_token_ids, prompt_embeds,
                          images)
        sampling_params = salted(sampling_params, prompt_embeds, images, prompt_embeds_digest)
        if not 0 <= first_token_id < self.model_config.vocab_size:
            raise ValueError(f"first token id {first_token_id} is outside the vocabulary")
        if not all(0 <= token < self.model_config.vocab_size for token in draft_token_ids):
            raise ValueError(f"draft token ids {list(draft_token_ids)} are not all in the vocabulary")
        if sampling_params.lora_name is not None:
            self.loras.ensure_loaded(sampling_params.lora_name)
        seq = prefilled_sequence(self, request_id, prompt_token_ids, first_token_id, sampling_params, output_token_ids,
                                 prompt_embeds, *placed_images(self.model_config.vision, prompt_token_ids, images))
        seq.handoff_drafts = list(draft_token_ids)
        self._seqs[request_id] = seq
        self.output_streams.open(request_id, len(output_token_ids) + 1)  # and the first token: all made elsewhere
        if not self.scheduler.add_running(seq):
            self.output_streams.finish_outside_step(seq)

    def abort(self, request_id: str) -> None:
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self.output_streams.finish_outside_step(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self.output_streams.has_finished_outside_step

    def has_finished_outside_step(self) -> bool:
        """Aborted requests whose last output no step has returned yet."""
        return self.output_streams.has_finished_outside_step

    def finished_outside_step(self) -> list[RequestOutput]:
        """The last outputs of the requests aborted since the last step, without stepping (stepping is
        paused; a step returns them otherwise)."""
        return [self._output(seq) for seq in self.output_streams.take_finished_outside_step()]

    # --- the loop ----------------------------------------------------------------

    def step(self) -> list[RequestOutput | ComputedPages]:
        """Schedules, runs and samples one batch; returns a diff per request that moved (and the
        `ComputedPages` of the requests that report them).

        Its requests' step times run from before scheduling to their outputs: all of the step
        is engine time, as a caller waiting on `step` for a first token sees it."""
        outputs = self.finished_outside_step()
        start_ns = time.time_ns()
        batch = self.scheduler.schedule()
        outputs += [self._output(seq) for seq in self.scheduler.take_withheld()]
        if not batch.seqs:
            self._drop_retired_adapters()
            return outputs
        timed = sequences_to_time(batch)
        if self.scheduler.drafter is not None and any(seq.num_draft_tokens for seq in batch.seqs):
            sampled, logits = self.runner.forward(batch)
            self.scheduler.postprocess_drafted(batch, sampled, logits, self.runner.sampler)
            if self.runner.state_pages is not None:
                settle_draft_states(self.runner.state_pages, batch.seqs)
        else:
            sampled, sampler_output = self.runner.execute(batch)
            self.scheduler.postprocess(batch, sampled, sampler_output)
        if self.state_snapshots is not None:
            keep_state_snapshots(batch.seqs, self.block_manager, self.state_snapshots)
        outputs += [self._output(seq) for seq in sampled]
        if self._page_reports:
            outputs += computed_pages(batch.seqs, sampled, self._page_reports, self.config.block_size)
        end_ns = time.time_ns()
        for seq, num_new, is_prefill in timed:
            seq.step_times.record(start_ns, end_ns, num_new, len(batch.seqs), is_prefill)
        self._drop_retired_adapters()
        return outputs

    def _drop_retired_adapters(self) -> None:
        if self.loras.has_retiring:
            self.loras.drop_unused(self.is_adapter_in_use)

    def is_adapter_in_use(self, lora_name: str) -> bool:
        """Whether an unfinished request computes with LoRA adapter `lora_name`."""
        return any(seq.sampling_params.lora_name == lora_name for seq in self._seqs.values())

    def _output(self, seq: Sequence) -> RequestOutput:
        held = self.held_block_ids(seq.request_id) if seq.finish_reason == "prefilled" else []
        output = self.output_streams.diff(seq, held)
        if seq.is_finished:
            if seq.pending_snapshot is not None:  # where its conversation's next turn will start
                self.state_snapshots.put(*seq.pending_snapshot)
                seq.pending_snapshot = None
            del self._seqs[seq.request_id]
            self._page_reports.discard(seq.request_id)
        return output

    def generate(
        self, prompts: list[list[int]], sampling_params: SamplingParams | list[SamplingParams]
    ) -> Iterator[RequestOutput]:
        """Adds every prompt and streams outputs until all are finished (engine/offline_generation.py)."""
        return offline_generation.generate(self, prompts, sampling_params, self._request_counter)
