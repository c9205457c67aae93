"""Guided decoding: output held to a regular expression, token by token, by `outlines-core`.

A request's `guided_regex` (the gateway turns a JSON schema or a list of choices into one)
is compiled once per model into an index over the vocabulary: for each state of the
regex's automaton, the tokens that keep the text inside the language. Each guided
sequence walks it with a `Guide`: the sampler keeps only the tokens its state allows (EOS
among them once the text is complete), and every sampled token advances it. Compiling
takes from milliseconds to seconds with the vocabulary and the regex, so the services
compile off the engine's thread (`GuideFactory.index`) before they add the request, and
the engine finds the index cached.

The index is built from what each token is in bytes, which `tokenizer.json` does not say
directly: byte-level BPE vocabularies (GPT-2, Llama 3, Qwen) spell each byte as a printable
character, SentencePiece ones spell a space as "▁" and a byte they have no piece for as
"<0xNN>". Special tokens are left out: none may appear inside guided text.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np
import torch
from outlines_core import Guide, Index, Vocabulary
from tokenizers import Tokenizer

# Compiled indexes kept per engine: a deployment's requests repeat a few schemas.
INDEX_CACHE_SIZE = 32


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


class GuideFactory:
    """Guides for one model's vocabulary. `eos_token_id`: the one a complete text may end with
    (a model's other EOS ids are never allowed under a guide). Thread-safe: services compile
    on worker threads while the engine's thread takes guides."""

    def __init__(self, tokenizer: Tokenizer, eos_token_id: int):
        by_bytes: dict[bytes, list[int]] = {}
        for token_id, raw in token_bytes(tokenizer).items():
            if token_id != eos_token_id and raw:
                by_bytes.setdefault(raw, []).append(token_id)
        self.vocabulary = Vocabulary(eos_token_id, by_bytes)
        self._indexes: OrderedDict[str, Index] = OrderedDict()
        self._lock = threading.Lock()

    def index(self, regex: str) -> Index:
        """The compiled index of `regex`; ValueError when it cannot be compiled."""
        with self._lock:
            index = self._indexes.get(regex)
            if index is not None:
                self._indexes.move_to_end(regex)
                return index
        try:
            index = Index(regex, self.vocabulary)
        except ValueError as e:  # outlines-core's words, e.g. "Failed to build DFA error building NFA"
            raise ValueError(f"guided_regex cannot be compiled: {e}") from None
        with self._lock:
            self._indexes[regex] = index
            while len(self._indexes) > INDEX_CACHE_SIZE:
                self._indexes.popitem(last=False)
        return index

    def guide(self, regex: str) -> Guide:
        return Guide(self.index(regex))


def allowed_mask(guides: list[Guide], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(guides), vocab_size] bool: the tokens each guide's state allows."""
    num_words = -(-vocab_size // 32)
    words = np.zeros((len(guides), num_words), dtype=np.int32)
    for row, guide in enumerate(guides):
        guide.write_mask_into(words[row].ctypes.data, num_words, 4)  # bit j of word i: token 32 i + j
    bits = (torch.from_numpy(words).unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(len(guides), -1)[:, :vocab_size].bool().to(device)
