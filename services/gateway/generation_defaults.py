"""Sampling defaults from the model's `generation_config.json`, as vLLM takes them (`--generation-config`).

Model makers ship the sampling they recommend there (Qwen3: temperature 0.6, top_p 0.95, top_k 20;
Llama 3: temperature 0.6, top_p 0.9). vLLM serves with them by default, so a request that leaves
a field out is sampled as the model's authors meant, not at temperature 1; a field the request
gives always wins. `--generation-config vllm` turns them off; `--override-generation-config`
sets some over what the file says.

The keys read are vLLM's: temperature, top_p, top_k, min_p, repetition_penalty and
max_new_tokens (the most tokens a request that gives no max_tokens may have).
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from protos import common_pb2

# A key's check: its type and range, as the OpenAI API's fields are checked.
_CHECKS = {
    "temperature": (float, lambda v: v >= 0, ">= 0"),
    "top_p": (float, lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (int, lambda v: v >= -1, ">= -1"),
    "min_p": (float, lambda v: 0 <= v <= 1, "in [0, 1]"),
    "repetition_penalty": (float, lambda v: v > 0, "> 0"),
    "max_new_tokens": (int, lambda v: v >= 1, ">= 1"),
}
SOURCES_HELP = "auto (the model's generation_config.json), vllm (none: vLLM's own defaults), or a directory holding one"


@dataclass(frozen=True)
class GenerationDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None
    # The names set, found once: `fill` runs on every request's path.
    _set: tuple[str, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        names = tuple(f.name for f in fields(self) if f.init and getattr(self, f.name) is not None)
        object.__setattr__(self, "_set", names)

    @classmethod
    def load(cls, source: str, model_dir: Path, overrides: Mapping[str, Any] | None = None) -> GenerationDefaults:
        """The defaults `source` names (see SOURCES_HELP), with `overrides` over them. ValueError
        for a source that is none of those, an unreadable file, or a value out of range."""
        if source == "vllm":
            found: dict[str, Any] = {}
        else:
            directory = model_dir if source == "auto" else Path(source).expanduser()
            if source != "auto" and not directory.is_dir():
                raise ValueError(f"{source!r} is not a directory (nor auto or vllm)")
            found = _read(directory / "generation_config.json")
        unknown = sorted(set(overrides or {}) - set(_CHECKS))
        if unknown:
            raise ValueError(f"cannot override {', '.join(unknown)}: only {', '.join(_CHECKS)}")
        merged = {**{k: v for k, v in found.items() if k in _CHECKS and v is not None}, **(overrides or {})}
        return cls(**{key: _checked(key, value) for key, value in merged.items() if value is not None})

    def __bool__(self) -> bool:
        return bool(self._set)

    def describe(self) -> str:
        return ", ".join(f"{name}={getattr(self, name)}" for name in self._set)

    def fill(self, params: common_pb2.SamplingParams, *, top_k_given: bool, min_p_given: bool) -> None:
        """Set each default `params` has no value for (max_new_tokens is the prompt encoder's). top_k
        and min_p have no presence in the proto: the caller says whether the request gave them."""
        for name in self._set:
            if name == "top_k":
                if not top_k_given:
                    params.top_k = self.top_k
            elif name == "min_p":
                if not min_p_given:
                    params.min_p = self.min_p
            elif name != "max_new_tokens" and not params.HasField(name):
                setattr(params, name, getattr(self, name))


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: {e}") from None
    if not isinstance(found, dict):
        raise ValueError(f"{path}: not a JSON object")
    return found


def _checked(key: str, value: Any) -> int | float:
    kind, is_valid, allowed = _CHECKS[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and value != int(value)):
        raise ValueError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if not math.isfinite(value) or not is_valid(value):
        raise ValueError(f"{key} must be {allowed}, got {value!r}")
    return kind(value)
