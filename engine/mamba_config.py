"""The Mamba-2 layers of Granite 4.0-H (GraniteMoeHybridForCausalLM) and Nemotron-H (NemotronHForCausalLM), read
from their config.json: which layers attend over pages and what the others keep instead.

A Mamba-2 layer keeps no KV a token: a sequence's past is its state, a matrix a head (head_dim x state_size) that
every token decays by exp(dt * A) and writes dt * x B^T into, read by C, and the last `conv_kernel - 1` inputs of
its short causal convolution (engine/recurrent_state.py keeps both in the sequence's pages). Layer kinds are named
as transformers names them now ("linear_attention", "full_attention") or as released ("mamba", "attention").
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.state_shape import StateShape

NEMOTRON_H = "NemotronHForCausalLM"
MAMBA2_LM = "Mamba2ForCausalLM"  # Mamba-2's layers alone (Mamba-Codestral), its pages the states' (mamba1_config.py)
FALCON_H1 = "FalconH1ForCausalLM"
BAMBA = "BambaForCausalLM"
# PARALLEL: a layer of attention and Mamba-2 side by side, on the same input (Falcon-H1's).
MAMBA, ATTENTION, MLP, MOE, PARALLEL = "mamba", "attention", "mlp", "moe", "parallel"
# How a Mamba-2 layer's output meets its gate z: RMS-normed in groups after the gate (Granite's, Nemotron-H's),
# before it, or not normed (Falcon-H1's mamba_rms_norm false).
NORM_AFTER_GATE, NORM_BEFORE_GATE, NO_NORM = "after_gate", "before_gate", "none"
KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION}
# Nemotron-H's layers, each one of these (its hybrid_override_pattern's letters, as released; E: Nemotron 3's experts).
NEMOTRON_KINDS = {**KINDS, "mlp": MLP, "moe": MOE, "M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}


@dataclass(frozen=True)
class Mamba2Layout:
    layer_types: tuple[str, ...]  # MAMBA, ATTENTION, PARALLEL or (Nemotron-H's) MLP or MOE, a layer
    num_heads: int
    head_dim: int
    state_size: int
    num_groups: int  # of B and C, each serving num_heads / num_groups heads in turn
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    dt_limit: tuple[float, float]  # each token's dt clamped to it
    out_proj_bias: bool | None = None  # None: as proj_bias (Falcon-H1's projectors_bias is a switch of its own)
    gated_norm: str = NORM_AFTER_GATE
    norm_eps: float | None = None  # the gated norm's own (Zamba2's 1e-5); None: the model's rms_norm_eps

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind in (MAMBA, PARALLEL))

    @property
    def kv_places(self) -> dict[int, int]:
        """Each attention layer's layer of the pages."""
        attention = (i for i, kind in enumerate(self.layer_types) if kind in (ATTENTION, PARALLEL))
        return {layer: place for place, layer in enumerate(attention)}

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The channels convolved: x, B and C side by side."""
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    @property
    def state_shape(self) -> StateShape | None:
        """None for blocks without a Mamba-2 layer (Nemotron-H's MTP layer: engine/models/nemotron_h_mtp.py)."""
        if not self.mamba_layers:
            return None
        return StateShape(len(self.mamba_layers), self.conv_dim, self.conv_kernel - 1, self.num_heads,
                          self.head_dim, self.state_size)


def read_mamba2(cfg: dict) -> Mamba2Layout | None:
    """The Mamba-2 layers of a Granite 4.0 config.json; None where it has none (4.0-Micro's attention-only
    checkpoints). ValueError for other layer kinds, or a model of Mamba-2 layers alone."""
    num_layers = int(cfg["num_hidden_layers"])
    given = cfg.get("layer_types") or cfg.get("layers_block_type") or ["linear_attention"] * num_layers
    unknown = sorted(set(given) - set(KINDS))
    if unknown or len(given) != num_layers:
        raise ValueError(f"layer_types must name Mamba or attention layers, one a layer of {num_layers}, got "
                         f"{unknown or len(given)}")
    kinds = tuple(KINDS[kind] for kind in given)
    if MAMBA not in kinds:
        return None
    if ATTENTION not in kinds:
        raise ValueError("a model of Mamba-2 layers alone is not supported (its pages would hold nothing)")
    hidden = int(cfg["hidden_size"])
    num_heads = int(cfg.get("mamba_n_heads", 128))
    head_dim = cfg.get("mamba_d_head", "auto")
    intermediate = int(cfg.get("mamba_expand", 2)) * hidden
    head_dim = intermediate // num_heads if head_dim == "auto" else int(head_dim)
    if head_dim * num_heads != intermediate:
        raise ValueError(f"mamba_n_heads {num_heads} x mamba_d_head {head_dim} must be mamba_expand x hidden_size "
                         f"({intermediate})")
    num_groups = int(cfg.get("mamba_n_groups", 1))
    if num_heads % num_groups:
        raise ValueError(f"mamba_n_groups {num_groups} must divide mamba_n_heads {num_heads}")
    low, high = cfg.get("time_step_limit") or (0.0, float("inf"))
    return Mamba2Layout(kinds, num_heads, head_dim, int(cfg.get("mamba_d_state", 256)), num_groups,
                        int(cfg.get("mamba_d_conv", 4)), bool(cfg.get("mamba_conv_bias", True)),
                        bool(cfg.get("mamba_proj_bias", False)), (json_number(low), json_number(high)))


def read_mamba2_lm(cfg: dict) -> Mamba2Layout:
    """Mamba-2's layers alone (Mamba2ForCausalLM: Mamba-Codestral; `cfg` as mamba1_config.mamba_keys gives it), its
    gated norm in `n_groups` groups.
    ValueError where its heads do not make its width."""
    intermediate = int(cfg.get("expand", 2)) * int(cfg["hidden_size"])
    num_heads, head_dim = int(cfg.get("num_heads", 128)), int(cfg["ssm_head_dim"])
    if num_heads * head_dim != intermediate:
        raise ValueError(f"num_heads {num_heads} x head_dim {head_dim} must be expand x hidden_size ({intermediate})")
    num_groups = int(cfg.get("n_groups", 8))
    if num_heads % num_groups:
        raise ValueError(f"n_groups {num_groups} must divide num_heads {num_heads}")
    low, high = cfg.get("time_step_limit") or (0.0, float("inf"))
    return Mamba2Layout((MAMBA,) * int(cfg["num_hidden_layers"]), num_heads, head_dim, int(cfg.get("state_size", 128)),
                        num_groups, int(cfg.get("conv_kernel", 4)), bool(cfg.get("use_conv_bias", True)),
                        bool(cfg.get("use_bias", False)), (json_number(low), json_number(high)))


def read_nemotron_h(cfg: dict) -> Mamba2Layout:
    """Nemotron-H's layers (`layers_block_type`, or as released `hybrid_override_pattern`: M, *, - and E) and their
    Mamba-2 settings. ValueError for other kinds."""
    given = cfg.get("layers_block_type") or cfg.get("layer_types") or list(cfg.get("hybrid_override_pattern") or "")
    unknown = sorted(set(given) - set(NEMOTRON_KINDS))
    if unknown:
        raise ValueError(f"Nemotron-H's {unknown} layers are not supported (its Mamba-2, attention, MLP and expert "
                         "layers are)")
    kinds = tuple(NEMOTRON_KINDS[kind] for kind in given)
    if MAMBA not in kinds or ATTENTION not in kinds:
        raise ValueError("a Nemotron-H model needs Mamba-2 and attention layers both")
    num_heads, head_dim = int(cfg.get("mamba_num_heads", 128)), int(cfg.get("mamba_head_dim", 64))
    num_groups = int(cfg.get("n_groups", cfg.get("mamba_n_groups", 8)))
    if num_heads % num_groups:
        raise ValueError(f"n_groups {num_groups} must divide mamba_num_heads {num_heads}")
    # transformers clamps a step's dt from below by time_step_min (it names no upper limit).
    return Mamba2Layout(kinds, num_heads, head_dim, int(cfg.get("ssm_state_size", 128)), num_groups,
                        int(cfg.get("conv_kernel", cfg.get("mamba_d_conv", 4))),
                        bool(cfg.get("use_conv_bias", cfg.get("mamba_conv_bias", True))),
                        bool(cfg.get("use_bias", False)),
                        (json_number(cfg.get("time_step_min", cfg.get("mamba_dt_min", 0.001))), float("inf")))


def json_number(value) -> float:
    """A float of config.json, where transformers writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def read_falcon_h1(cfg: dict) -> Mamba2Layout:
    """Falcon-H1's layers: attention and Mamba-2 side by side in each, the Mamba-2 layers `mamba_d_ssm` wide."""
    num_layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    num_heads = int(cfg.get("mamba_n_heads", 128))
    width = int(cfg.get("mamba_d_ssm") or int(cfg.get("mamba_expand", 2)) * hidden)
    head_dim = cfg.get("mamba_d_head", "auto")
    head_dim = width // num_heads if head_dim == "auto" else int(head_dim)
    if head_dim * num_heads != width:
        raise ValueError(f"mamba_n_heads {num_heads} x mamba_d_head {head_dim} must be the Mamba-2 width ({width})")
    num_groups = int(cfg.get("mamba_n_groups", 1))
    if num_heads % num_groups:
        raise ValueError(f"mamba_n_groups {num_groups} must divide mamba_n_heads {num_heads}")
    low, high = cfg.get("time_step_limit") or (0.0, float("inf"))
    norm = NO_NORM if not cfg.get("mamba_rms_norm", False) else \
        NORM_BEFORE_GATE if cfg.get("mamba_norm_before_gate", True) else NORM_AFTER_GATE
    return Mamba2Layout((PARALLEL,) * num_layers, num_heads, head_dim, int(cfg.get("mamba_d_state", 256)), num_groups,
                        int(cfg.get("mamba_d_conv", 4)), bool(cfg.get("mamba_conv_bias", True)),
                        bool(cfg.get("mamba_proj_bias", False)), (json_number(low), json_number(high)),
                        out_proj_bias=bool(cfg.get("projectors_bias", False)), gated_norm=norm)


def read_bamba(cfg: dict) -> Mamba2Layout:
    """Bamba's layers: attention at `attn_layer_indices`, Mamba-2 (Granite 4.0-H's settings) elsewhere."""
    attention = set(cfg.get("attn_layer_indices") or ())
    kinds = ["attention" if i in attention else "mamba" for i in range(int(cfg["num_hidden_layers"]))]
    return read_mamba2({**cfg, "layer_types": cfg.get("layer_types") or kinds})
