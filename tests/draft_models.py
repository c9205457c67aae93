"""Draft models for speculative decoding's tests and benchmark, cut from the model they draft for."""
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
