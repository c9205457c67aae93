"""Llama-family decoder (Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE) over paged KV.

The forward is pure apart from writing the new tokens' K/V into the pages it is
handed: token ids, positions and attention metadata in, hidden states out. Its layers
are engine/models/llama_layers.py's; this module stacks them and names their weights.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.architectures import MIMO, MIXTRAL_NAMED
from engine.attention_metadata import AttentionMetadata
from engine.lora import LoRABatch, LoRAHook, Target
from engine.mellum_config import MELLUM
from engine.mimo_v2_flash_config import MIMO_V2_FLASH
from engine.model_config import ModelConfig
from engine.models.alibi import alibi_slopes
from engine.models.llama_layers import MLP, Attention, DecoderLayer, KVCache, RankSum
from engine.models.moe import SparseMoE
from engine.models.parameters import empty_param
from engine.moe_config import ERNIE45_MOE, EXAONE_MOE
from engine.prompt_embeds import GivenEmbeddings
from engine.rope_config import HUNYUAN_MOE
from kernels.registry import Kernels
from kernels.rotary import build_rope_cache, mrope_kinds, pairs_half_apart

FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")  # Qwen3-VL-MoE's (MoEConfig.fused_experts)

MIXTRAL_EXPERT_PROJS = {"w1": "gate", "w3": "up", "w2": "down"}
# Checkpoints carrying multi-token prediction blocks beside the model, by the prefix of their tensors' names: left
# unread, as transformers (Ernie 4.5's, Mellum's) and vLLM's model (MiMo's) leave them.
MTP_BLOCKS = {ERNIE45_MOE: "model.mtp", MIMO: "model.mtp_layers.", MELLUM: "mtp.", MIMO_V2_FLASH: "model.mtp."}
# q's and k's norms, as most checkpoints name them and as HunYuan's (whose norms follow RoPE) do.
QK_NORM_NAMES = {False: ("q_norm", "k_norm"), True: ("query_layernorm", "key_layernorm")}
# What RoPE turns: q's and k's rows, which a model storing each pair side by side (ModelConfig.rope_interleaved)
# has reordered as they load.
ROPE_TURNED = tuple(f"self_attn.{x}_proj.{kind}" for x in "qk" for kind in ("weight", "bias"))


@dataclass(frozen=True)
class VocabularyShare:
    """The run of a split vocabulary's token rows one rank holds: from `start`, of a vocabulary of `size`."""

    start: int
    size: int
    num_ranks: int
    rank_sum: RankSum


