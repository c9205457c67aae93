"""What an EAGLE draft head's directory says of it (vLLM's `{"method": "eagle"}` and `{"method": "eagle3"}`), or of
a checkpoint's multi-token prediction layer (`{"method": "mtp"}`): engine/eagle.py drafts with them,
engine/models/eagle.py and engine/models/mtp.py compute them."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EagleConfig:
    # "eagle" (EAGLE-1: the target's last hidden states), "eagle3" (three of its layers' inputs) or "mtp" (a
    # multi-token prediction layer of the target's checkpoint: engine/models/mtp.py)
    method: str
    draft_vocab_size: int  # EAGLE-3's own LM head's rows, each a target token (`d2t`); the target's vocabulary else
    target_hidden_size: int  # the width of each target hidden state it reads
    # Tensors its checkpoint holds: EAGLE-1's fc bias; EAGLE-3's own embeddings, LM head and draft-to-target ids
    # (without them, the target's embeddings and LM head serve, over the whole vocabulary).
    has_fc_bias: bool = False
    has_embeddings: bool = False
    has_lm_head: bool = False
    has_draft_ids: bool = False
    # EAGLE-3's: the target layers whose inputs it reads (config.json's eagle_aux_hidden_state_layer_ids, or
    # vLLM's default, early, middle and late), and whether the feature is normed before it joins the residual.
    target_layers: tuple[int, ...] = ()
    norm_before_residual: bool = False
    first_layer_name: str = "layers.0."  # EAGLE-3's releases name it "midlayer."
    mtp_layer: int = 0  # an MTP head's layer's index in the checkpoint (the target's layer count)
    masks_first: bool = False  # its input at position 0 has its embedding zeroed (DeepSeek-V3's MTP layer's)
