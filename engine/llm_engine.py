"""`LLMEngine`: add_request → step → outputs, over one model directory."""
from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer

from engine.batch import ScheduledBatch
from engine.block_manager import BlockManager
from engine.checkpoint import kv_fingerprint
from engine.config import EngineConfig
from engine.draft_model import DraftModel
from engine.dtypes import TORCH_DTYPES, kv_cache_dtype
from engine.guided_decoding import GuideFactory
from engine.host_memory import retain_freed_memory
from engine.kv_pool import TensorFactory, num_blocks_for_budget
from engine.lora_manager import LoRAManager
from engine.model_config import ModelConfig, load_model_config
from engine.model_runner import ModelRunner
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import Drafter, Scheduler
from engine.sequence import Sequence
from engine.speculative import NgramDrafter


class LLMEngine:
    def __init__(self, config: EngineConfig, kv_tensor_factory: TensorFactory | None = None) -> None:
        """`kv_tensor_factory` places the KV pool's one tensor (shared memory for a
        decode worker); by default it is private, zero-filled memory."""
        start = time.perf_counter()
        start_ns = time.time_ns()
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.device == "cpu" and config.retain_freed_host_memory:
            retain_freed_memory()
        model_dir = Path(config.model)
        self.model_config = load_model_config(model_dir, config.hf_overrides)
        self.fingerprint = kv_fingerprint(model_dir, config.max_model_len, config.hf_overrides)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        dtype = TORCH_DTYPES[config.dtype]
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype)  # what the pages hold
        self.runner = ModelRunner(
            config.model, self.model_config, dtype, config.device,
            max_positions=self.max_model_len, show_progress=config.show_progress,
        )
        self.weights_dir = config.model  # the checkpoint served: the model's, or the last weight update's
        self.released_memory: set[str] = set()  # memory_release.py's kinds given back to the host now
        drafter = self._drafter(dtype)  # (a draft model's weights are in memory before the pools are sized)
        draft_model = self.draft_model = drafter if isinstance(drafter, DraftModel) else None
        self.num_kv_blocks = config.num_kv_blocks or num_blocks_for_budget(
            self.model_config, config.block_size, kv_dtype, config.device, config.kv_memory_fraction,
            draft_model.kv_block_bytes(config.block_size) if draft_model is not None else 0,
        )
        kv_pool_start_ns = time.time_ns()
        self.runner.allocate_kv_pool(self.num_kv_blocks, config.block_size, kv_dtype, kv_tensor_factory)
        if draft_model is not None:  # as many pages as the target's; a sequence finding none left decodes plainly
            draft_model.allocate_kv_pool(self.num_kv_blocks, config.block_size)
        kv_pool_end_ns = time.time_ns()
        # An encoder's tokens attend to later ones too: no prefix of a prompt is the same computed alone. An
        # embedding pooled from every token (mean, [CLS]) needs every token's hidden state: its prompt is
        # computed whole, none of it read from a cache.
        self.is_encoder = self.model_config.encoder is not None
        self.pools_whole_prompts = self.is_encoder or self.model_config.pooling != "last"
        self.block_manager = BlockManager(self.num_kv_blocks, config.block_size, self.fingerprint,
                                          config.enable_prefix_caching and not self.pools_whole_prompts)
        self.loras = LoRAManager(self.runner.loras, self.runner.model, dtype, self.block_manager, config.max_lora_rank,
                                 config.max_cpu_loras, in_use=lambda name: self.is_adapter_in_use(name))
        self.eos_token_ids = self.model_config.eos_token_ids
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
            self.max_model_len, self.eos_token_ids, config.scheduling_policy, drafter, config.max_loras,
            whole_embeddings=self.pools_whole_prompts,
        )
        self.tokenizer = _load_tokenizer(model_dir)
        if self.model_config.classifier_tokens:
            self.runner.model.make_classifier(_vocabulary_ids(self.model_config.classifier_tokens, self.tokenizer))
        sep = self.model_config.encoder.sep_token if self.is_encoder else None
        if sep is not None and self.tokenizer is not None:
            self.runner.model.sep_token_id = self.tokenizer.token_to_id(sep)
        self._guides: GuideFactory | None = None
        self._guides_lock = threading.Lock()
        self._seqs: dict[str, Sequence] = {}
        for name, path in config.lora_modules:
            self.loras.add(self.loras.read(name, path))
        self._num_emitted: dict[str, int] = {}
        # Sequences that finished outside a step (aborted, or done at their first token).
        self._finished_outside_step: list[Sequence] = []
        self._request_counter = itertools.count()
        self.init_seconds = time.perf_counter() - start
        # Start-up phases as wall-clock (start_ns, end_ns): "engine_init" holds the other two.
        self.boot_times: dict[str, tuple[int, int]] = {
            "engine_init": (start_ns, time.time_ns()),
            "weights": self.runner.weight_loading_ns,
            "kv_pool": (kv_pool_start_ns, kv_pool_end_ns),
        }

    def _drafter(self, dtype: torch.dtype) -> Drafter | None:
        speculative = self.config.speculative
        if speculative is None:
            return None
        if speculative.method == "ngram":
            return NgramDrafter(speculative)
        return DraftModel(speculative.model, speculative.num_speculative_tokens, self.model_config, dtype,
                          self.config.device, self.max_model_len)

    # --- requests ----------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prefill_only: bool = False,
        output_token_ids: list[int] | tuple[int, ...] = (),
    ) -> None:
        """Queues a request; raises ValueError for one that can never be served.

        `prefill_only`: stop after the first token; unless that token already
        ends the request, it finishes as "prefilled" and keeps its pages until
        `release` (another worker decodes the rest from a copy of them).
        `output_token_ids`: its output so far, made by another engine (a request that
        moved): computed after the prompt, and from then on as if made here.
        """
        start_ns = time.time_ns()
        self._check_new_request(request_id, prompt_token_ids, sampling_params, output_token_ids)
        if sampling_params.lora_name is not None:
            self.loras.ensure_loaded(sampling_params.lora_name)
        seq = Sequence(request_id, prompt_token_ids, sampling_params, self.config.block_size,
                       is_prefill_only=prefill_only, output_token_ids=output_token_ids)
        self._resume(seq, output_token_ids)
        self._seqs[request_id] = seq
        self._num_emitted[request_id] = len(output_token_ids)
        self.scheduler.add(seq)
        seq.step_times.admit_ns = (start_ns, time.time_ns())

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
        and a draft model stay as they are."""
        if self.block_manager.num_free_blocks < self.block_manager.num_blocks:
            return None
        model_config = load_model_config(Path(model_dir), self.config.hf_overrides)
        differs = [f.name for f in dataclasses.fields(ModelConfig) if f.name != "weights_dtype"
                   and getattr(model_config, f.name) != getattr(self.model_config, f.name)]
        if differs:
            raise ValueError(f"{model_dir} is not the served model's shape: its {', '.join(differs)} differ")
        served, self.weights_dir = self.weights_dir, str(model_dir)
        try:
            self.reload_weights()
        except BaseException:
            # Failed part way (a bad tensor in its last shard): the model holds some of each checkpoint.
            self.weights_dir = served
            self.reload_weights()
            raise
        return self.block_manager.reset_prefix_cache()

    def reload_weights(self) -> None:
        """Read the served checkpoint (`weights_dir`) into the model's tensors again."""
        self.runner.load_weights(self.weights_dir)
        if self.model_config.classifier_tokens:  # made from the LM head's rows, which have changed
            self.runner.model.make_classifier(_vocabulary_ids(self.model_config.classifier_tokens, self.tokenizer))
        self.released_memory.discard("weights")

    def kv_pool_tensors(self) -> list[torch.Tensor]:
        """The KV pools' tensors: the model's, and its draft model's where it has one."""
        pools = [self.runner.kv_pool, self.draft_model.runner.kv_pool if self.draft_model is not None else None]
        return [pool.tensor for pool in pools if pool is not None]

    def _check_new_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                           output_token_ids: list[int] | tuple[int, ...] = ()) -> None:
        self._check_weights_held()
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if sampling_params.lora_name is not None and not self.loras.is_served(sampling_params.lora_name):
            served = ", ".join(self.loras.served) or "none"
            raise ValueError(f"LoRA adapter {sampling_params.lora_name!r} is not served here (served: {served})")
        if sampling_params.priority and not self.scheduler.is_by_priority:
            raise ValueError(f"priority {sampling_params.priority} asks for priority scheduling, which this engine "
                             f"does not do (scheduling_policy {self.config.scheduling_policy!r})")
        bad = next((t for t in output_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"output token id {bad} is outside the vocabulary [0, {vocab})")
        if len(output_token_ids) >= sampling_params.max_tokens:
            raise ValueError(f"{len(output_token_ids)} output tokens already: max_tokens "
                             f"{sampling_params.max_tokens} leaves none to make")
        bad = next((t for t, _ in sampling_params.logit_bias if t >= vocab), None)
        if bad is not None:  # the sampler would index past the logits
            raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in sampling_params.allowed_token_ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"allowed_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for word in sampling_params.bad_words_token_ids for t in word if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"bad_words: token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in sampling_params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:  # never sampled, and short of min_tokens the sampler would index past the logits
            raise ValueError(f"stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in sampling_params.guide_after_token_ids if t >= vocab), None)
        if bad is not None:  # never sampled: the guide would never hold
            raise ValueError(f"guide_after_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
        n = len(prompt_token_ids)
        # An embedding's one token is made and dropped, never computed: its prompt may fill the context.
        if n + len(output_token_ids) >= self.max_model_len + sampling_params.embed:
            raise ValueError(f"prompt of {n} tokens (and {len(output_token_ids)} of output) does not fit the "
                             f"context of {self.max_model_len} tokens" if output_token_ids else
                             f"prompt of {n} tokens does not fit the context of {self.max_model_len} tokens")
        if self.pools_whole_prompts and sampling_params.embed and n > self.config.max_num_batched_tokens:
            raise ValueError(f"prompt of {n} tokens is more than one step computes (max_num_batched_tokens "
                             f"{self.config.max_num_batched_tokens}), and an embedding pooled from all its tokens "
                             "is computed whole")
        max_tokens_total = min(n + sampling_params.max_tokens, self.max_model_len)
        bs = self.config.block_size
        if (max_tokens_total + bs - 1) // bs > self.num_kv_blocks:
            raise ValueError(
                f"request needs up to {max_tokens_total} tokens of KV, more than the pool's "
                f"{self.num_kv_blocks * bs}"
            )

    # --- disaggregated serving: pages handed from a prefill engine to a decode engine ---

    def held_block_ids(self, request_id: str) -> list[int]:
        """The pages of a "prefilled" request, in order; its KV covers the prompt."""
        return list(self.scheduler.held[request_id].block_table)

    def _check_weights_held(self) -> None:
        if "weights" in self.released_memory:
            raise ValueError("this worker's weights are released (asleep): resume its memory first")

    def release(self, request_id: str) -> bool:
        """Frees a "prefilled" request's pages once they were copied out."""
        return self.scheduler.release(request_id)

    def reserve(self, request_id: str, num_prompt_tokens: int) -> list[int]:
        """Sets aside pages for a prompt whose KV another worker will write; returns their ids."""
        self._check_weights_held()
        if not 0 < num_prompt_tokens < self.max_model_len:
            raise ValueError(f"prompt of {num_prompt_tokens} tokens does not fit the context of "
                             f"{self.max_model_len} tokens")
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        num_blocks = -(-num_prompt_tokens // self.config.block_size)
        if not self.block_manager.can_reserve(num_blocks):
            raise RuntimeError(f"no room for {num_blocks} KV blocks now ({self.block_manager.num_free_blocks} free)")
        return self.block_manager.reserve(request_id, num_blocks)

    def release_reservation(self, request_id: str) -> bool:
        return self.block_manager.release(request_id)

    def add_prefilled_request(
        self, request_id: str, prompt_token_ids: list[int], first_token_id: int, sampling_params: SamplingParams,
        output_token_ids: list[int] | tuple[int, ...] = (),
    ) -> None:
        """Continues a request whose prompt KV (and its `output_token_ids`' after it, as
        `add_request` takes them) was written into the pages reserved under `request_id` and
        whose next token was sampled elsewhere. It joins the running batch at once: the
        reservation, not max_num_seqs, admitted it."""
        self._check_new_request(request_id, prompt_token_ids, sampling_params, output_token_ids)
        if not 0 <= first_token_id < self.model_config.vocab_size:
            raise ValueError(f"first token id {first_token_id} is outside the vocabulary")
        if sampling_params.lora_name is not None:
            self.loras.ensure_loaded(sampling_params.lora_name)
        # The prefill worker sampled it as this engine would have: under the same guide, seed and position.
        made_elsewhere = [*output_token_ids, first_token_id]
        seq = Sequence(request_id, prompt_token_ids, sampling_params, self.config.block_size,
                       output_token_ids=output_token_ids)
        try:
            self._resume(seq, made_elsewhere)
        except ValueError:
            if output_token_ids:  # they may be what the guide refused: its message says either
                raise
            raise ValueError(f"first token id {first_token_id} does not follow {sampling_params.guide_name}") from None
        seq.num_computed_tokens = seq.num_tokens
        self.block_manager.adopt(request_id, seq)
        seq.append_token(first_token_id)
        if sampling_params.logprobs is not None:
            # Prefill reported the first token's logprobs; this entry only keeps
            # output_logprobs aligned with output_token_ids and is never emitted.
            seq.output_logprobs.append({})
        self._seqs[request_id] = seq
        self._num_emitted[request_id] = len(made_elsewhere)
        if not self.scheduler.add_running(seq):
            self._finished_outside_step.append(seq)

    def _resume(self, seq: Sequence, made_elsewhere: list[int] | tuple[int, ...]) -> None:
        """Give `seq` its guide, moved past the output tokens `made_elsewhere`: the next token is then
        guided as the engine that made them would have guided it (a seeded draw depends on its
        position alone: engine/sampler.py's `position_seed`). ValueError when they do not follow it."""
        params = seq.sampling_params
        if params.is_guided:
            seq.guide = self.guides.guide(params)
            try:
                for token_id in made_elsewhere:
                    if token_id not in self.eos_token_ids:
                        seq.advance_guide(token_id)
            except ValueError:
                raise ValueError(f"output token ids do not follow {params.guide_name}") from None

    def abort(self, request_id: str) -> None:
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self._finished_outside_step.append(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._finished_outside_step)

    def has_finished_outside_step(self) -> bool:
        """Aborted requests whose last output no step has returned yet."""
        return bool(self._finished_outside_step)

    def finished_outside_step(self) -> list[RequestOutput]:
        """The last outputs of the requests aborted since the last step, without stepping (stepping is
        paused; a step returns them otherwise)."""
        outputs = [self._output(seq) for seq in self._finished_outside_step]
        self._finished_outside_step.clear()
        return outputs

    # --- the loop ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedules, runs and samples one batch; returns a diff per request that moved.

        Its requests' step times run from before scheduling to their outputs: all of the step
        is engine time, as a caller waiting on `step` for a first token sees it."""
        outputs = self.finished_outside_step()
        start_ns = time.time_ns()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            self._drop_retired_adapters()
            return outputs
        timed = self._to_time(batch)
        if self.scheduler.drafter is not None and any(seq.num_draft_tokens for seq in batch.seqs):
            sampled, logits = self.runner.forward(batch)
            self.scheduler.postprocess_drafted(batch, sampled, logits, self.runner.sampler)
        else:
            sampled, sampler_output = self.runner.execute(batch)
            self.scheduler.postprocess(batch, sampled, sampler_output)
        outputs += [self._output(seq) for seq in sampled]
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

    @staticmethod
    def _to_time(batch: ScheduledBatch) -> list[tuple[Sequence, int, bool]]:
        """The sequences whose step times this step adds to, and whether each ran a prompt chunk
        (it has no token of its own before postprocess: a moved request's output came with it).
        Once its first token is out and its first step known, a sequence costs two comparisons."""
        timed = []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            is_prefill = seq.num_tokens - seq.num_draft_tokens == seq.num_tokens_given
            if is_prefill or seq.step_times.first_step_start_ns is None:
                timed.append((seq, num_new, is_prefill))
        return timed

    def _output(self, seq: Sequence) -> RequestOutput:
        start = self._num_emitted[seq.request_id]
        out_ids = seq.output_token_ids
        self._num_emitted[seq.request_id] = len(out_ids)
        if seq.is_finished:
            del self._seqs[seq.request_id], self._num_emitted[seq.request_id]
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            new_token_ids=out_ids[start:],
            token_ids=out_ids,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            new_logprobs=seq.output_logprobs[start:],
            prompt_logprobs=seq.prompt_logprobs if start == 0 else None,
            num_cached_tokens=seq.num_cached_tokens,
            held_block_ids=self.held_block_ids(seq.request_id) if seq.finish_reason == "prefilled" else [],
            embedding=seq.embedding if seq.is_finished else None,
            token_embeddings=seq.token_embeddings if seq.is_finished else None,
            step_times=seq.step_times,
        )

    def generate(
        self, prompts: list[list[int]], sampling_params: SamplingParams | list[SamplingParams]
    ) -> Iterator[RequestOutput]:
        """Adds every prompt and streams outputs until all are finished."""
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [f"gen-{next(self._request_counter)}" for _ in prompts]
        for request_id, prompt, p in zip(ids, prompts, params):
            self.add_request(request_id, prompt, p)
        pending = set(ids)
        while pending:
            for out in self.step():
                if out.request_id in pending:
                    if out.finished:
                        pending.discard(out.request_id)
                    yield out


def _vocabulary_ids(tokens: tuple[str, ...], tokenizer: Tokenizer | None) -> list[int]:
    """Each of `tokens`' id in the model's vocabulary; ValueError for one it lacks."""
    ids = [tokenizer.token_to_id(t) if tokenizer is not None else None for t in tokens]
    missing = [t for t, i in zip(tokens, ids) if i is None]
    if missing:
        raise ValueError(f"classifier_from_token: {missing} are not tokens of the model's tokenizer.json")
    return ids


def _load_tokenizer(model_dir: Path) -> Tokenizer | None:
    path = model_dir / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None
