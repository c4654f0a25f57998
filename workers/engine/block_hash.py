"""Prefix-cache block hashes, chained from the start of the sequence and image-aware.

    hash_i = sha256(hash_{i-1} ‖ token_ids of block i ‖ extra keys of block i)

The extra keys name, for every image whose token span overlaps block i, the image's
content hash and where the block starts relative to the image's first token. Image pad
tokens are the same id for every image, so without them two prompts with different
images would share KV. The encoding is canonical (fixed-width ints, length-prefixed
strings), so equal inputs give equal bytes in every process; Python's hash() is salted
per process and too weak for identity.

A sequence's cache salt (its tenant's, unless the pool shares caches across tenants) replaces the chain's root,
so every block hash of a salted sequence differs from an unsalted or differently salted one: two tenants never
share a prefix block, even for the same image and prompt. No salt keeps the root (and every hash) as before.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence as Seq

from .sequence import ImagePlaceholder, Sequence

ROOT_HASH = bytes(32)


def root_hash(salt: str = "") -> bytes:
    """The chain's parent of block 0: ROOT_HASH, or for a salted sequence sha256(ROOT_HASH ‖ salt)."""
    return hashlib.sha256(ROOT_HASH + salt.encode()).digest() if salt else ROOT_HASH


def image_extra_keys(images: Seq[ImagePlaceholder], start: int, end: int) -> tuple[tuple[str, int], ...]:
    # (content_hash, start − image offset) for each image overlapping tokens [start, end).
    return tuple((img.content_hash, start - img.offset) for img in images if img.offset < end and img.end > start)


def hash_block(parent: bytes, token_ids: Seq[int], extra_keys: Seq[tuple[str, int]] = ()) -> bytes:
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(struct.pack("<I", len(extra_keys)))
    for key, offset in extra_keys:
        raw = key.encode()
        h.update(struct.pack("<qI", offset, len(raw)))
        h.update(raw)
    return h.digest()


def seq_block_hashes(seq: Sequence, block_size: int, num_blocks: int) -> list[bytes]:
    """Hashes of the first `num_blocks` full blocks of `seq` (memoised on seq.block_hashes)."""
    assert num_blocks * block_size <= seq.num_tokens, "only full blocks are hashed"
    hashes = seq.block_hashes
    for i in range(len(hashes), num_blocks):
        start, end = i * block_size, (i + 1) * block_size
        parent = hashes[i - 1] if i else root_hash(seq.cache_salt)
        hashes.append(hash_block(parent, seq.token_ids[start:end], image_extra_keys(seq.images, start, end)))
    return hashes[:num_blocks]
