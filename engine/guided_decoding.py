"""Guided decoding: output held to a regular expression by `outlines-core`, or to a
context-free grammar by `llguidance`, token by token.

A request's `guided_regex` (the gateway turns a JSON schema or a list of choices into one)
is compiled once per model into an index over the vocabulary: for each state of the
regex's automaton, the tokens that keep the text inside the language. Each guided
sequence walks it with a `Guide`: the sampler keeps only the tokens its state allows (EOS
among them once the text is complete), and every sampled token advances it. Compiling
takes from milliseconds to seconds with the vocabulary and the regex, so the services
compile off the engine's thread (`GuideFactory.compile`) before they add the request, and
the engine finds the index cached. A regex whose automaton would be too large to index ahead over
this vocabulary (a long counted repetition: engine/regex_size.py), or whose index is not built
within INDEX_DEADLINE_S (engine/index_builds.py), is guided as a grammar is, below.

A `guided_grammar` (Lark, as llguidance and vLLM's guidance backend read it; GBNF, llama.cpp's
EBNF that vLLM's xgrammar backend and SGLang's `ebnf` take; or llguidance's own JSON, what a
structural tag becomes) has no automaton to compile ahead: llguidance's Earley parser computes
each step's mask as the text goes. Its sequences walk a `GrammarGuide`, made the same way and
read by the sampler the same way.

The index is built from what each token is in bytes, which `tokenizer.json` does not say
directly: byte-level BPE vocabularies (GPT-2, Llama 3, Qwen) spell each byte as a printable
character, SentencePiece ones spell a space as "▁" and a byte they have no piece for as
"<0xNN>". Special tokens are left out: none may appear inside guided text.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer, grammar_from
from outlines_core import Guide, Index, Vocabulary
from tokenizers import Tokenizer

from engine.grammars import first_line, grammar_definition
from engine.index_builds import IndexBuilds
from engine.regex_size import unrolled_positions
from engine.sampling_params import SamplingParams

T = TypeVar("T")
# Compiled indexes (and grammars' matchers) kept per engine: a deployment's requests repeat a few.
INDEX_CACHE_SIZE = 32
# The most a regex's unrolled positions times the vocabulary's tokens may be for outlines-core to index it: its
# index holds a row of allowed tokens per automaton state, built before the first token (`.{0,1000}` over 8,192
# tokens took 1.3 s and 290 MB; `x{100000}`, minutes; over Qwen's 152k tokens, ~19x more). Larger, llguidance
# guides it, as it does grammars: a regex of any size at once, each step's mask computed as the text goes.
INDEXED_REGEX_BUDGET = 2**23
# How long a request waits for its regex's index before llguidance guides it (engine/index_builds.py): an
# automaton may blow up in states that its positions do not show (`(a|b)*a(a|b){n}` doubles with n).
INDEX_DEADLINE_S = 10.0


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable character for each byte, inverted: character → byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def token_bytes(tokenizer: Tokenizer) -> dict[int, bytes]:
    """Each ordinary token's bytes, by the id it has; special tokens are left out."""
    spec = json.loads(tokenizer.to_str())
    decoder = spec.get("decoder") or {}
    kinds = {decoder.get("type"), *(d.get("type") for d in decoder.get("decoders", []))}
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    byte_level = _byte_level_alphabet() if "ByteLevel" in kinds else None
    table: dict[int, bytes] = {}
    for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        if token_id in special:
            continue
        if byte_level is not None and all(c in byte_level for c in token):
            table[token_id] = bytes(byte_level[c] for c in token)
        elif "ByteFallback" in kinds and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            table[token_id] = bytes([int(token[3:5], 16)])
        else:
            table[token_id] = token.replace("▁", " ").encode()
    return table


class RegexGuide:
    """A sequence's place in its regex's index (outlines-core's `Guide`)."""

    def __init__(self, guide: Guide, num_words: int):
        self._guide = guide
        self.num_words = num_words  # of its masks: the vocabulary's, at 32 tokens a word

    def advance(self, token_id: int) -> None:
        self._guide.advance(token_id, return_tokens=False)

    def write_mask_into(self, words: np.ndarray) -> None:
        """The tokens its state allows, into `words`' first `num_words` (bit j of word i: token 32 i + j)."""
        self._guide.write_mask_into(words.ctypes.data, self.num_words, 4)


class GrammarGuide:
    """A sequence's place in its grammar (llguidance's matcher), read and moved as a RegexGuide is."""

    def __init__(self, matcher: LLMatcher, num_words: int):
        self._matcher = matcher
        self.num_words = num_words

    def advance(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise ValueError(f"token {token_id} does not follow guided_grammar")

    def write_mask_into(self, words: np.ndarray) -> None:
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, self.num_words * 4)