class LlamaForCausalLM(nn.Module):
    # Set by an EAGLE-3 head drafting for this model (engine/eagle.py): the layers whose inputs each forward keeps,
    # side by side in `captured` ([T, hidden * len(captured_layers)]), as vLLM's aux hidden states.
    captured_layers: tuple[int, ...] = ()
    captured: torch.Tensor | None = None
    # Set where the model is split across ranks with its vocabulary (engine/tensor_parallel.py): this rank's first
    # token row, the whole vocabulary's size, and the sum across the ranks.
    vocabulary: VocabularyShare | None = None

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.kernels = kernels
        self.embed = empty_param(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(self._make_layer(i, dtype) for i in range(config.num_layers))
        self.lora_batch = LoRABatch()  # the adapters of the step running; none, outside serve_loras()
        self.has_loras = False
        self.norm = empty_param(config.hidden_size, dtype=dtype)
        self.lm_head = (self.embed if config.tie_word_embeddings
                        else empty_param(config.vocab_size, config.hidden_size, dtype=dtype))
        # A sequence classifier's head (`score`): a row of logits per label from the last hidden state.
        self.classifier = (empty_param(len(config.labels), config.hidden_size, dtype=dtype)
                           if config.labels and not config.classifier_tokens else None)
        if config.mrope_section is not None:
            self.register_buffer("mrope_kinds", mrope_kinds(config.mrope_section, config.mrope_interleaved),
                                 persistent=False)
        self._register_ropes(max_positions)
        self._has_one_rope = (config.local_rope_theta is None and config.local_rotary_dim is None
                              and config.rope_layers == frozenset(range(config.num_layers)))

    def _register_ropes(self, max_positions: int) -> None:
        """Its cos and sin tables by position: the model's, and the sliding-window layers' own where they have one."""
        config = self.config
        cos, sin = build_rope_cache(config.rotary_dim, max_positions, config.rope_theta, config.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if config.local_rope_theta is not None:  # the sliding-window layers' own, unscaled
            cos, sin = build_rope_cache(config.local_rotary_dim or config.rotary_dim, max_positions,
                                        config.local_rope_theta, None)
            self.register_buffer("local_rope_cos", cos, persistent=False)
            self.register_buffer("local_rope_sin", sin, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        given: GivenEmbeddings | None = None,
    ) -> torch.Tensor:
        # input_ids, positions: [T]; returns hidden states [T, H]. `given`: prompt rows whose
        # embeddings replace the embedding module's (as transformers' inputs_embeds do), before any
        # scaling the model applies to its inputs.
        h = self._embed(input_ids)
        if given is not None:
            h = given.placed(h)
        h = self._scaled_inputs(h, positions)
        num_added = given.num_added_layers(h.shape[1]) if given is not None else 0
        captured = []
        for i, (layer, kv_cache, (cos, sin)) in enumerate(zip(self.layers, kv_caches, self._ropes(positions))):
            if i in self.captured_layers:
                captured.append(h)
            h = layer(h, cos, sin, kv_cache, meta)
            if i < num_added:
                h = given.added_after(i, h)
        if captured:
            self.captured = torch.cat(captured, dim=-1)
        return self._final_norm(h)

    def _final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(h, self.norm, self.config.rms_norm_eps)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """What transformers' input embeddings module gives for `input_ids` (the rank holding a token's row gives
        it, where the vocabulary is split)."""
        if self.vocabulary is None:
            return F.embedding(input_ids, self.embed)
        local = input_ids - self.vocabulary.start
        held = (local >= 0) & (local < self.embed.shape[0])
        embedded = F.embedding(local.clamp(0, self.embed.shape[0] - 1), self.embed)
        return self.vocabulary.rank_sum(embedded.masked_fill(~held.unsqueeze(-1), 0.0))

    def _scaled_inputs(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The model's own scaling of its input embeddings, given or looked up (and what it adds to them by position:
        OPT's learnt embeddings of positions)."""
        return h

    def serve_loras(self) -> None:
        """Hooks every attention and dense MLP projection of its layers to the step's LoRA adapters, and every other
        module of theirs that takes them (`takes_lora`: Gemma 4's attention, a hybrid's recurrent layers'), whatever
        the layer calls it (a model serving none keeps projections without them)."""
        if self.has_loras:
            return
        for i, layer in enumerate(self.layers):
            for module in layer.modules():
                if isinstance(module, (Attention, MLP)) or getattr(type(module), "takes_lora", False):
                    module.lora = LoRAHook(self.lora_batch, i)
        self.has_loras = True

    def sum_across_ranks(self, rank_sum: RankSum, num_ranks: int, rank: int, vocab_size: int | None) -> None:
        """Ends every layer's attention and MLP in `rank_sum`: this model holds rank `rank` of `num_ranks`' share
        of their heads and width (engine/tensor_parallel.py), and of the rows of a vocabulary of `vocab_size`
        tokens where it is split with them (None: whole)."""
        # ALiBi's slopes are the whole model's heads': a rank's are its run of them
        slopes = None if self.config.alibi is None else \
            alibi_slopes(self.config.alibi, self.config.num_heads * num_ranks).chunk(num_ranks)[rank]
        for layer in self.layers:
            layer.attn.rank_sum = layer.mlp.rank_sum = rank_sum
            layer.attn.num_ranks = num_ranks
            if slopes is not None:
                layer.attn.alibi_slopes = slopes.to(layer.attn.alibi_slopes)
        if vocab_size is not None:
            self.vocabulary = VocabularyShare(rank * self.embed.shape[0], vocab_size, num_ranks, rank_sum)

    def lora_target(self, module: str) -> Target | None:
        """Where a LoRA on projection `module` (`model.layers.3.self_attn.q_proj`; a multimodal checkpoint's its own
        model's name of it, `model.language_model.layers.3.self_attn.q_proj`) adds to this model's fused weights;
        None for one it does not serve (embeddings, the LM head, experts, an image encoder's)."""
        if self.config.multimodal is not None:  # named as in the multimodal model: its language model's, or none
            module = self.config.multimodal.text_name(module) or ""
        parts = module.split(".")
        if len(parts) != 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            return None
        layer = int(parts[2])
        return self._lora_rows(layer, parts[3], parts[4]) if layer < self.config.num_layers else None

    def _lora_rows(self, layer: int, place: str, proj: str) -> Target | None:
        """`lora_target` of `place`'s (self_attn, mlp) projection `proj` of `layer`."""
        cfg, inter = self.config, self.config.intermediate_size
        if place == "self_attn":
            rows = self._qkv_rows(layer)
            rows["qkv_proj"] = (0, rows["v_proj"][1])
            if proj == "o_proj":
                return layer, "o", 0, cfg.hidden_size
            return (layer, "qkv", *rows[proj]) if proj in rows else None
        if place == "mlp" and not self._is_sparse(layer):
            rows = {"gate_proj": (0, inter), "up_proj": (inter, 2 * inter), "gate_up_proj": (0, 2 * inter)} \
                if self.config.mlp_gated else {"up_proj": (0, inter)}
            if proj == "down_proj":
                return layer, "down", 0, cfg.hidden_size
            return (layer, "gate_up", *rows[proj]) if proj in rows else None
        return None

    def _qkv_rows(self, layer: int) -> dict[str, tuple[int, int]]:
        """Where q's, k's and v's projections lie in layer `layer`'s fused one: its own q heads where the model gives
        each layer its own (ModelConfig.layer_num_heads)."""
        cfg = self.config
        q = cfg.q_size if cfg.layer_num_heads is None else cfg.layer_num_heads[layer] * cfg.head_dim
        return {"q_proj": (0, q), "k_proj": (q, q + cfg.kv_size), "v_proj": (q + cfg.kv_size, q + 2 * cfg.kv_size)}

    def lora_matrices(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An adapter's A and B on projection `module` as this model holds the projection: q's and k's B rows
        reordered as their weights' are where RoPE's pairs lie side by side in the checkpoint."""
        if self.config.rope_interleaved and module.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            b = _rope_rows_paired_apart(b, self.config.head_dim, self.config.rotary_dim)
        return a, b

    def _ropes(self, positions: torch.Tensor) -> Iterable[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Each layer's cos and sin at `positions` ([T, D] each): the model's, the sliding-window
        layers' own where they have one (Gemma 3, OLMo 3), None for a layer without RoPE (SmolLM3).
        `positions` [3, T]: multimodal RoPE's time, height and width positions, each turning its section."""
        def at(table: torch.Tensor) -> torch.Tensor:
            return self._mrope(table, positions) if positions.dim() == 2 else table[positions]
        full = at(self.rope_cos), at(self.rope_sin)
        if self._has_one_rope:
            return itertools.repeat(full)
        local = (at(self.local_rope_cos), at(self.local_rope_sin)) if self.config.local_rope_theta is not None else full
        return [(None, None) if i not in self.config.rope_layers else local if layer.attn.sliding_window is not None
                else full for i, layer in enumerate(self.layers)]

    def _mrope(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T, D] of `table` (cos or sin by position), each of a head's dimensions at the position of its kind
        (`mrope_kinds`)."""
        by_kind = table[positions]  # [3, T, D]
        kinds = self.mrope_kinds.view(1, 1, -1).expand(1, *by_kind.shape[1:])
        return by_kind.gather(0, kinds)[0]

    def make_classifier(self, token_ids: list[int]) -> None:
        """The classification head from the LM head's rows of `token_ids` (ModelConfig.classifier_tokens):
        those rows, or the second minus the first (classifier_difference)."""
        rows = self.lm_head.detach()[token_ids]
        self.classifier = (rows[1] - rows[0]).unsqueeze(0) if self.config.classifier_difference else rows

    def classify(self, last_state: torch.Tensor) -> torch.Tensor:
        """A sequence classifier's logits from its input's last hidden state [H] (its embedding)."""
        return F.linear(last_state, self.classifier.float())

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] → logits [N, V] in float32 for the sampler. Where the vocabulary is split, every rank
        makes its run of columns and they are summed into the whole on each (every rank calls this in turn)."""
        logits = self._lm_head_logits(hidden)
        if self.vocabulary is not None:
            vocabulary = self.vocabulary
            whole = logits.new_zeros(logits.shape[0], self.lm_head.shape[0] * vocabulary.num_ranks)
            whole[:, vocabulary.start:vocabulary.start + logits.shape[1]] = logits
            logits = vocabulary.rank_sum(whole)[:, :vocabulary.size]
        if self.config.output_vocab_size is not None:  # a pruned head's rows past its own: zeros, never a token
            logits[:, self.config.output_vocab_size:] = float("-inf")
        return logits

    def _lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's run of the logits' columns (all of them where the vocabulary is whole), in float32."""
        return self.kernels.linear(hidden, self.lm_head).float()

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return DecoderLayer(self._layer_config(layer), self.kernels, dtype, self._window(layer), self._is_sparse(layer))

    def _layer_config(self, layer: int) -> ModelConfig:
        """The config layer `layer` computes by: the model's, with the layer's own q heads and, in a sliding-window
        layer, its RoPE's width, where the model gives them (ModelConfig.layer_num_heads, local_rotary_dim)."""
        cfg, changes = self.config, {}
        if cfg.layer_num_heads is not None:
            changes["num_heads"] = cfg.layer_num_heads[layer]
        if cfg.local_rotary_dim is not None and layer in cfg.sliding_layers:
            changes["rotary_dim"] = cfg.local_rotary_dim
        return dataclasses.replace(cfg, **changes) if changes else cfg

    def _window(self, layer: int) -> int | None:
        return self.config.sliding_window if layer in self.config.sliding_layers else None

    def _is_sparse(self, layer: int) -> bool:
        return self.config.moe.is_sparse(layer)

    # --- weights -----------------------------------------------------------------

    def checkpoint_names(self) -> list[str]:
        """Every tensor name this model reads from a Hugging Face checkpoint."""
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.config.tie_word_embeddings:
            names.append("lm_head.weight")
        if self.config.labels and not self.config.classifier_tokens:
            names.append("score.weight")
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            names += self._attention_names(i) + self._mlp_names(i) + [p + f"{x}.weight" for x in self._norm_names()]
        return names

    # A checkpoint's names against Llama's, where they differ: (theirs, ours) fragments each name is read with, the
    # more particular first (engine/weights.renamed; the runner reads the checkpoint so: ModelRunner._load_shard).
    renames: tuple[tuple[str, str], ...] = ()

    # Checkpoints of models trained to predict several tokens (GLM-4.5, DeepSeek-V3) carry layers past
    # the model's, which only speculative decoding reads; transformers leaves them unread too.
    has_mtp_layers = False
    # Whether engine/tensor_parallel.py splits it across ranks: its layers are llama_layers.py's Attention and MLP (or
    # mla.py's attention, moe.py's experts), each of its models split in the parity tests. A model of layers of its
    # own says False.
    splits_across_ranks: ClassVar[bool] = True

    def fill_absent(self, name: str) -> bool:
        """Fills tensor `name`, which the checkpoint lacks, where the model computes as its releases do without it
        (True); False where it must be there."""
        return False

    def is_unused_tensor(self, name: str) -> bool:
        """A checkpoint tensor this model does not read, which is not a sign of a setting it ignores."""
        parts = name.split(".")
        if self.config.architecture in MTP_BLOCKS and name.startswith(MTP_BLOCKS[self.config.architecture]):
            return True
        return (self.has_mtp_layers and len(parts) > 2 and parts[:2] == ["model", "layers"]
                and int(parts[2]) >= self.config.num_layers)

    def _norm_names(self) -> tuple[str, ...]:
        """Each layer's norms, as the checkpoint names them."""
        return "input_layernorm", "post_attention_layernorm"

    def _attention_names(self, layer: int) -> list[str]:
        p = f"model.layers.{layer}.self_attn."
        names = [p + f"{x}_proj.weight" for x in "qkvo"]
        if self.config.qkv_bias:
            names += [p + f"{x}_proj.bias" for x in "qkv"]
        if self.config.o_bias:
            names.append(p + "o_proj.bias")
        if self.config.qk_norm:
            names += [p + f"{norm}.weight" for norm in QK_NORM_NAMES[self.config.qk_norm == "head_after_rope"]]
        if self.config.attention_sinks:
            names.append(p + "sinks")
        return names

    def _mlp_names(self, layer: int) -> list[str]:
        p = f"model.layers.{layer}."
        if not self._is_sparse(layer):
            kinds = ("weight", "bias") if self.config.mlp_bias else ("weight",)
            projs = ("gate", "up", "down") if self.config.mlp_gated else ("up", "down")
            return [p + f"mlp.{x}_proj.{kind}" for x in projs for kind in kinds]
        moe = self.config.moe
        if self.config.architecture in MIXTRAL_NAMED:
            names = [p + "block_sparse_moe.gate.weight"] + [
                p + f"block_sparse_moe.experts.{e}.{w}.weight" for e in range(moe.num_experts)
                for w in ("w1", "w2", "w3")]
            return names + [p + "block_sparse_moe.e_score_correction_bias"] if moe.scoring == "sigmoid" else names
        is_hunyuan = self.config.architecture == HUNYUAN_MOE  # its router under gate.wg, its shared MLP shared_mlp
        names = [p + ("mlp.gate.wg.weight" if is_hunyuan else "mlp.gate.weight")]
        names += [p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj"] if moe.fused_experts else \
            [p + f"mlp.experts.{e}.{x}_proj.weight" for e in range(moe.num_experts) for x in ("gate", "up", "down")]
        if moe.scoring == "sigmoid":  # (beside the router in K-EXAONE's)
            names.append(p + ("mlp.e_score_correction_bias" if self.config.architecture == EXAONE_MOE
                              else "mlp.gate.e_score_correction_bias"))
        if moe.choice_bias:  # Ernie 4.5's, [1, E]
            names.append(p + "mlp.moe_statics.e_score_correction_bias")
        if moe.shared_expert_intermediate_size:  # Qwen2-MoE's one gated shared expert, GLM's shared experts
            shared = "mlp.shared_expert" if moe.shared_expert_gated else \
                "mlp.shared_mlp" if is_hunyuan else "mlp.shared_experts"
            names += [p + f"{shared}.{x}_proj.weight" for x in ("gate", "up", "down")]
            if moe.shared_expert_gated:
                names.append(p + "mlp.shared_expert_gate.weight")
        return names

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors into place, fusing q/k/v and gate/up; checks shapes."""
        for name, tensor in tensors:
            target, tensor = self._placed(name, tensor)
            if target.shape != tensor.shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)

    def _placed(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where checkpoint tensor `name` goes, and the tensor as it goes there (a model that stores
        some tensors otherwise reorders or transposes them here)."""
        target = self._target(name)
        if name == "lm_head.weight" and self.config.output_vocab_size is not None:  # a pruned head: its first rows
            target = target[:tensor.shape[0]]
        if name.endswith(FUSED_EXPERTS) and tensor.shape != target.shape:  # [E, in, out], as released
            tensor = tensor.transpose(1, 2)
        if self.config.rope_interleaved and name.endswith(ROPE_TURNED):
            tensor = _rope_rows_paired_apart(tensor, self.config.head_dim, self.config.rotary_dim)
        return target, tensor

    def _target(self, name: str) -> torch.Tensor:
        cfg = self.config
        if name == "model.embed_tokens.weight":
            return self.embed.data
        if name == "model.norm.weight":
            return self.norm.data
        if name == "lm_head.weight":
            return self.lm_head.data
        if name == "score.weight":
            return self.classifier.data
        parts = name.split(".")
        layer = self.layers[int(parts[2])]
        module, leaf = parts[3], ".".join(parts[4:])
        inter = cfg.intermediate_size
        if module == "self_attn":
            if parts[4] == "sinks":
                return layer.attn.sinks.data
            proj, kind = parts[4], parts[5]
            if proj == "o_proj":
                return (layer.attn.o_weight if kind == "weight" else layer.attn.o_bias).data
            if proj == "g_proj":  # a gated attention's gate (GatedOutputAttention's: Step-3.7's, Laguna's)
                return layer.attn.g_weight.data
            if proj in ("q_norm", "k_norm", "query_layernorm", "key_layernorm"):
                return (layer.attn.q_norm if proj in ("q_norm", "query_layernorm") else layer.attn.k_norm).data
            lo, hi = self._qkv_rows(int(parts[2]))[proj]
            return (layer.attn.qkv_weight if kind == "weight" else layer.attn.qkv_bias).data[lo:hi]
        if module in ("mlp", "block_sparse_moe") and isinstance(layer.mlp, SparseMoE):
            if parts[4] == "e_score_correction_bias":  # beside the router (MiniMax-M2's)
                return layer.mlp.router_bias.data
            if parts[4] == "moe_statics":  # Ernie 4.5's, [1, E]
                return layer.mlp.router_bias.data.view(1, -1)
            if parts[4] == "gate":  # the router
                is_bias = parts[5] == "e_score_correction_bias"
                return (layer.mlp.router_bias if is_bias else layer.mlp.router_weight).data
            if parts[4] == "shared_expert_gate":
                return layer.mlp.shared_slice("weight_gate")
            if parts[4] in ("shared_expert", "shared_experts", "shared_mlp"):
                return layer.mlp.shared_slice(parts[5].removesuffix("_proj"))
            if leaf in FUSED_EXPERTS:  # every expert's at once, [E, out, in]
                return (layer.mlp.gate_up_weight if leaf == "experts.gate_up_proj" else layer.mlp.down_weight).data
            proj = MIXTRAL_EXPERT_PROJS.get(parts[6], parts[6].removesuffix("_proj"))
            return layer.mlp.weight_slice(int(parts[5]), proj)
        if module == "mlp":
            proj, is_weight = parts[4], parts[5] == "weight"
            if proj == "down_proj":
                return (layer.mlp.down_weight if is_weight else layer.mlp.down_bias).data
            gate_up = (layer.mlp.gate_up_weight if is_weight else layer.mlp.gate_up_bias).data
            if not layer.mlp.is_gated:  # up's rows alone
                return gate_up
            return gate_up[:inter] if proj == "gate_proj" else gate_up[inter:]
        if module == "input_layernorm":
            return layer.input_norm.data
        if module == "post_attention_layernorm":
            return layer.post_attention_norm.data
        raise KeyError(f"unexpected checkpoint tensor {name!r} ({leaf})")


def rope_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """A head's dimensions in the order the kernels turn them, where a checkpoint stores RoPE's pairs side by side in
    the first `rotary_dim` (kernels/rotary.py)."""
    return torch.cat((pairs_half_apart(rotary_dim), torch.arange(rotary_dim, head_dim)))


def _rope_rows_paired_apart(weight: torch.Tensor, head_dim: int, rotary_dim: int) -> torch.Tensor:
    # Each head's rows reordered: attention is the same whichever layers use RoPE, q and k being reordered alike.
    rows = (torch.arange(weight.shape[0] // head_dim)[:, None] * head_dim + rope_order(head_dim, rotary_dim))
    return weight[rows.reshape(-1)]
