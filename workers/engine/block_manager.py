"""Paged KV cache bookkeeping: fixed-size blocks, ref counts, free list, prefix cache.

A block holds `block_size` token slots; slot = block_id × block_size + offset. The
manager never hands out more than `num_blocks` blocks. With prefix caching, a full
block whose KV has been computed is registered under its chained hash
(see block_hash.py); when its last holder frees it, it joins the free list but keeps
its hash, so a later request with the same prefix (and the same images) reuses it.
Free hashed blocks are evicted least recently freed first, only when a fresh block is
needed; unhashed free blocks are handed out before any hashed one.

With KV tiers (kv_tiers.py), `on_evict(block_id, hash)` sees every cached block just before its KV is
overwritten (it is demoted instead of dropped), and `install_cached` registers a block restored from a tier.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq

from .block_hash import seq_block_hashes
from .sequence import Sequence


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def slot_mapping(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """KV slot of every token position in [start, end)."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        # Free blocks in eviction order: unhashed first, then hashed from least recently freed.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_prefix_queries = 0  # tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of those, tokens found
        self.on_evict: Callable[[int, bytes], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    # -- prefix cache -------------------------------------------------------------------------
    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Longest run of cached full blocks that prefixes `seq`; takes nothing yet.

        At least one token is left to compute: the step that computes the last token
        also produces the logits to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        for h in seq_block_hashes(seq, self.block_size, max_blocks):
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def cache_blocks(self, seq: Sequence) -> None:
        """Register the full blocks of `seq` whose KV is now computed."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for i, h in enumerate(seq_block_hashes(seq, self.block_size, num_full)):
            block_id = seq.block_table[i]
            if self.block_hash[block_id] is None and h not in self.hash_to_block:
                self.block_hash[block_id] = h
                self.hash_to_block[h] = block_id

    def install_cached(self, h: bytes) -> int | None:
        """Take a free block for KV restored from a tier, cached under `h` and free (most recently freed);
        the caller writes its KV before the next step. None: `h` is cached already or no block is free."""
        if not self.enable_prefix_caching or h in self.hash_to_block or not self.free_blocks:
            return None
        block_id = self._take_free_block()
        self.ref_counts[block_id] = 0
        self.block_hash[block_id] = h
        self.hash_to_block[h] = block_id
        self.free_blocks[block_id] = None
        return block_id

    # -- allocation ---------------------------------------------------------------------------
    def _num_fresh_blocks(self, seq: Sequence, num_tokens: int, num_computed_blocks: int = 0) -> int:
        have = max(len(seq.block_table), num_computed_blocks)
        return max(0, num_blocks_for(num_tokens, self.block_size) - have)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: Seq[int] = ()) -> bool:
        """Room for a first allocation: the prefix hits plus blocks for `num_new_tokens` after them."""
        assert not seq.block_table, "can_allocate is for sequences without blocks; use can_append"
        num_tokens = len(computed_blocks) * self.block_size + num_new_tokens
        revived = sum(1 for b in computed_blocks if self.ref_counts[b] == 0)  # taken off the free list
        return revived + self._num_fresh_blocks(seq, num_tokens, len(computed_blocks)) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: Seq[int] = ()) -> None:
        assert self.can_allocate(seq, num_new_tokens, computed_blocks)
        for block_id in computed_blocks:  # before fresh ones, so eviction cannot take them
            if self.ref_counts[block_id] == 0:
                del self.free_blocks[block_id]
            self.ref_counts[block_id] += 1
        seq.block_table = list(computed_blocks)
        seq.num_cached_tokens = len(computed_blocks) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        self.num_prefix_queries += seq.num_tokens
        self.num_prefix_hits += seq.num_cached_tokens
        self.append_slots(seq, num_new_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        num_tokens = seq.num_computed_tokens + num_new_tokens
        return self._num_fresh_blocks(seq, num_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq.block_table to hold KV for num_computed_tokens + num_new_tokens tokens."""
        for _ in range(self._num_fresh_blocks(seq, seq.num_computed_tokens + num_new_tokens)):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        h = self.block_hash[block_id]
        if h is not None:  # evict: the cached KV is about to be overwritten
            if self.on_evict is not None:
                self.on_evict(block_id, h)
            self.block_hash[block_id] = None
            del self.hash_to_block[h]
        self.ref_counts[block_id] = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Drop seq's blocks; its KV is gone (num_computed_tokens = 0), cached blocks stay reusable."""
        # Tail first, so a sequence's first blocks (the most shared prefix) are evicted last.
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the blocks holding seq's first `num_tokens` tokens (speculative decoding: the slots of
        rejected proposals). The dropped blocks were never full of computed KV, so they carry no prefix hash."""
        keep = num_blocks_for(num_tokens, self.block_size)
        for block_id in reversed(seq.block_table[keep:]):
            assert self.block_hash[block_id] is None
            self._release(block_id)
        del seq.block_table[keep:]

    def _release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0
        if self.ref_counts[block_id] == 0:
            self.free_blocks[block_id] = None
            if self.block_hash[block_id] is None:
                self.free_blocks.move_to_end(block_id, last=False)
