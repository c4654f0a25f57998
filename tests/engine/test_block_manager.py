from hypothesis import given, settings
from hypothesis import strategies as st

from vlmq.workers.engine.block_manager import BlockManager, num_blocks_for, slot_mapping
from vlmq.workers.engine.sequence import Sequence


def seq_of(n: int, seq_id: int = 0, base: int = 0) -> Sequence:
    return Sequence(seq_id, [base + i for i in range(n)])


def run_prefill(bm: BlockManager, seq: Sequence, n: int) -> None:
    # Stand-in for update(): the KV of n more tokens is computed.
    seq.num_computed_tokens += n
    bm.cache_blocks(seq)


def test_allocate_covers_tokens_and_slot_mapping_is_paged():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = seq_of(10)
    assert bm.can_allocate(seq, 10)
    bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    slots = slot_mapping(seq.block_table, 4, 0, 10)
    b = seq.block_table
    assert slots[:5] == [b[0] * 4, b[0] * 4 + 1, b[0] * 4 + 2, b[0] * 4 + 3, b[1] * 4]
    assert slots[9] == b[2] * 4 + 1


def test_append_takes_a_new_block_only_at_block_boundaries():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = seq_of(6)
    bm.allocate(seq, 6)
    run_prefill(bm, seq, 6)
    seq.token_ids += [7, 8]
    assert bm.can_append(seq, 1)
    bm.append_slots(seq, 1)
    assert len(seq.block_table) == 2  # slot 6 is in block 1
    seq.num_computed_tokens += 1
    bm.append_slots(seq, 1)
    assert len(seq.block_table) == 2
    seq.num_computed_tokens += 1
    bm.append_slots(seq, 1)
    assert len(seq.block_table) == 3


def test_budget_is_hard_and_free_returns_blocks():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a, b = seq_of(12, 0), seq_of(8, 1, base=100)
    bm.allocate(a, 12)
    assert not bm.can_allocate(b, 8) and bm.can_allocate(b, 4)
    bm.allocate(b, 4)
    run_prefill(bm, b, 4)
    assert bm.num_free_blocks == 0 and not bm.can_append(b, 1)
    bm.free(a)
    assert bm.num_free_blocks == 3 and a.block_table == [] and a.num_computed_tokens == 0
    assert bm.can_append(b, 4)


def test_unhashed_free_blocks_are_reused_before_cached_ones_and_cached_evicted_lru():
    bm = BlockManager(num_blocks=6, block_size=2)
    first, second = seq_of(5, 0), seq_of(5, 1, base=50)
    for s in (first, second):
        bm.allocate(s, 5)
        run_prefill(bm, s, 5)  # 2 full (hashed) blocks + 1 partial each
    bm.free(first)
    bm.free(second)
    assert len(bm.hash_to_block) == 4
    fresh = seq_of(4, 2, base=900)
    bm.allocate(fresh, 4)  # the 2 unhashed blocks go first: all 4 cached blocks survive
    assert len(bm.hash_to_block) == 4
    fresh2 = seq_of(2, 3, base=700)
    bm.allocate(fresh2, 2)  # now one cached block is evicted: first's tail block (least recently freed)
    assert len(bm.hash_to_block) == 3
    again = seq_of(5, 4)  # same tokens as `first`: its first block is still cached, the second was evicted
    assert len(bm.get_computed_blocks(again)) == 1
    assert len(bm.get_computed_blocks(seq_of(5, 5, base=50))) == 2


def test_shared_prefix_blocks_are_reference_counted():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(9, 0)
    bm.allocate(a, 9)
    run_prefill(bm, a, 9)
    b = seq_of(9, 1)
    computed = bm.get_computed_blocks(b)
    assert computed == a.block_table[:2]
    bm.allocate(b, 1, computed)
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert [bm.ref_counts[x] for x in computed] == [2, 2]
    bm.free(a)
    assert [bm.ref_counts[x] for x in computed] == [1, 1] and bm.num_free_blocks == 8 - 3
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_at_least_one_token_is_left_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(8)
    bm.allocate(a, 8)
    run_prefill(bm, a, 8)
    assert len(bm.get_computed_blocks(seq_of(8, 1))) == 1  # 8 tokens: reuse 4, recompute the last block


@settings(max_examples=60, deadline=None, database=None)
@given(ops=st.lists(st.tuples(st.sampled_from("agf"), st.integers(0, 5), st.integers(1, 9)), max_size=40))
def test_random_operations_never_exceed_the_budget(ops):
    bm = BlockManager(num_blocks=10, block_size=3)
    live: dict[int, Sequence] = {}
    for op, sid, n in ops:
        seq = live.get(sid)
        if op == "a" and seq is None:
            seq = Sequence(sid, [sid % 2] * n)  # two token patterns, so prefixes get shared
            computed = bm.get_computed_blocks(seq)
            todo = n - len(computed) * 3
            if bm.can_allocate(seq, todo, computed):
                bm.allocate(seq, todo, computed)
                run_prefill(bm, seq, todo)
                live[sid] = seq
        elif op == "g" and seq is not None and bm.can_append(seq, n):
            seq.token_ids += [1] * n
            bm.append_slots(seq, n)
            run_prefill(bm, seq, n)
        elif op == "f" and seq is not None:
            bm.free(live.pop(sid))
        refs = [0] * 10
        for s in live.values():
            assert len(s.block_table) == num_blocks_for(s.num_computed_tokens, 3)
            for block_id in s.block_table:
                refs[block_id] += 1
        assert refs == bm.ref_counts
        assert bm.num_free_blocks + sum(1 for r in refs if r) == 10
        assert all(bm.block_hash[b] == h for h, b in bm.hash_to_block.items())
