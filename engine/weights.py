"""Reading a safetensors checkpoint's tensors: single-file or sharded, memory-mapped, checked
(engine/checkpoint.py finds its files)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.checkpoint import WeightsError, read_header

# Tensors checkpoints carry that no forward reads: older exports saved the RoPE frequencies, and
# tied models sometimes store the LM head that is the embedding (transformers ties them too).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
TIED_HEAD = "lm_head.weight"


def check_every_tensor_is_read(files: dict[str, Path], names: list[str], architecture: str) -> None:
    """WeightsError when the checkpoint holds tensors `names` leaves out: a bias, a norm or a whole
    module the model's config.json turns on in a way Baton does not read, whose output would then be
    wrong without a word."""
    unread = sorted(n for n in set(files) - set(names) if not n.endswith(IGNORED_SUFFIXES) and n != TIED_HEAD)
    if unread:
        more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
        raise WeightsError(f"the checkpoint holds {unread[0]!r}{more}, which Baton's {architecture} does not "
                           f"read: it would compute without them (a config.json option it does not support?)")


def iter_tensors(files: dict[str, Path], names: list[str],
                 stored_names: dict[str, str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for `names`, one file open at a time (memory-mapped). `stored_names`: the
    name each is stored under where it is another (a multimodal checkpoint's text model)."""
    missing = [n for n in names if n not in files]
    if missing:
        where = ", ".join(sorted({p.name for p in files.values()}))
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightsError(f"tensor {missing[0]!r} not found in {where}{more}")
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for path, file_names in by_file.items():
        header = read_header(path)
        with safe_open(str(path), framework="pt") as f:
            for name in file_names:
                stored = stored_names.get(name, name) if stored_names else name
                if stored not in header:
                    raise WeightsError(f"{path}: tensor {stored!r} listed in the index is not in the file")
                yield name, f.get_tensor(stored)


def renamed(name: str, fragments: tuple[tuple[str, str], ...]) -> str:
    """A checkpoint's tensor name read as Baton's model names it: each (theirs, ours) of `fragments` replaced in turn
    (the more particular first)."""
    for theirs, ours in fragments:
        name = name.replace(theirs, ours)
    return name
