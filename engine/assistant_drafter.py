"""Speculative drafts from Gemma 4's assistant models (`{"model": "google/gemma-4-e2b-it-assistant", ...}`;
engine/gemma4_assistant_config.py), as transformers' Gemma4AssistantCandidateGenerator makes them: after each step,
for each sequence, from the target's hidden state at its last computed position and the target's embedding of the
token after it (the one it is about to compute), the assistant drafts a token at that token's position, attending
over the target's pages up to it; each further draft reads the assistant's own projected output and the same pages
at the same position (the drafts keep no KV). What it cannot draft for gets no drafts: the target verifies them, so
the tokens are the target's whatever the drafts.

Where transformers' generator also reads the KV the target computed for a rejected draft (its cache cut to the
tokens, one position past the verified ones), the assistant here reads the verified tokens' alone: its drafts after
a rejection may differ from transformers', never the tokens.
"""
from __future__ import annotations

import torch

from engine.attention_metadata import AttentionMetadata
from engine.gemma4_assistant_config import load_assistant_config
from engine.model_runner import ModelRunner
from engine.sequence import Sequence


class AssistantDrafter:
    """The scheduler's drafter for a Gemma 4 assistant model directory."""

    reads_served_checkpoint = False  # (its weights are its own directory's: engine/memory_release.py reads them again)

    def __init__(self, model_dir: str, num_speculative_tokens: int, target: ModelRunner, dtype: torch.dtype,
                 device: str, max_positions: int) -> None:
        """ValueError for an assistant that cannot draft for `target`'s model."""
        if target.tensor_parallel_size > 1:
            raise ValueError("a Gemma 4 assistant does not draft for a target split across tensor-parallel ranks yet")
        if target.hidden_listener is not None:
            raise ValueError("the target's hidden states are read by another drafter already")
        config = load_assistant_config(model_dir, target.model_config)
        self.model_dir, self.num_speculative_tokens, self.target = model_dir, num_speculative_tokens, target
        self.runner = ModelRunner(model_dir, config, dtype, device, max_positions)
        # By request: its owner, the position of the first of the rows kept, and the target's hidden states there.
        self._hidden: dict[str, tuple[Sequence, int, torch.Tensor]] = {}
        target.hidden_listener = self._take_rows

    def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[str, list[int]]:
        """Up to `room` greedy drafts for each sequence whose target hidden state at its last computed position is
        held (none for one whose last step ran elsewhere: a decode worker's first, after a prefill worker's)."""
        rows = [(seq, room, hidden) for seq, room in wanted if room > 0
                for hidden in [self._last_hidden(seq)] if hidden is not None]
        if not rows:
            return {}
        tokens, _ = self.drafted([seq for seq, _, _ in rows], torch.stack([h for _, _, h in rows]),
                                 max(room for _, room, _ in rows))
        return {seq.request_id: tokens[:room, i].tolist() for i, (seq, room, _) in enumerate(rows)}

    def drafted(self, seqs: list[Sequence], hidden: torch.Tensor, num_drafts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`num_drafts` drafts after each of `seqs` from the target's hidden states `hidden` [B, H] at their last
        computed positions: the tokens [num_drafts, B] and the hidden states each draft hands the next [num_drafts, B,
        H]."""
        device = self.runner.device
        context = torch.tensor([seq.num_computed_tokens for seq in seqs], dtype=torch.int64, device=device)
        width = max(len(seq.block_table) for seq in seqs)
        tables = torch.tensor([seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs],
                              dtype=torch.int64, device=device)
        # Each row a decode row of the verified tokens' pages (the query at the last one's place, so a sliding window
        # reaches its width back from it), its RoPE at the position of the token it follows.
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
                                 num_decode_tokens=len(seqs), decode_block_tables=tables, decode_context_lens=context,
                                 prefills=(), positions=context)
        tokens = torch.tensor([seq.token_ids[-1] for seq in seqs], device=device)
        hidden = hidden.to(self.runner.dtype)
        drafts, states = [], []
        with torch.inference_mode():
            for _ in range(num_drafts):
                embedded = self.target.model._embed(tokens).to(hidden.dtype)
                tokens, hidden = self.runner.model.draft(torch.cat((embedded, hidden), dim=-1), context, meta,
                                                         self.target.kv_pool.layers)
                drafts.append(tokens)
                states.append(hidden)
        return torch.stack(drafts), torch.stack(states)

    def prefilled(self, seq: Sequence, room: int) -> list[int]:
        """No drafts go with a prompt a prefill worker computed: the decode worker drafts after its first step."""
        return []

    def forget(self, request_id: str) -> None:
        self._hidden.pop(request_id, None)

    def _last_hidden(self, seq: Sequence) -> torch.Tensor | None:
        held = self._hidden.get(seq.request_id)
        if held is None or held[0] is not seq:
            return None
        _, start, rows = held
        index = seq.num_computed_tokens - 1 - start
        return rows[index] if 0 <= index < rows.shape[0] else None

    def _take_rows(self, seq_rows: list[tuple[Sequence, int, int]], hidden: torch.Tensor) -> None:
        """The target runner's hidden states of a step (ModelRunner.hidden_listener): a prompt chunk's last, or every
        row of a decode step (its drafts' too: which of them the next drafts read, the sampling decides)."""
        for seq, first, n in seq_rows:
            if seq.is_prefill_only or seq.sampling_params.embed:
                continue
            keep = n if seq.num_draft_tokens else 1
            self._hidden[seq.request_id] = (seq, seq.num_computed_tokens + n - keep,
                                            hidden[first + n - keep:first + n].clone())
