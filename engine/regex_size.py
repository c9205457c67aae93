"""How large a regex's automaton may grow: its positions with counted repetitions unrolled.

outlines-core builds a regex's whole index up front, a row of allowed tokens for each state of its
automaton, and a counted repetition makes a state per count (`x{1000}`: a thousand). Read with
Python's own regex parser, whose syntax outlines-core's (Rust's) shares for what is counted here; a
regex it cannot read (Rust's `\\p{L}`, counts past its limits) has no estimate."""
from __future__ import annotations

import functools
import re
from re import _constants as sre, _parser as sre_parse

_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT)
_ZERO_WIDTH = (sre.AT, sre.ASSERT, sre.ASSERT_NOT)


@functools.lru_cache(maxsize=256)
def unrolled_positions(regex: str) -> int | None:
    """The characters a match of `regex` steps through with each counted repetition written out (an unbounded
    one once past its minimum); None where Python's parser cannot read it."""
    try:
        return _positions(sre_parse.parse(regex))
    except (re.error, OverflowError, RecursionError, ValueError, TypeError):
        return None


def _positions(pattern) -> int:
    total = 0
    for op, av in pattern:
        if op in _REPEATS:
            low, high, sub = av
            total += (high if high != sre.MAXREPEAT else low + 1) * _positions(sub)
        elif op is sre.SUBPATTERN:
            total += _positions(av[-1])
        elif op is sre.ATOMIC_GROUP:
            total += _positions(av)
        elif op is sre.BRANCH:
            total += sum(_positions(branch) for branch in av[1])
        elif op not in _ZERO_WIDTH:
            total += 1
    return total
