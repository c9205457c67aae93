"""A safetensors checkpoint's files and the fingerprint that names it, read without torch: the
gateway reads them too (its block hashes carry the fingerprint), and imports nothing of torch."""
from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.rope_config import context_dependent_rope


class WeightsError(ValueError):
    pass


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name → the file holding it."""
    model_dir = Path(model_dir)
    index_path = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightsError(f"{index_path}: not a safetensors index ({e})") from e
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        for path in set(files.values()):
            if not path.is_file():
                raise WeightsError(f"{index_path}: shard {path.name} is missing")
        return files
    if single.is_file():
        return {name: single for name in read_header(single)}
    raise WeightsError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def read_header(path: Path) -> dict:
    """The safetensors header, after checking the file holds every byte it promises."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise WeightsError(f"{path}: truncated (no safetensors header)")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > size - 8:
            raise WeightsError(f"{path}: truncated (header of {header_len} bytes, file of {size})")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WeightsError(f"{path}: corrupt safetensors header ({e})") from e
    data_size = size - 8 - header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        end = info["data_offsets"][1]
        if end > data_size:
            raise WeightsError(
                f"{path}: truncated: tensor {name!r} needs {end} data bytes, the file has {data_size}"
            )
    header.pop("__metadata__", None)
    return header


def checkpoint_fingerprint(config_bytes: bytes, files: dict[str, Path]) -> bytes:
    """16 bytes naming this checkpoint: config plus every file's header and size.

    Cheap (no tensor data is read) and the same on every host holding the same files.
    """
    digest = hashlib.blake2b(config_bytes, digest_size=16)
    for path in sorted(set(files.values())):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            digest.update(f.read(header_len))
        digest.update(os.path.getsize(path).to_bytes(8, "little"))
    return digest.digest()


def read_model_config(model_dir: str | Path, hf_overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """config.json's settings, with vLLM's `--hf-overrides` in place of its own keys (each key's value
    replaced whole, as vLLM updates a config: e.g. a `rope_scaling` to run Qwen3 past 32k tokens)."""
    return {**json.loads((Path(model_dir) / "config.json").read_bytes()), **(hf_overrides or {})}


def model_fingerprint(model_dir: str | Path, hf_overrides: Mapping[str, Any] | None = None) -> bytes:
    """`checkpoint_fingerprint` of the model directory `model_dir`, as `hf_overrides` changes it."""
    model_dir = Path(model_dir)
    config = (model_dir / "config.json").read_bytes()
    if hf_overrides:
        config += b"\0" + json.dumps(hf_overrides, sort_keys=True).encode()
    return checkpoint_fingerprint(config, checkpoint_files(model_dir))


def kv_fingerprint(model_dir: str | Path, max_model_len: int | None,
                   hf_overrides: Mapping[str, Any] | None = None) -> bytes:
    """What names the KV that workers serving `model_dir` with a context of `max_model_len` (None:
    the model's) and `hf_overrides` compute: the checkpoint's fingerprint (the overrides in it), mixed
    with the RoPE variant the context selects where it selects one (LongRoPE), so that workers
    turning keys differently refuse each other's pages and are not taken for one model."""
    model_dir = Path(model_dir)
    fingerprint = model_fingerprint(model_dir, hf_overrides)
    cfg = read_model_config(model_dir, hf_overrides)
    arch = next(iter(cfg.get("architectures") or ()), "")
    variant = context_dependent_rope(cfg, arch, max_model_len)
    if variant is None:
        return fingerprint
    return hashlib.blake2b(fingerprint + variant.encode(), digest_size=16).digest()
