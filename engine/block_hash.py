"""Block identity: the one chained hash that prefill, decode, kvstore and the router share.

A full block of KV is named by h_i = H(h_{i-1}, tokens of block i, extra), so a
hash names the whole prefix up to and including its block, not just the block.
The encoding is fixed byte for byte (blake2b, little-endian integers, no Python
`hash()`), so every process on every host computes the same value.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# The parent of a prompt's first block. Any fixed 8 bytes would do; a real
# parent equals it with probability 2**-64, the same as any hash collision,
# and a hit also compares tokens.
NO_PARENT = b"\x00" * 8


def block_hash(parent_hash: int | None, token_ids: Sequence[int], extra: bytes = b"") -> int:
    """The unsigned 64-bit hash of one block given the hash of the block before it.

    Bytes hashed: parent (u64 LE, or `NO_PARENT`), token count (u32 LE),
    tokens (u32 LE each), then `extra` (the model fingerprint). The count
    keeps the token/extra boundary unambiguous. Token ids must fit in u32.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(NO_PARENT if parent_hash is None else parent_hash.to_bytes(8, "little"))
    # struct with an explicit '<' is little-endian on every host and rejects
    # out-of-range ids instead of wrapping them.
    h.update(_packed(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    h.update(extra)
    return int.from_bytes(h.digest(), "little")


def request_extra(extra: bytes, lora_name: str | None = None, cache_salt: str | None = None) -> bytes:
    """A request's block-hash `extra`: the model's `extra`; then the LoRA adapter it is computed with,
    if any (its KV is not the base model's, nor another adapter's); then its cache salt, if any
    (vLLM's `cache_salt`: only requests giving the same salt share its blocks, so one tenant cannot
    tell from a fast first token that another sent the same prompt). Both are hashed to a fixed
    length: every block's hash reads the extra, and the lengths keep the parts apart."""
    if lora_name is not None:
        extra += b"lora:" + hashlib.blake2b(lora_name.encode(), digest_size=8).digest()
    if cache_salt is not None:
        extra += b"salt:" + hashlib.blake2b(cache_salt.encode(), digest_size=16).digest()
    return extra


def embeddings_digest(dtype: str, shape: Sequence[int], data: bytes) -> str:
    """What names a prompt given as embeddings: their dtype ("bfloat16"), shape and bytes, hashed."""
    h = hashlib.blake2b(f"{dtype}{list(shape)}".encode(), digest_size=16)
    h.update(data)
    return h.hexdigest()


def image_digest(rgb: bytes | memoryview, shape: tuple[int, ...], rescale_factor: float, mean: Sequence[float],
                 std: Sequence[float], fps: float = 0.0) -> str:
    """What names one image (or video): its resized RGB bytes and shape, the rescale factor, mean and std its pixels
    are normalized by, and a video's frames a second (which place its tokens), hashed (the gateway's and the
    engine's the same)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{list(shape)} {rescale_factor!r} {[float(m) for m in mean]} {[float(s) for s in std]}".encode())
    if fps:
        h.update(f" fps {fps!r}".encode())
    h.update(rgb)
    return h.hexdigest()


def images_digest(digests: Sequence[str]) -> str:
    """What names a prompt's images, of their `image_digest`s in order: an image's own digest may be kept
    (the gateway's cache of processed images) and its bytes not hashed again."""
    return hashlib.blake2b(" ".join(digests).encode(), digest_size=16).hexdigest()


def salted_with_embeddings(cache_salt: str | None, digest: str) -> str:
    """The cache salt of a prompt given as the embeddings `digest` names: its placeholder tokens name
    no content, so its blocks are shared only with prompts given the same embeddings (and the same
    salt). A salt already so salted is returned as it is."""
    marker = f"\x00prompt_embeds:{digest}"
    if cache_salt is not None and cache_salt.endswith(marker):
        return cache_salt
    return f"{cache_salt or ''}{marker}"


def hash_block_chain(token_ids: Sequence[int], block_size: int, extra: bytes = b"",
                     parent_hash: int | None = None) -> list[int]:
    """Chained hashes of every full block of `token_ids`; a partial tail block has none.
    `parent_hash`: the hash of the block before the first (None: they start a prompt).

    The same bytes as `block_hash` block after block, with the ids packed once and the
    parent carried as its digest: 34 us instead of 48 for a 512-token prompt, on the
    router's path of every request and the engine's after every prefill."""
    num_tokens = len(token_ids) // block_size * block_size
    if num_tokens == 0:
        return []
    packed = _packed(f"<{num_tokens}I", *token_ids[:num_tokens])
    count = struct.pack("<I", block_size)
    step = 4 * block_size
    hashes: list[int] = []
    parent = NO_PARENT if parent_hash is None else parent_hash.to_bytes(8, "little")
    for start in range(0, 4 * num_tokens, step):
        # One call with the block's bytes joined, not update() for each part: a router's first
        # block is hashed cold (the gateway was idle) on the request's path, and each call into
        # hashlib counts there.
        parent = hashlib.blake2b(b"".join((parent, count, packed[start : start + step], extra)),
                                 digest_size=8).digest()
        hashes.append(int.from_bytes(parent, "little"))
    return hashes


class BlockHashChain(Sequence[int]):
    """`hash_block_chain(token_ids, block_size, extra)`, computed as far as it is read.

    A prefix match stops at the first block no one holds, so a router that looks a prompt up
    this way hashes its held blocks and one more, not all of them: for a new 512-token prompt,
    one block of 32 before it is sent anywhere. The rest is hashed when read, which its
    bookkeeping does once the prompt is on its way. Reading block i computes up to twice as
    many as are computed already (at least i + 1), so reading all of it costs a few calls of
    `hash_block_chain`, not one per block."""

    def __init__(self, token_ids: Sequence[int], block_size: int, extra: bytes = b"") -> None:
        self._token_ids = token_ids
        self._block_size = block_size
        self._extra = extra
        self._num_blocks = len(token_ids) // block_size
        self._hashes: list[int] = []

    @property
    def num_computed(self) -> int:
        return len(self._hashes)

    def __len__(self) -> int:
        return self._num_blocks

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._num_blocks))]
        if index < 0:
            index += self._num_blocks
        if not 0 <= index < self._num_blocks:
            raise IndexError("block index out of range")
        if index >= len(self._hashes):
            self._compute(min(self._num_blocks, max(index + 1, 2 * len(self._hashes))))
        return self._hashes[index]

    def __iter__(self):
        for index in range(self._num_blocks):
            yield self[index]

    def _compute(self, num_blocks: int) -> None:
        bs, done = self._block_size, len(self._hashes)
        self._hashes += hash_block_chain(self._token_ids[done * bs:num_blocks * bs], bs, self._extra,
                                         parent_hash=self._hashes[-1] if self._hashes else None)


def _packed(fmt: str, *values: int) -> bytes:
    try:
        return struct.pack(fmt, *values)
    except struct.error:
        bad = next(v for v in values if not 0 <= v < 2**32)
        raise ValueError(f"token id {bad} is outside the vocabulary (not a u32)") from None
