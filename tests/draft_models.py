"""Draft models and EAGLE heads for speculative decoding's tests and benchmark, made from the model they draft for."""
from __future__ import annotations

import json
import shutil

from safetensors.torch import load_file, save_file


def first_layers_copy(model_dir, target_dir, num_layers: int):
    """The model cut to its first `num_layers` layers (its embeddings, norm and head kept): a draft
    that agrees with it often, as a real family's small model agrees with its large one."""
    shutil.copytree(model_dir, target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (target_dir / "config.json").write_text(json.dumps(config))
    tensors = load_file(target_dir / "model.safetensors")
    kept = {name: t for name, t in tensors.items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers}
    save_file(kept, target_dir / "model.safetensors")
    return target_dir


def eagle_head(target_dir, head_dir, method: str, seed: int = 0, draft_vocab_size: int | None = None,
               target_layers: list[int] | None = None, reads_last_hidden_state: bool = False,
               num_kv_heads: int | None = None):
    """A random EAGLE head for the model in `target_dir`, as EAGLE's releases lay it out: EAGLE-1's (`"eagle"`) a
    Llama config of one layer and `fc` (with its bias), the first layer's unused input norm and a copy of the
    target's embeddings beside it; EAGLE-3's (`"eagle3"`) `midlayer` reading [embedding; feature] twice as wide,
    `fc` over three target layers' inputs, its final norm, and an LM head over `draft_vocab_size` tokens
    (`d2t`: each one's offset to its target id; `t2d` the mask the other way) where given, the target's
    vocabulary's else. `target_layers`: config.json's eagle_aux_hidden_state_layer_ids. `reads_last_hidden_state`:
    an EAGLE-3 head of eagle_config's use_aux_hidden_state false (the target's last hidden states, no fc).
    `num_kv_heads`: its own, where not the target's (its KV then shaped otherwise)."""
    import torch

    target_config = json.loads((target_dir / "config.json").read_text())
    hidden, heads = target_config["hidden_size"], target_config["num_attention_heads"]
    kv_heads, inter = num_kv_heads or target_config["num_key_value_heads"], target_config["intermediate_size"]
    head_dim, vocab = target_config.get("head_dim", hidden // heads), target_config["vocab_size"]
    generator = torch.Generator().manual_seed(seed)

    def random(*shape, fan_in=None):
        return torch.randn(*shape, generator=generator) / (fan_in or shape[-1]) ** 0.5

    def norm():
        return 1.0 + 0.1 * torch.randn(hidden, generator=generator)

    width = 2 * hidden if method == "eagle3" else hidden
    layer = {"self_attn.q_proj.weight": random(heads * head_dim, width),
             "self_attn.k_proj.weight": random(kv_heads * head_dim, width),
             "self_attn.v_proj.weight": random(kv_heads * head_dim, width),
             "self_attn.o_proj.weight": random(hidden, heads * head_dim),
             "mlp.gate_proj.weight": random(inter, hidden), "mlp.up_proj.weight": random(inter, hidden),
             "mlp.down_proj.weight": random(hidden, inter),
             "input_layernorm.weight": norm(), "post_attention_layernorm.weight": norm()}
    config = {**target_config, "num_hidden_layers": 1, "num_key_value_heads": kv_heads}
    if method == "eagle":
        tensors = {f"layers.0.{name}": t for name, t in layer.items()}
        tensors |= {"fc.weight": random(hidden, 2 * hidden), "fc.bias": 0.1 * torch.randn(hidden, generator=generator),
                    "embed_tokens.weight": load_file(target_dir / "model.safetensors")["model.embed_tokens.weight"]}
    else:
        tensors = {f"midlayer.{name}": t for name, t in layer.items()}
        tensors |= {"midlayer.hidden_norm.weight": norm(), "norm.weight": norm(),
                    "fc.weight": random(hidden, 3 * hidden)}
        config["architectures"] = ["LlamaForCausalLMEagle3"]
        if draft_vocab_size is not None:
            ids = torch.randperm(vocab, generator=generator)[:draft_vocab_size].sort().values
            tensors |= {"lm_head.weight": random(draft_vocab_size, hidden), "d2t": ids - torch.arange(draft_vocab_size),
                        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill(0, ids, True)}
            config["draft_vocab_size"] = draft_vocab_size
        if target_layers is not None:
            config["eagle_aux_hidden_state_layer_ids"] = target_layers
        if reads_last_hidden_state:
            config["eagle_config"] = {"use_aux_hidden_state": False}
            del tensors["fc.weight"]
    head_dir.mkdir(parents=True, exist_ok=True)
    (head_dir / "config.json").write_text(json.dumps(config))
    save_file({name: t.contiguous() for name, t in tensors.items()}, head_dir / "model.safetensors")
    return head_dir


def eagle_replica(model_dir, target_dir, head_dir):
    """A target and an EAGLE-1 head that computes it: the target's embedding rows scaled to an RMS of 1 and its
    first input norm and final norm made ones (so that its first layer's input norm changes nothing, and its final
    norm no token's rank); the head's fc passes the embedding alone into the target's own layers, and its output,
    unnormed, ranks the next token as the target's does. Its drafts differ from the target's only where the
    target attends to the prompt's first token, which the head never sees (its input at a position is the next
    token): what a trained head's agreement with its target can be held to, here where no trained head lies."""
    import torch

    shutil.copytree(model_dir, target_dir)
    tensors = load_file(target_dir / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = embed / embed.pow(2).mean(dim=-1, keepdim=True).sqrt()
    tensors["model.layers.0.input_layernorm.weight"] = torch.ones_like(tensors["model.norm.weight"])
    tensors["model.norm.weight"] = torch.ones_like(tensors["model.norm.weight"])
    save_file(tensors, target_dir / "model.safetensors")
    hidden = embed.shape[1]
    head = {name.removeprefix("model."): t for name, t in tensors.items() if name.startswith("model.layers.")}
    head["fc.weight"] = torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), dim=1)
    head_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(target_dir / "config.json", head_dir / "config.json")
    save_file(head, head_dir / "model.safetensors")
    return target_dir, head_dir


def with_mtp_layer(model_dir, target_dir, seed: int = 0):
    """A copy of a DeepSeek-V3 or GLM-4.5 checkpoint with the multi-token prediction layer their releases carry
    past the last (num_nextn_predict_layers 1): its decoder layer shaped as the last one, random, beside `enorm`,
    `hnorm`, `eh_proj`, `shared_head` and a copy of the embeddings, under the names DeepSeek-V3 gives them."""
    import torch

    shutil.copytree(model_dir, target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    last, mtp = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
    config["num_nextn_predict_layers"] = 1
    (target_dir / "config.json").write_text(json.dumps(config))
    tensors = load_file(target_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]

    like = random_like(generator)
    for name, t in list(tensors.items()):
        if name.startswith(f"model.layers.{last}."):
            tensors[name.replace(f"model.layers.{last}.", f"model.layers.{mtp}.", 1)] = like(t)
    # GLM-5's last layers share an earlier one's indexer; its MTP layer has one of its own, shaped as that one.
    indexed = sorted(int(name.split(".")[2]) for name in tensors if ".self_attn.indexer." in name)
    if indexed and indexed[-1] not in (last, mtp):
        p = f"model.layers.{indexed[-1]}.self_attn.indexer."
        for name, t in list(tensors.items()):
            if name.startswith(p):
                tensors[name.replace(f"model.layers.{indexed[-1]}.", f"model.layers.{mtp}.", 1)] = like(t)
    p = f"model.layers.{mtp}."
    norm = tensors["model.norm.weight"]
    tensors |= {p + "enorm.weight": like(norm), p + "hnorm.weight": like(norm),
                p + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=generator) / (2 * hidden) ** 0.5,
                p + "shared_head.norm.weight": like(norm),
                p + "shared_head.head.weight": tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"]),
                p + "embed_tokens.weight": tensors["model.embed_tokens.weight"]}
    save_file({name: t.contiguous().clone() for name, t in tensors.items()}, target_dir / "model.safetensors")
    return target_dir


def with_qwen3_next_mtp_layer(model_dir, target_dir, seed: int = 0):
    """A copy of a Qwen3-Next or Qwen3.5 checkpoint with the multi-token prediction layer their releases carry
    under `mtp.` (mtp_num_hidden_layers 1): a full-attention decoder layer shaped as the model's last, random,
    beside `fc` and the norms `pre_fc_norm_embedding`, `pre_fc_norm_hidden` and `norm` (offsets from 1, as the
    model's); no embeddings or LM head of its own."""
    import torch

    shutil.copytree(model_dir, target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    text = config.get("text_config", config)
    text["mtp_num_hidden_layers"] = 1
    (target_dir / "config.json").write_text(json.dumps(config))
    tensors = load_file(target_dir / "model.safetensors")
    layers = "model.language_model.layers." if "text_config" in config else "model.layers."
    kinds = text.get("layer_types") or ["linear_attention" if (i + 1) % text["full_attention_interval"] else
                                        "full_attention" for i in range(text["num_hidden_layers"])]
    last_full = max(i for i, kind in enumerate(kinds) if kind == "full_attention")
    generator = torch.Generator().manual_seed(seed)
    hidden = text["hidden_size"]

    like = random_like(generator)
    for name, t in list(tensors.items()):
        if name.startswith(f"{layers}{last_full}."):
            tensors[name.replace(f"{layers}{last_full}.", "mtp.layers.0.", 1)] = like(t)
    norm = tensors[layers.removesuffix("layers.") + "norm.weight"]
    tensors |= {"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=generator) / (2 * hidden) ** 0.5,
                "mtp.pre_fc_norm_embedding.weight": like(norm), "mtp.pre_fc_norm_hidden.weight": like(norm),
                "mtp.norm.weight": like(norm)}
    save_file({name: t.contiguous().clone() for name, t in tensors.items()}, target_dir / "model.safetensors")
    return target_dir


def qwen3_next_mtp_replica(model_dir, target_dir, layer_scale: float):
    """A Qwen3-Next or Qwen3.5 checkpoint whose MTP layer agrees with it often: each of the model's layers adds
    `layer_scale` of what it added (its output projections scaled), so that its next token is mostly its LM head's
    pick for the token it reads; the MTP layer passes that token's normed embedding alone through (fc, its layer
    adding nothing) into the model's final norm and LM head, and so drafts that pick. Where the scaled layers
    change it, the draft is rejected: what a trained layer's agreement can be held to, here where none lies."""
    import torch

    with_qwen3_next_mtp_layer(model_dir, target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    text = config.get("text_config", config)
    tensors = load_file(target_dir / "model.safetensors")
    outputs = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
    for name, t in tensors.items():
        if name.endswith(outputs):
            tensors[name] = t * (0.0 if name.startswith("mtp.") else layer_scale)
    hidden = text["hidden_size"]
    final_norm = "model.language_model.norm.weight" if "text_config" in config else "model.norm.weight"
    tensors |= {"mtp.fc.weight": torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), dim=1),
                "mtp.pre_fc_norm_embedding.weight": torch.zeros(hidden), "mtp.norm.weight": tensors[final_norm]}
    save_file({name: t.contiguous().clone() for name, t in tensors.items()}, target_dir / "model.safetensors")
    return target_dir


def with_nemotron_h_mtp_layer(model_dir, target_dir, seed: int = 0):
    """A copy of a Nemotron 3 checkpoint (experts in its blocks) with the multi-token prediction layer its releases
    carry under `mtp.layers.` (num_nextn_predict_layers 1, mtp_hybrid_override_pattern "*E"): an attention block
    and an expert block shaped as the model's, random, the first with `enorm`, `hnorm` and `eh_proj`, the last with
    `final_layernorm`."""
    import torch

    shutil.copytree(model_dir, target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    config |= {"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E"}
    config.pop("mtp_layers_block_type", None)
    (target_dir / "config.json").write_text(json.dumps(config))
    tensors = load_file(target_dir / "model.safetensors")
    kinds = config["layers_block_type"]
    blocks = {"mtp.layers.0.": kinds.index("full_attention"), "mtp.layers.1.": kinds.index("moe")}
    generator = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]

    like = random_like(generator)
    for prefix, layer in blocks.items():
        for name, t in list(tensors.items()):
            if name.startswith(f"backbone.layers.{layer}."):
                tensors[name.replace(f"backbone.layers.{layer}.", prefix, 1)] = like(t)
    norm = tensors["backbone.norm_f.weight"]
    tensors |= {"mtp.layers.0.enorm.weight": like(norm), "mtp.layers.0.hnorm.weight": like(norm),
                "mtp.layers.0.eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=generator) / hidden,
                "mtp.layers.1.final_layernorm.weight": like(norm)}
    save_file({name: t.contiguous().clone() for name, t in tensors.items()}, target_dir / "model.safetensors")
    return target_dir


def with_mimo_v2_flash_mtp_layers(model_dir, target_dir, seed: int = 0):
    """A copy of a MiMo-V2-Flash checkpoint with the multi-token prediction layers its releases carry under
    `model.mtp.layers.` (two here, num_nextn_predict_layers 2), by the release's names: each a sliding-window
    attention shaped as the model's sliding layers' (`attention_sink_bias` its sinks) and a dense MLP shaped as its
    first layer's (`pre_mlp_layernorm` before it), random, with `enorm`, `hnorm`, `eh_proj` and `final_layernorm`."""
    import torch

    shutil.copytree(model_dir, target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    (target_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 2}))
    tensors = load_file(target_dir / "model.safetensors")
    sliding = config["layer_types"].index("sliding_attention")
    dense = config["mlp_layer_types"].index("dense")
    generator = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    like = random_like(generator)
    norm = tensors["model.norm.weight"]
    for mtp in ("model.mtp.layers.0.", "model.mtp.layers.1."):
        for name, t in list(tensors.items()):
            if name.startswith((f"model.layers.{sliding}.self_attn.", f"model.layers.{sliding}.input_layernorm.")):
                stored = name.replace(".self_attn.sinks", ".self_attn.attention_sink_bias")
                tensors[stored.replace(f"model.layers.{sliding}.", mtp, 1)] = like(t)
            elif name.startswith((f"model.layers.{dense}.mlp.", f"model.layers.{dense}.post_attention_layernorm.")):
                stored = name.replace(".post_attention_layernorm.", ".pre_mlp_layernorm.")
                tensors[stored.replace(f"model.layers.{dense}.", mtp, 1)] = like(t)
        tensors |= {mtp + "enorm.weight": like(norm), mtp + "hnorm.weight": like(norm),
                    mtp + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=generator) / hidden,
                    mtp + "final_layernorm.weight": like(norm)}
    save_file({name: t.contiguous().clone() for name, t in tensors.items()}, target_dir / "model.safetensors")
    return target_dir


