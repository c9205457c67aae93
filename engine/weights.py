"""Reading safetensors checkpoints: single-file or sharded, memory-mapped, checked."""
from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


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
        return {name: single for name in _header(single)}
    raise WeightsError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def _header(path: Path) -> dict:
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


def iter_tensors(files: dict[str, Path], names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for `names`, one file open at a time (memory-mapped)."""
    missing = [n for n in names if n not in files]
    if missing:
        where = ", ".join(sorted({p.name for p in files.values()}))
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightsError(f"tensor {missing[0]!r} not found in {where}{more}")
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for path, file_names in by_file.items():
        header = _header(path)
        with safe_open(str(path), framework="pt") as f:
            for name in file_names:
                if name not in header:
                    raise WeightsError(f"{path}: tensor {name!r} listed in the index is not in the file")
                yield name, f.get_tensor(name)


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
