"""`block_hash`: a fixed encoding, the same value in every process."""
from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from engine.block_hash import BlockHashChain, block_hash, hash_block_chain, request_extra

REPO_ROOT = Path(__file__).resolve().parents[2]

# Pinned once. If this changes, every stored KV block and every router's view
# of the cache is invalidated: change it only on purpose.
PINNED_ROOT = 0x8542C625A2BBE747  # block_hash(None, [1, 2, 3, 4])
PINNED_CHILD = 0x5EE39F848F8E6E99  # block_hash(PINNED_ROOT, [5, 6, 7, 8], b"model")


def test_pinned_values():
    assert block_hash(None, [1, 2, 3, 4]) == PINNED_ROOT
    assert block_hash(PINNED_ROOT, [5, 6, 7, 8], b"model") == PINNED_CHILD


def test_encoding_is_the_documented_bytes():
    parent = 0x0102030405060708
    payload = (
        parent.to_bytes(8, "little")
        + (3).to_bytes(4, "little")
        + b"".join(t.to_bytes(4, "little") for t in (7, 70000, 2**32 - 1))
        + b"fp"
    )
    want = int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")
    assert block_hash(parent, [7, 70000, 2**32 - 1], b"fp") == want
    root = b"\x00" * 8 + (1).to_bytes(4, "little") + (9).to_bytes(4, "little")
    assert block_hash(None, [9]) == int.from_bytes(hashlib.blake2b(root, digest_size=8).digest(), "little")


def test_unsigned_64_bit():
    for i in range(200):
        h = block_hash(None, [i])
        assert 0 <= h < 2**64


def test_accepts_any_int_sequence():
    assert block_hash(None, (1, 2, 3, 4)) == block_hash(None, [1, 2, 3, 4]) == PINNED_ROOT


@pytest.mark.parametrize(
    "parent, tokens, extra",
    [
        (None, [1, 2, 3, 5], b""),  # a token differs
        (None, [4, 3, 2, 1], b""),  # order matters
        (None, [1, 2, 3], b""),  # length differs
        (None, [1, 2, 3, 4], b"x"),  # model fingerprint differs
        (1, [1, 2, 3, 4], b""),  # parent differs
    ],
)
def test_every_input_changes_the_hash(parent, tokens, extra):
    assert block_hash(parent, tokens, extra) != PINNED_ROOT


def test_no_parent_is_the_zero_sentinel():
    # Documented: None encodes as eight zero bytes, like a parent hash of 0
    # (probability 2**-64, and a hit also compares tokens).
    assert block_hash(0, [1, 2, 3, 4]) == PINNED_ROOT


def test_token_count_separates_tokens_from_extra():
    # Without the count, token 1 and an extra of its four bytes would collide.
    assert block_hash(None, [5, 1]) != block_hash(None, [5], (1).to_bytes(4, "little"))


def test_rejects_token_ids_outside_u32():
    with pytest.raises(Exception):
        block_hash(None, [-1])
    with pytest.raises(Exception):
        block_hash(None, [2**32])


def test_chain_hashes_full_blocks_only():
    tokens = list(range(10))
    h0 = block_hash(None, [0, 1, 2, 3])
    h1 = block_hash(h0, [4, 5, 6, 7])
    assert hash_block_chain(tokens, 4) == [h0, h1]
    assert hash_block_chain(tokens[:8], 4) == [h0, h1]
    assert hash_block_chain(tokens[:3], 4) == []
    assert hash_block_chain([], 4) == []
    assert hash_block_chain(tokens, 4, b"m") == [
        block_hash(None, [0, 1, 2, 3], b"m"),
        block_hash(block_hash(None, [0, 1, 2, 3], b"m"), [4, 5, 6, 7], b"m"),
    ]


def test_chain_of_a_long_prompt_is_block_hash_block_after_block():
    rng = random.Random(5)
    tokens = [rng.randrange(2**32) for _ in range(16 * 32 + 7)]
    expected, parent = [], None
    for start in range(0, 16 * 32, 16):
        parent = block_hash(parent, tokens[start:start + 16], b"fingerprint")
        expected.append(parent)
    assert hash_block_chain(tokens, 16, b"fingerprint") == expected
    assert hash_block_chain(tokens[16 * 5:], 16, b"fingerprint", parent_hash=expected[4]) == expected[5:]
    with pytest.raises(Exception):
        hash_block_chain([1, 2, -3, 4], 2)


def test_chain_names_the_whole_prefix():
    # The same block after different prefixes gets different hashes.
    a = hash_block_chain([1, 1, 9, 9], 2)
    b = hash_block_chain([2, 2, 9, 9], 2)
    assert a[1] != b[1]


def test_same_value_in_another_process_with_another_hash_seed():
    code = (
        "from engine.block_hash import block_hash, hash_block_chain;"
        "print(block_hash(None, [1, 2, 3, 4]));"
        "print(hash_block_chain(list(range(40)), 16, b'fp'))"
    )
    outputs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO_ROOT)}
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True, check=True
        )
        outputs.append(result.stdout.split("\n"))
    here = [str(PINNED_ROOT), str(hash_block_chain(list(range(40)), 16, b"fp")), ""]
    assert outputs[0] == outputs[1] == here


@pytest.mark.parametrize("num_tokens", [0, 15, 16, 17, 100, 512, 519])
def test_a_lazy_chain_reads_as_the_whole_chain_in_any_order(num_tokens):
    tokens = [random.Random(num_tokens).randrange(2**32) for _ in range(num_tokens)]
    whole = hash_block_chain(tokens, 16, b"fp")
    assert list(BlockHashChain(tokens, 16, b"fp")) == whole
    backwards = BlockHashChain(tokens, 16, b"fp")
    assert len(backwards) == len(whole)
    assert [backwards[i] for i in reversed(range(len(whole)))] == whole[::-1]
    assert BlockHashChain(tokens, 16, b"fp")[1:-1:2] == whole[1:-1:2]
    with pytest.raises(IndexError):
        BlockHashChain(tokens, 16, b"fp")[len(whole)]


def test_a_lazy_chain_hashes_only_what_is_read():
    chain = BlockHashChain(list(range(512)), 16)
    for block, _ in zip(range(3), chain):
        pass
    assert chain.num_computed <= 4  # read three: computed at most twice the two before the third
    first = BlockHashChain(list(range(512)), 16)
    assert first[0] == hash_block_chain(list(range(16)), 16)[0] and first.num_computed == 1


def test_a_token_id_no_u32_holds_is_a_value_error_naming_it():
    for bad in (-1, 2**32):
        with pytest.raises(ValueError, match=f"token id {bad} "):
            hash_block_chain([1, 2, bad, 4], 4)
        with pytest.raises(ValueError, match=f"token id {bad} "):
            block_hash(None, [1, bad])


def test_a_request_extra_names_its_adapter_and_its_salt_apart():
    extras = [request_extra(b"model", lora, salt) for lora in (None, "a", "b") for salt in (None, "a", "b")]
    assert len(set(extras)) == len(extras)  # no two of (adapter, salt) share blocks
    assert extras[0] == b"model" and request_extra(b"model", "a", "b") == request_extra(b"model", "a", "b")
    # The parts have fixed lengths: a salt cannot pass for an adapter, nor one salt for another's start.
    assert len({len(request_extra(b"m", None, salt)) for salt in ("x", "x" * 500)}) == 1
