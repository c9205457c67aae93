"""Token-length distributions named on the command line: `fixed:128`, `uniform:64:256`,
`normal:128:32`, `lognormal:128:0.5`. Every sample is an integer of at least 1."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

Kind = Literal["fixed", "uniform", "normal", "lognormal"]
_NUM_PARAMS = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2}
SYNTAX = "fixed:N, uniform:LO:HI, normal:MEAN:STD or lognormal:MEDIAN:SIGMA"


@dataclass(frozen=True)
class LengthDistribution:
    """`uniform` is inclusive of both ends; `normal` and `lognormal` are rounded and clipped
    to at least 1 (so their sample mean sits a little above MEAN when STD is large)."""

    kind: Kind
    params: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.kind not in _NUM_PARAMS:
            raise ValueError(f"unknown length distribution {self.kind!r}: expected {SYNTAX}")
        if len(self.params) != _NUM_PARAMS[self.kind]:
            raise ValueError(f"{self.kind} takes {_NUM_PARAMS[self.kind]} parameter(s), got {len(self.params)}")
        if not all(math.isfinite(p) for p in self.params):
            raise ValueError(f"{self}: parameters must be finite")
        first = self.params[0]
        if self.kind in ("fixed", "uniform") and any(p != int(p) for p in self.params):
            raise ValueError(f"{self}: lengths must be integers")
        if first < 1:
            raise ValueError(f"{self}: the length must be at least 1")
        if self.kind == "uniform" and self.params[1] < first:
            raise ValueError(f"{self}: HI must be at least LO")
        if self.kind in ("normal", "lognormal") and self.params[1] < 0:
            raise ValueError(f"{self}: the spread must not be negative")

    @classmethod
    def parse(cls, text: str) -> "LengthDistribution":
        """`128` alone means `fixed:128`."""
        kind, *rest = text.strip().split(":")
        if not rest and kind.isdigit():
            kind, rest = "fixed", [kind]
        try:
            params = tuple(float(p) for p in rest)
        except ValueError:
            raise ValueError(f"bad length distribution {text!r}: expected {SYNTAX}") from None
        return cls(kind, params)  # type: ignore[arg-type]

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` lengths, an int64 array."""
        if self.kind == "fixed":
            return np.full(n, int(self.params[0]), dtype=np.int64)
        if self.kind == "uniform":
            lo, hi = (int(p) for p in self.params)
            return rng.integers(lo, hi + 1, size=n, dtype=np.int64)
        if self.kind == "normal":
            values = rng.normal(self.params[0], self.params[1], size=n)
        else:
            values = self.params[0] * np.exp(rng.normal(0.0, self.params[1], size=n))
        return np.maximum(np.rint(values), 1).astype(np.int64)

    def __str__(self) -> str:
        return ":".join([self.kind, *(f"{p:g}" for p in self.params)])