class GuideFactory:
    """Guides for one model's vocabulary. `eos_token_id`: the one a complete text may end with
    (a model's other EOS ids are never allowed under a guide); `vocab_size`: the width of the
    model's logits. Masks cover it and the tokenizer's vocabulary, whichever is larger (a model may
    have fewer rows than its tokenizer has tokens, or more). Thread-safe: services compile on
    worker threads while the engine's thread takes guides."""

    def __init__(self, tokenizer: Tokenizer, eos_token_id: int, vocab_size: int | None = None):
        by_bytes: dict[bytes, list[int]] = {}
        for token_id, raw in token_bytes(tokenizer).items():
            if token_id != eos_token_id and raw:
                by_bytes.setdefault(raw, []).append(token_id)
        self.vocabulary = Vocabulary(eos_token_id, by_bytes)
        self._indexes: OrderedDict[str, Index] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer, self._eos_token_id = tokenizer, eos_token_id
        self._mask_size = max(vocab_size or 0, tokenizer.get_vocab_size(with_added_tokens=True))
        self._num_words = -(-self._mask_size // 32)
        self._grammar_tokenizer: LLTokenizer | None = None  # made for the first grammar: a second or so
        self._grammars: OrderedDict[str, LLMatcher] = OrderedDict()  # each grammar's matcher at its start
        self._builds = IndexBuilds(self.index)

    def compile(self, params: SamplingParams) -> None:
        """Compile what `params` guide by, unless it is cached; ValueError when it cannot be. A regex's index
        not built within INDEX_DEADLINE_S is left building: llguidance guides it until it is."""
        regex = params.guided_regex
        if regex is not None and self.is_indexed(regex) and self._builds.wait(regex, INDEX_DEADLINE_S):
            return
        if regex is not None:
            self._regex_grammar_start(regex)
        elif params.guided_grammar is not None:
            self._grammar_start(params.guided_grammar)

    def guide(self, params: SamplingParams) -> RegexGuide | GrammarGuide:
        """A new guide at the start of what `params` guide by (a guided_regex or a guided_grammar)."""
        regex = params.guided_regex
        if regex is not None and self.is_indexed(regex) and not self._builds.is_overdue(regex):
            return RegexGuide(Guide(self.index(regex)), self._num_words)
        start = self._regex_grammar_start(regex) if regex is not None else self._grammar_start(params.guided_grammar)
        return GrammarGuide(start.deep_copy(), self._num_words)

    def is_indexed(self, regex: str) -> bool:
        """Whether `regex` is guided by outlines-core's index, built up front: one whose automaton, over this
        vocabulary, may fill more than INDEXED_REGEX_BUDGET (or that has no estimate) is guided by llguidance,
        which computes each step's mask as the text goes."""
        positions = unrolled_positions(regex)
        return positions is not None and positions * self._mask_size <= INDEXED_REGEX_BUDGET

    def index(self, regex: str) -> Index:
        """The compiled index of `regex`; ValueError when it cannot be compiled."""
        return self._cached(self._indexes, regex, self._compile_regex)

    def _compile_regex(self, regex: str) -> Index:
        try:
            return Index(regex, self.vocabulary)
        except ValueError as e:  # outlines-core's words, e.g. "Failed to build DFA error building NFA"
            raise ValueError(f"guided_regex cannot be compiled: {e}") from None

    def _grammar_start(self, grammar: str) -> LLMatcher:
        return self._cached(self._grammars, grammar, self._compile_grammar)

    def _regex_grammar_start(self, regex: str) -> LLMatcher:
        try:
            return self._grammar_start(grammar_from("regex", regex))
        except ValueError as e:
            raise ValueError(f"guided_regex cannot be compiled: {e}") from None

    def _compile_grammar(self, grammar: str) -> LLMatcher:
        if self._grammar_tokenizer is None:  # two threads may both make it: no harm, and no lock held so long
            self._grammar_tokenizer = LLTokenizer(self._tokenizer.to_str(), n_vocab=self._mask_size,
                                                  eos_token=self._eos_token_id)
        matcher = LLMatcher(self._grammar_tokenizer, grammar_definition(grammar), log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar cannot be compiled: {first_line(matcher.get_error())}")
        return matcher

    def _cached(self, cache: OrderedDict[str, T], key: str, compile_: Callable[[str], T]) -> T:
        """`cache`'s entry for `key`, compiled outside the lock when missing (others go on meanwhile)."""
        with self._lock:
            value = cache.get(key)
            if value is not None:
                cache.move_to_end(key)
                return value
        value = compile_(key)
        with self._lock:
            cache[key] = value
            while len(cache) > INDEX_CACHE_SIZE:
                cache.popitem(last=False)
        return value


def guide_bias(guides: list[RegexGuide | GrammarGuide], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(guides), vocab_size] float32: 0 for the tokens each guide's state allows, -inf for the others (of
    the logits' `vocab_size`: a token past them, the tokenizer's alone, is never sampled)."""
    num_words = max(-(-vocab_size // 32), *(guide.num_words for guide in guides))
    words = np.zeros((len(guides), num_words), dtype="<i4")
    for row, guide in enumerate(guides):
        guide.write_mask_into(words[row])
    # Little-endian words read byte by byte, each byte low bit first, are the tokens in order: each byte
    # looks up its 8 tokens' biases. 16 rows of Qwen2.5's 151,936 tokens took 0.9 ms so, where unpacking
    # the bits, then masking by them (a branch a token, on a scattered mask) took 13.
    biases = np.take(_BYTE_BIASES, words.view(np.uint8), axis=0).reshape(len(guides), -1)[:, :vocab_size]
    return torch.from_numpy(biases).to(device)


# Row b: the biases of the 8 tokens whose bits byte b holds, low bit first.
_BYTE_BIASES = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
                        np.float32(0.0), np.float32(-np.inf)).astype(np.float32)
