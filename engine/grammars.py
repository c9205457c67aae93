"""Context-free grammars as llguidance reads them: Lark as it is, GBNF (llama.cpp's EBNF, what
vLLM's xgrammar backend and SGLang's `ebnf` take) turned into Lark, llguidance's JSON (what a
structural tag becomes) as it is. Checked here without a vocabulary, so the gateway refuses a
grammar that cannot be used before any worker sees it; engine/guided_decoding.py compiles them."""
from __future__ import annotations

import functools

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark


def grammar_definition(grammar: str) -> str:
    """What llguidance's matcher reads for `grammar`; ValueError when it is no grammar."""
    if grammar.lstrip().startswith("{"):
        return grammar
    try:
        return any_to_lark(grammar)
    except Exception as e:  # the converter's bare Exceptions, e.g. "Rule 'value' not found"
        raise ValueError(f"the grammar cannot be read: {e}") from None


@functools.lru_cache(maxsize=64)
def check_grammar(grammar: str) -> None:
    """ValueError, in llguidance's words (their first line), for a grammar that does not compile.
    Remembered for the last grammars that do: a check takes the gateway's event loop most of a
    millisecond, and a deployment's requests repeat a few grammars and schemas."""
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar_definition(grammar))
    if is_error:
        raise ValueError(f"the grammar cannot be compiled: {first_line(messages[0])}")


def first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else message
