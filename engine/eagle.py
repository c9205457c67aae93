"""Speculative drafts from an EAGLE head, as vLLM's `{"method": "eagle", "model": DIR}` and
`{"method": "eagle3", "model": DIR}` (the head: engine/models/eagle.py), or from a checkpoint's multi-token
prediction layer, `{"method": "mtp"}` (engine/models/mtp.py), which drafts alike.

The head drafts from the target's own hidden states: its input at position q is the token at q + 1 and
the target's hidden state at q (EAGLE-3's: three layers' inputs there, through `fc`), and its output there
predicts the token at q + 2. So after each target step the head takes the hidden states of the positions the
step verified (the target's runner hands them over, `_take_rows`), and its first forward at the next step's
proposal both extends its own KV over them and makes the first draft; each further draft is one row, fed the
head's own output. A chunk of a prompt that goes on it takes in at once, a forward of its own.

The head's KV pages are its own (as a draft model's: as many pages as the target's). Its context starts
where the target's hidden states do: at the prompt's start in an engine that computes prompts itself, after
a prefix the cache served, and at the first token a decode worker computed for a prompt whose KV came from a
prefill worker (whose hidden states stay there: the head drafts from what it has seen since, with worse
drafts, never wrong ones). A gap in the states it was handed restarts its context after the gap.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.architectures import MIMO
from engine.batch import ScheduledBatch
from engine.checkpoint import checkpoint_files
from engine.draft_model import DraftModel, DraftSequence, last_rows
from engine.eagle_config import EagleConfig
from engine.kv_pool import KVPool
from engine.linear_attention_config import HYBRID_LINEAR
from engine.mamba_config import NEMOTRON_H
from engine.mellum_config import MELLUM
from engine.mimo_v2_flash_config import MIMO_V2_FLASH
from engine.model_config import ModelConfig
from engine.model_config_loader import load_model_config
from engine.model_runner import ModelRunner
from engine.models.mellum_mtp import mellum_mtp_config
from engine.models.mimo_mtp import mimo_mtp_config
from engine.models.mimo_v2_flash_mtp import mimo_v2_flash_mtp_config
from engine.models.mtp import MASKED, MTP_HEADS, mtp_head_config
from engine.models.nemotron_h_mtp import nemotron_h_mtp_config
from engine.models.qwen3_next_mtp import qwen3_next_mtp_config
from engine.models.step3p7_mtp import step3p7_mtp_config
from engine.sequence import Sequence
from engine.step3p7_config import STEP3P7

HEAD_ARCHITECTURES = {"eagle": "EagleLlamaForCausalLM", "eagle3": "Eagle3LlamaForCausalLM"}


def load_head_config(model_dir: str, method: str, target: ModelConfig) -> ModelConfig:
    """The EAGLE head in `model_dir` (its config.json a Llama's, as EAGLE's releases are) drafting for `target`;
    ValueError where it cannot."""
    path = Path(model_dir)
    raw = json.loads((path / "config.json").read_text())
    config = load_model_config(path, {"architectures": ["LlamaForCausalLM"]})
    names = set(checkpoint_files(path))
    where = f"EAGLE head {model_dir}"
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"{where}: its vocabulary ({config.vocab_size} tokens) is not the target's "
                         f"({target.vocab_size}); an EAGLE head is trained for one target")
    if method == "eagle":
        if config.hidden_size != target.hidden_size:
            raise ValueError(f"{where}: its hidden size ({config.hidden_size}) is not the target's "
                             f"({target.hidden_size})")
        eagle = EagleConfig("eagle", target.vocab_size, target.hidden_size, has_fc_bias="fc.bias" in names)
    else:
        target_hidden = int(raw.get("target_hidden_size") or config.hidden_size)
        if target_hidden != target.hidden_size:
            raise ValueError(f"{where}: it reads hidden states {target_hidden} wide, the target's are "
                             f"{target.hidden_size}")
        eagle_config = raw.get("eagle_config") or {}
        layers = raw.get("eagle_aux_hidden_state_layer_ids") or \
            eagle_config.get("eagle_aux_hidden_state_layer_ids") or \
            (2, target.num_layers // 2, target.num_layers - 3)  # vLLM's default: early, middle, late
        if eagle_config.get("use_aux_hidden_state") is False:  # the target's last hidden states, as EAGLE-1's
            layers = ()
        elif len(set(layers)) != 3 or not all(0 <= int(layer) < target.num_layers for layer in layers):
            raise ValueError(f"{where}: it reads three of the target's {target.num_layers} layers' inputs, got "
                             f"layers {list(layers)} (config.json's eagle_aux_hidden_state_layer_ids)")
        draft_vocab = int(raw.get("draft_vocab_size") or config.vocab_size)
        has_lm_head, has_draft_ids = "lm_head.weight" in names, "d2t" in names
        if draft_vocab != target.vocab_size and not (has_lm_head and has_draft_ids):
            raise ValueError(f"{where}: a draft vocabulary of its own ({draft_vocab} tokens) needs its lm_head and "
                             "d2t tensors")
        eagle = EagleConfig("eagle3", draft_vocab, target_hidden, has_embeddings="embed_tokens.weight" in names,
                            has_lm_head=has_lm_head, has_draft_ids=has_draft_ids,
                            target_layers=tuple(sorted(int(layer) for layer in layers)),  # as the target meets them
                            norm_before_residual=bool(raw.get("norm_before_residual", False)),
                            first_layer_name="midlayer." if any(n.startswith("midlayer.") for n in names)
                            else "layers.0.")
    return dataclasses.replace(config, architecture=HEAD_ARCHITECTURES[method], eagle=eagle)


# Targets whose checkpoints hold MTP layers under a prefix of their own (Baton drafts with the first): the first's
# joining projection (`{layer}`: the target's layer count), and the head's config of config.json's keys and the
# target's (and whether the head reads the embeddings and LM head).
PREFIXED_MTP_LAYERS = {MIMO_V2_FLASH: ("model.mtp.layers.0.eh_proj.weight", mimo_v2_flash_mtp_config),
                       MIMO: ("model.mtp_layers.0.input_proj.weight", mimo_mtp_config),
                       MELLUM: ("mtp.fc.weight", mellum_mtp_config),
                       STEP3P7: ("model.layers.{layer}.eh_proj.weight", step3p7_mtp_config)}


def load_mtp_config(model_dir: str, target: ModelConfig, split_target: bool = False) -> ModelConfig:
    """The multi-token prediction layer in `model_dir`'s checkpoint (the target's own, or a copy) as a head
    drafting for `target` (`split_target`: split across tensor-parallel ranks, each holding a share of its embeddings
    and LM head); ValueError where it has none Baton reads."""
    if target.architecture in HYBRID_LINEAR:
        return _qwen3_next_mtp_config(model_dir, target)
    if target.architecture == NEMOTRON_H:
        return _nemotron_h_mtp_config(model_dir, target)
    if target.architecture in PREFIXED_MTP_LAYERS:
        projection, config_of = PREFIXED_MTP_LAYERS[target.architecture]
        projection = projection.format(layer=target.num_layers)
        if projection not in checkpoint_files(model_dir):
            raise ValueError(f"{model_dir}: the checkpoint has no MTP layer ({projection}); some releases leave it out")
        return config_of(json.loads((Path(model_dir) / "config.json").read_text()), target, split_target)
    if target.architecture not in MTP_HEADS:
        raise ValueError(f"{target.architecture} checkpoints carry no multi-token prediction layer Baton reads "
                         f"(those of {', '.join([*MTP_HEADS, *HYBRID_LINEAR, NEMOTRON_H, *PREFIXED_MTP_LAYERS])} do)")
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    num_mtp_layers = int(raw.get("num_nextn_predict_layers") or 0)
    if num_mtp_layers != 1:
        raise ValueError(f"{model_dir}: config.json's num_nextn_predict_layers is {num_mtp_layers}; Baton drafts "
                         "with a checkpoint's one MTP layer")
    layer = target.num_layers
    if f"model.layers.{layer}.eh_proj.weight" not in checkpoint_files(model_dir):
        raise ValueError(f"{model_dir}: the checkpoint has no MTP layer (model.layers.{layer}.eh_proj.weight); some "
                         "releases leave it out")
    return mtp_head_config(target, layer)


def _qwen3_next_mtp_config(model_dir: str, target: ModelConfig) -> ModelConfig:
    """Qwen3-Next's or Qwen3.5's MTP layer (engine/models/qwen3_next_mtp.py): config.json's (or its text_config's)
    mtp_num_hidden_layers, the layer's tensors under `mtp.`."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    text = raw.get("text_config") or raw
    num_mtp_layers = int(text.get("mtp_num_hidden_layers", 1))
    if num_mtp_layers != 1:
        raise ValueError(f"{model_dir}: config.json's mtp_num_hidden_layers is {num_mtp_layers}; Baton drafts with "
                         "a checkpoint's one MTP layer")
    if text.get("mtp_use_dedicated_embeddings"):
        raise ValueError(f"{model_dir}: an MTP layer with embeddings of its own (mtp_use_dedicated_embeddings) is not "
                         "read yet; Baton's computes with the target's")
    if "mtp.fc.weight" not in checkpoint_files(model_dir):
        raise ValueError(f"{model_dir}: the checkpoint has no MTP layer (mtp.fc.weight); some releases leave it out")
    return qwen3_next_mtp_config(target)