def with_mimo_mtp_layers(model_dir, target_dir, seed: int = 0):
    """A copy of a Qwen2 checkpoint as Xiaomi MiMo's releases lay theirs out (MiMoForCausalLM), with the multi-token
    prediction layers they carry under `model.mtp_layers.` (two here, num_nextn_predict_layers 2): each a Qwen2
    decoder layer shaped as the model's last, random, with `token_layernorm`, `hidden_layernorm`, `input_proj` and
    `final_layernorm`."""
    import torch

    shutil.copytree(model_dir, target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    (target_dir / "config.json").write_text(json.dumps({**config, "architectures": ["MiMoForCausalLM"],
                                                       "model_type": "mimo", "num_nextn_predict_layers": 2}))
    tensors = load_file(target_dir / "model.safetensors")
    last = f"model.layers.{config['num_hidden_layers'] - 1}."
    generator = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    like = random_like(generator)
    norm = tensors["model.norm.weight"]
    for mtp in ("model.mtp_layers.0.", "model.mtp_layers.1."):
        tensors |= {name.replace(last, mtp, 1): like(t) for name, t in list(tensors.items()) if name.startswith(last)}
        tensors |= {mtp + "token_layernorm.weight": like(norm), mtp + "hidden_layernorm.weight": like(norm),
                    mtp + "input_proj.weight": torch.randn(hidden, 2 * hidden, generator=generator) / hidden,
                    mtp + "final_layernorm.weight": like(norm)}
    save_file({name: t.contiguous().clone() for name, t in tensors.items()}, target_dir / "model.safetensors")
    return target_dir


def with_mellum_mtp_layer(model_dir, target_dir, attention: str = "sliding_attention", mlp: str = "sparse",
                           seed: int = 0):
    """A copy of a Mellum 2 checkpoint with the multi-token prediction layer its releases carry under `mtp.` (one,
    of the kinds `mtp_layer_types` and `mtp_mlp_layer_types` name): its attention shaped as the model's first layer
    of kind `attention`, its MLP as its first of kind `mlp`, random, beside `fc`, `pre_fc_norm_embedding`,
    `pre_fc_norm_hidden` and `norm`."""
    import torch

    shutil.copytree(model_dir, target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    mtp = {"num_nextn_predict_layers": 1, "mtp_layer_types": [attention], "mtp_mlp_layer_types": [mlp]}
    (target_dir / "config.json").write_text(json.dumps({**config, **mtp}))
    tensors = load_file(target_dir / "model.safetensors")
    attention_layer = f"model.layers.{config['layer_types'].index(attention)}."
    mlp_layer = f"model.layers.{config['mlp_layer_types'].index(mlp)}."
    generator = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    like = random_like(generator)
    for name, t in list(tensors.items()):
        if name.startswith((attention_layer + "self_attn.", attention_layer + "input_layernorm.")):
            tensors[name.replace(attention_layer, "mtp.layers.0.", 1)] = like(t)
        elif name.startswith((mlp_layer + "mlp.", mlp_layer + "post_attention_layernorm.")):
            tensors[name.replace(mlp_layer, "mtp.layers.0.", 1)] = like(t)
    norm = tensors["model.norm.weight"]
    tensors |= {"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=generator) / hidden,
                "mtp.pre_fc_norm_embedding.weight": like(norm), "mtp.pre_fc_norm_hidden.weight": like(norm),
                "mtp.norm.weight": like(norm)}
    save_file({name: t.contiguous().clone() for name, t in tensors.items()}, target_dir / "model.safetensors")
    return target_dir


def with_step3p7_mtp_layer(model_dir, target_dir, attention: str = "full_attention", mlp: str = "dense",
                            seed: int = 0):
    """A copy of a Step-3.7 checkpoint with an MTP layer past its own (`model.layers.{N}.`, of the kinds its config's
    `mtp_layer_types` and `mtp_mlp_layer_types` name, as transformers saves them): its attention shaped as the
    model's first layer of kind `attention`, its MLP as its first of kind `mlp`, random, beside `enorm`, `hnorm`,
    `eh_proj`, `shared_head.norm` and a random `shared_head.output` (which transformers leaves unread)."""
    import torch

    shutil.copytree(model_dir, target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    text = config["text_config"]
    text |= {"num_nextn_predict_layers": 1, "mtp_layer_types": [attention], "mtp_mlp_layer_types": [mlp]}
    (target_dir / "config.json").write_text(json.dumps(config))
    tensors = load_file(target_dir / "model.safetensors")
    mtp = f"model.layers.{text['num_hidden_layers']}."
    attention_layer = f"model.layers.{text['layer_types'].index(attention)}."
    mlp_layer = f"model.layers.{text['mlp_layer_types'].index(mlp)}."
    generator = torch.Generator().manual_seed(seed)
    like = random_like(generator)
    for name, t in list(tensors.items()):
        if name.startswith((attention_layer + "self_attn.", attention_layer + "input_layernorm.")):
            tensors[name.replace(attention_layer, mtp, 1)] = like(t)
        elif name.startswith(tuple(mlp_layer + part for part in
                                   ("mlp.", "moe.", "share_expert.", "post_attention_layernorm."))):
            tensors[name.replace(mlp_layer, mtp, 1)] = like(t)
    norm, hidden = tensors["model.norm.weight"], text["hidden_size"]
    tensors |= {mtp + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=generator) / hidden,
                mtp + "enorm.weight": like(norm), mtp + "hnorm.weight": like(norm),
                mtp + "shared_head.norm.weight": like(norm),
                mtp + "shared_head.output.weight": like(tensors["lm_head.weight"])}
    save_file({name: t.contiguous().clone() for name, t in tensors.items()}, target_dir / "model.safetensors",
              metadata={"format": "pt"})
    return target_dir


def random_like(generator):
    """A random tensor shaped as the one it is given: a vector (a norm, a bias) about its mean, a matrix scaled by
    its inputs' count."""
    import torch

    def like(t):
        if t.dim() == 1:
            return (t.mean() + 0.1 * torch.randn(t.shape, generator=generator)).to(t.dtype)
        return (torch.randn(t.shape, generator=generator) / t.shape[-1] ** 0.5).to(t.dtype)
    return like