def _nemotron_h_mtp_config(model_dir: str, target: ModelConfig) -> ModelConfig:
    """Nemotron 3's MTP layer (engine/models/nemotron_h_mtp.py): config.json's num_nextn_predict_layers and
    mtp_layers_block_type (or mtp_hybrid_override_pattern), its blocks' tensors under `mtp.layers.`."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    num_mtp_layers = int(raw.get("num_nextn_predict_layers") or 0)
    if num_mtp_layers != 1:
        raise ValueError(f"{model_dir}: config.json's num_nextn_predict_layers is {num_mtp_layers}; Baton drafts "
                         "with a checkpoint's one MTP layer")
    if "mtp.layers.0.eh_proj.weight" not in checkpoint_files(model_dir):
        raise ValueError(f"{model_dir}: the checkpoint has no MTP layer (mtp.layers.0.eh_proj.weight); some releases "
                         "leave it out")
    return nemotron_h_mtp_config(target, list(raw.get("mtp_layers_block_type") or
                                              raw.get("mtp_hybrid_override_pattern") or ""))


@dataclass(eq=False)
class EagleSequence(DraftSequence):
    """A sequence as the head holds it: its EAGLE inputs by index (index j at the owner's position `base` + j: the
    owner's token at `base` + j + 1, or a draft), `num_features` of them the target's hidden states' (the rest
    drafts'), and the hidden states handed over since that it has not taken in yet (`pieces`: (the owner's
    position of the first, rows))."""

    masks_first: bool = False  # its input at the owner's position 0 is MASKED (DeepSeek-V3's MTP layer's)
    # Its KV in its owner's pages (the head's layers of them): what they hold before the hidden states it was
    # handed (a cached prefix, a prompt a prefill worker computed) is its own, its context from position 0.
    in_owners_pages: bool = False
    base: int = 0
    num_features: int = 0
    pieces: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    last_feature: torch.Tensor | None = None  # the target's at index num_features - 1: to compute it again

    def add_rows(self, start: int, rows: torch.Tensor) -> None:
        """A step computed the owner's positions from `start` on: rows there replace those kept from `start` on
        (a rejected draft's)."""
        self.pieces = [(s, kept[:start - s]) for s, kept in self.pieces if s < start]
        self.pieces.append((start, rows))

    def take_features(self, verified: int) -> bool:
        """Take in the hidden states of the owner's positions up to `verified` (those its tokens are computed at),
        as inputs not yet computed; False where they do not reach it (no draft can follow yet)."""
        run_start, run_end, rows = self._contiguous_rows()
        self.pieces = []  # (rows past `verified`: a rejected draft's)
        next_position = self.base + self.num_features
        if run_end is None or run_end < verified:  # nothing handed over since, or a gap before the end
            return run_end is None and verified == next_position and self._again()
        if self.in_owners_pages and run_start != next_position:  # the owner's pages hold its KV up to there
            self._held_up_to(run_start)
            next_position = run_start
        elif run_start > next_position or next_position > verified:  # a gap: its context starts again after it
            self.base, self.num_features, self.num_computed_tokens = run_start, 0, 0
            self.rope_positions = None  # (its indices no longer its owner's positions: worse drafts, never wrong)
            self.token_ids, self.given_embeddings, next_position = [], (), run_start
        rows = rows[next_position - run_start:verified - run_start]
        if not rows.shape[0]:
            return self._again()
        del self.token_ids[self.num_features:]  # its last drafts' inputs
        self.num_computed_tokens = min(self.num_computed_tokens, self.num_features)
        self.token_ids += self.owner.token_ids[next_position + 1:verified + 1]
        if self.masks_first and next_position == 0:
            self.token_ids[0] = MASKED
        self.given_embeddings = (*self._target_features(), (self.num_features, rows))
        self.num_features += rows.shape[0]
        self.last_feature = rows[-1:]
        return True

    def _held_up_to(self, position: int) -> None:
        """Its inputs up to `position` computed already, in its owner's pages."""
        self.token_ids = self.owner.token_ids[1:position + 1]
        if self.masks_first and position:
            self.token_ids[0] = MASKED
        self.num_features = self.num_computed_tokens = position
        self.given_embeddings, self.last_feature = (), None

    def _again(self) -> bool:
        """Its last target input computed again (nothing verified since its last drafts), for its output."""
        if self.last_feature is None:
            return False
        del self.token_ids[self.num_features:]
        if self.num_computed_tokens >= self.num_features - 1:
            self.num_computed_tokens = self.num_features - 1
            self.given_embeddings = ((self.num_features - 1, self.last_feature),)
        else:  # (inputs taken in and never computed: no pages were free then)
            self.given_embeddings = self._target_features()
        return True

    def _target_features(self) -> tuple[tuple[int, torch.Tensor], ...]:
        """The given features of target inputs not yet computed (none of drafts')."""
        return tuple((i, rows) for i, rows in self.given_embeddings
                     if i < self.num_features and i + rows.shape[0] > self.num_computed_tokens)

    def _contiguous_rows(self) -> tuple[int | None, int | None, torch.Tensor | None]:
        """The last run of handed-over rows without a gap: its first and end positions, and its rows."""
        if not self.pieces:
            return None, None, None
        run = [self.pieces[-1]]
        for start, rows in reversed(self.pieces[:-1]):
            if start + rows.shape[0] != run[0][0]:
                break
            run.insert(0, (start, rows))
        end = run[-1][0] + run[-1][1].shape[0]
        return run[0][0], end, torch.cat([rows for _, rows in run]) if len(run) > 1 else run[0][1]


class EagleDrafter(DraftModel):
    """The scheduler's drafter for `{"method": "eagle"}`, `{"method": "eagle3"}` and `{"method": "mtp"}`: the head
    beside the target, reading its hidden states. A head whose layers' KV is shaped as the target's (every
    released one's: EAGLE heads of the target's heads, an MTP layer of its kind) keeps it in the target's own pages,
    as layers past the target's (`pool_layers`), so that it goes where they go: to a decode worker with a prompt's
    pages, into the prefix cache and out of it. Its context is then the whole sequence wherever the pages were
    computed (each prefill worker having the head too: the pages' layouts say so). Another keeps a pool of its own
    (DraftModel's), its context starting where the hidden states it was handed do."""

    def __init__(self, model_dir: str, method: str, num_speculative_tokens: int, target: ModelRunner,
                 dtype: torch.dtype, device: str, max_positions: int, reads_served_checkpoint: bool = False) -> None:
        """ValueError for a head that cannot draft for `target`'s model. `reads_served_checkpoint`: `model_dir` is
        the checkpoint the target serves (an MTP layer's), whose weight updates it reads too."""
        config = load_mtp_config(model_dir, target.model_config, target.model.vocabulary is not None) \
            if method == "mtp" else \
            load_head_config(model_dir, method, target.model_config)
        self._masks_first = config.eagle.masks_first  # the first position's embedding: engine/models/mtp.py
        self.reads_served_checkpoint = reads_served_checkpoint
        eagle = config.eagle
        if target.model.vocabulary is not None and (method == "eagle" or (
                method == "eagle3" and not (eagle.has_embeddings and eagle.has_lm_head))):
            raise ValueError(f"{model_dir}: an EAGLE head computing with the target's embeddings and LM head does not "
                             "draft for a target split across tensor-parallel ranks (each holds a share of them)")
        self._start(model_dir, ModelRunner(model_dir, config, dtype, device, max_positions), num_speculative_tokens,
                    dtype)
        whole = target.model_config
        if (config.num_kv_heads, config.head_dim, config.mla is None) == (whole.num_kv_heads, whole.head_dim,
                                                                          whole.mla is None):
            self.pool_layers = config.num_kv_layers
        self.runner.model.share(target.model)
        target.model.captured_layers = config.eagle.target_layers
        target.hidden_listener = self._take_rows

    def allocate_kv_pool(self, num_blocks: int, block_size: int, target_pool: KVPool | None = None) -> None:
        """Its layers of `target_pool`'s pages, past the target's; or a pool of its own (DraftModel's)."""
        if target_pool is None:
            super().allocate_kv_pool(num_blocks, block_size)
            return
        pages = target_pool.tensor[target_pool.tensor.shape[0] - self.pool_layers:]
        self.runner.kv_pool = KVPool(self.runner.model_config, num_blocks, block_size, pages.dtype,
                                     self.runner.device, lambda *_: pages)
        self.block_size = block_size  # (num_blocks 0: no page of its own)

    def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[str, list[int]]:
        """`room` greedy drafts for what follows each sequence's tokens, by request id: none for a sequence the
        head has no hidden states of, or whose drafts find no pages. A head in the target's pages drafts no
        further than they reach (the step's own are allocated after its drafts)."""
        rooms: dict[int, int] = {}
        batch = ScheduledBatch()
        for seq, room in wanted:
            eagle = self._draft_sequence(seq)
            if not eagle.take_features(seq.num_computed_tokens):
                continue
            if self.pool_layers:
                room = min(room, len(seq.block_table) * self.block_size - eagle.num_features + 1)
            # Pages for its inputs up to its last draft's input (the last draft is no input).
            if self._reserve(eagle, eagle.num_features + room - 1):
                self._add(batch, eagle, room, rooms)
        return self._drafts(batch, rooms)

    def prefilled(self, seq: Sequence, room: int) -> list[int]:
        """A prompt computed for a decode worker, its first token sampled: a head in the target's pages computes
        its KV of the prompt's last positions into them, before they go, and up to `room` drafts for what follows
        (the first from the same forward): only here is the prompt's last hidden state, so the decode worker's
        first step takes them rather than none. (The drafts' own KV past the prompt, in its last page, is computed
        again there.)"""
        eagle = self._held.get(seq.request_id)
        if not self.pool_layers or eagle is None or eagle.owner is not seq:
            return []
        if room > 0:
            return self.propose([(seq, room)]).get(seq.request_id, [])
        if eagle.take_features(seq.num_computed_tokens) and self._reserve(eagle, eagle.num_features):
            self._take_in([eagle])
        return []

    def forget(self, request_id: str) -> None:
        if self.pool_layers:  # its pages are its owner's
            self._held.pop(request_id, None)
        else:
            super().forget(request_id)

    def _reserve(self, draft: EagleSequence, num_positions: int) -> bool:
        if not self.pool_layers:
            return super()._reserve(draft, num_positions)
        draft.block_table = list(draft.owner.block_table)
        return num_positions <= len(draft.block_table) * self.block_size

    def _take_in(self, eagles: list[EagleSequence]) -> None:
        """Compute each one's inputs taken in and not yet computed (no draft made)."""
        batch = ScheduledBatch()
        for eagle in eagles:
            batch.add(eagle, eagle.num_tokens - eagle.num_computed_tokens)
        self.runner.forward_hidden(batch)
        for eagle in eagles:
            eagle.num_computed_tokens = eagle.num_tokens

    def _forward(self, batch: ScheduledBatch) -> tuple[list[EagleSequence], list[int], torch.Tensor]:
        """Each sampled sequence's greedy draft, and the head's output there: the next draft's feature."""
        sampled, hidden = self.runner.forward_hidden(batch)
        outputs = hidden[last_rows(sampled, hidden.device)]
        return sampled, self.runner.model.draft_tokens(outputs).tolist(), outputs

    def _feed(self, draft: EagleSequence, output: torch.Tensor) -> None:
        draft.given_embeddings = ((draft.num_tokens - 1, output.unsqueeze(0)),)

    def _draft_sequence(self, seq: Sequence) -> EagleSequence:
        eagle = self._held.get(seq.request_id)
        if eagle is None or eagle.owner is not seq:  # (an id used again: none of its KV is this one's)
            self.forget(seq.request_id)
            # A head of multimodal RoPE reads its owner's positions (its input j at the owner's position j).
            positions = seq.rope_positions if self.runner.model_config.mrope_section is not None else None
            eagle = self._held[seq.request_id] = EagleSequence(seq, masks_first=self._masks_first,
                                                               in_owners_pages=self.pool_layers > 0,
                                                               rope_positions=positions)
        return eagle

    def _take_rows(self, seq_rows: list[tuple[Sequence, int, int]], features: torch.Tensor) -> None:
        """The target runner's hidden states of a step (ModelRunner.hidden_listener): kept for each sequence that
        may decode, by the positions they were computed at."""
        # (A prompt prefilled for a decode worker: taken in where the head's KV goes with its pages.)
        kept = [(seq, first, n) for seq, first, n in seq_rows
                if (self.pool_layers or not seq.is_prefill_only) and not seq.sampling_params.embed]
        if not kept:
            return
        features = self.runner.model.combine(features)
        taken = []
        for seq, first, n in kept:
            eagle = self._draft_sequence(seq)
            eagle.add_rows(seq.num_computed_tokens, features[first:first + n].clone())
            # A chunk of a prompt that goes on: every token after its positions is known, so the head takes them in
            # now, a chunk at a time, rather than the whole prompt's at its first drafts (held till then).
            end = seq.num_computed_tokens + n
            if end < seq.num_prompt_tokens and eagle.take_features(end) and self._reserve(eagle, eagle.num_features):
                taken.append(eagle)
        if taken:
            self._take_in(taken)
