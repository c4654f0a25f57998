"""The CPU paged-attention path against a dense float64 reference, over steps that mix decodes and prefill chunks."""
import random

import pytest
import torch

from vlmq.workers.layers import paged_torch
from vlmq.workers.layers.attention import AttentionMetadata, Segments, paged_attention, varlen_attention

D = 16


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # q: [Q, H, D] are the last Q of the C positions in k, v: [C, Hkv, D]; causal, float64
    groups = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,chd->hqc", q.double(), k) * scale  # [H, Q, C]
    q_len, ctx_len = q.shape[0], k.shape[0]
    visible = torch.arange(ctx_len)[None, :] <= torch.arange(ctx_len - q_len, ctx_len)[:, None]  # [Q, C]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqc,chd->qhd", probs, v)


def run_step(rnd: random.Random, query_lens: list[int], block_size: int, heads: tuple[int, int],
             shared: list[tuple[int, int] | None] | None = None, dtype: torch.dtype = torch.float32,
             tol: float = 1e-5) -> AttentionMetadata:
    # shared[i] = (p, n): sequence i's table starts with the first n blocks of the cached prefix p, the same
    # physical blocks as every other sequence on p (prefix caching); then its own blocks
    num_heads, num_kv_heads = heads
    num_blocks = 256

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape).to(dtype)

    k_cache = randn(num_blocks, block_size, num_kv_heads, D)  # stale values where nothing was written
    v_cache = randn(num_blocks, block_size, num_kv_heads, D)
    free = rnd.sample(range(num_blocks), num_blocks)  # scattered block tables
    shared = shared or [None] * len(query_lens)
    prefix_blocks: dict[int, list[int]] = {}
    for p, n in filter(None, shared):
        prefix_blocks.setdefault(p, [])
        prefix_blocks[p] += [free.pop() for _ in range(n - len(prefix_blocks[p]))]
    prefix_kv = {p: tuple(randn(len(b) * block_size, num_kv_heads, D) for _ in "kv")
                 for p, b in prefix_blocks.items()}
    tables, keys, values = [], [], []
    for q_len, s in zip(query_lens, shared, strict=True):
        p, n = s or (None, 0)
        own = q_len + rnd.choice([0, rnd.randint(1, 50)])  # own tokens after the shared blocks, the new ones last
        tables.append((prefix_blocks[p][:n] if s else []) + [free.pop() for _ in range(-(-own // block_size))])
        head_k, head_v = prefix_kv[p] if s else (randn(0, num_kv_heads, D),) * 2
        keys.append(torch.cat([head_k[:n * block_size], randn(own, num_kv_heads, D)]))
        values.append(torch.cat([head_v[:n * block_size], randn(own, num_kv_heads, D)]))
    context_lens = [k.shape[0] for k in keys]
    for table, k, v, q_len in zip(tables, keys, values, query_lens, strict=True):
        for pos in range(k.shape[0] - q_len):  # the context cached by earlier steps (shared blocks written alike)
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size)
    q = randn(sum(query_lens), num_heads, D)
    new_k = torch.cat([k[-n:] for k, n in zip(keys, query_lens, strict=True)])
    new_v = torch.cat([v[-n:] for v, n in zip(values, query_lens, strict=True)])
    out = paged_attention(q, new_k, new_v, k_cache, v_cache, meta, D**-0.5)
    expected = torch.cat([reference(qs, k, v, D**-0.5)
                          for qs, k, v in zip(q.split(query_lens), keys, values, strict=True)])
    assert out.dtype == dtype and (out.double() - expected).abs().max().item() < tol
    return meta


def shared_groups(meta: AttentionMetadata) -> list[tuple[list[int], int]]:
    # (query rows, shared tokens) of each shared prefix the step's plan attended to once
    plan = meta.torch_plan
    rows = plan.prefix_rows.split([p.num_rows for p in plan.prefixes])
    return [(r.tolist(), p.block_ids.numel() * meta.block_size) for r, p in zip(rows, plan.prefixes, strict=True)]


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_attention_matches_dense_reference(heads, block_size):
    rnd = random.Random(hash((heads, block_size)) % 1000)
    torch.manual_seed(rnd.randrange(1000))
    run_step(rnd, [1] * 7, block_size, heads)  # decode only: one batched call
    run_step(rnd, [5, 5, 5], block_size, heads)  # equal prefill chunks: one batched call with Q > 1
    run_step(rnd, [1], block_size, heads)
    for _ in range(4):  # mixed steps: decodes beside chunks of several lengths
        run_step(rnd, [rnd.choice([1, 1, 2, 3, rnd.randint(1, 40)]) for _ in range(rnd.randint(2, 8))],
                 block_size, heads)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_shared_prefixes_are_attended_once_and_match_dense_reference(monkeypatch, heads, block_size):
    monkeypatch.setitem(paged_torch._SHARED_PREFIX_COST, "cpu", 2 * block_size)
    rnd = random.Random(hash((heads, block_size, "shared")) % 1000)
    torch.manual_seed(rnd.randrange(1000))
    # six decodes on one prefix of 5 blocks: one shared part, its keys after the last shared block their own
    meta = run_step(rnd, [1] * 6, block_size, heads, [(0, 5)] * 6)
    assert shared_groups(meta) == [([0, 1, 2, 3, 4, 5], 5 * block_size)]
    # two prefixes, a prefill chunk on the first (its queries see the whole prefix) and sequences on neither
    meta = run_step(rnd, [1, 7, 1, 1, 1, 3, 1], block_size, heads,
                    [(0, 4), (0, 4), (1, 3), None, (1, 3), None, (0, 4)])
    assert shared_groups(meta) == [([0, 1, 2, 3, 4, 5, 6, 7, 14], 4 * block_size), ([8, 10], 3 * block_size)]
    # partly shared: four on prefix 0, two of them further along it; one shares only its first block
    meta = run_step(rnd, [1, 1, 2, 1, 1], block_size, heads, [(0, 6), (0, 3), (0, 6), (0, 3), (0, 1)])
    assert shared_groups(meta) == [([0, 1, 2, 3, 4], 3 * block_size)]  # 3 x 3 blocks saved beat 1 x 6 and 4 x 1
    meta = run_step(rnd, [1, 1, 1, 1], block_size, heads, [(0, 9), (0, 9), (0, 2), (0, 9)])
    assert shared_groups(meta) == [([0, 1, 3], 9 * block_size)]  # 2 x 9 beat 3 x 2


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])  # what the tiles reach
def test_shared_prefixes_in_half_precision_stay_within_its_rounding(monkeypatch, dtype, tol):
    monkeypatch.setitem(paged_torch._SHARED_PREFIX_COST, "cpu", 4)
    rnd = random.Random(str(dtype))
    meta = run_step(rnd, [1, 5, 1, 1, 2], 4, (4, 2), [(0, 6), (0, 6), (1, 4), (1, 4), None], dtype, tol)
    assert len(meta.torch_plan.prefixes) == 2


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_steps_without_a_shared_prefix_worth_its_cost_keep_the_plain_tiles(monkeypatch, block_size):
    monkeypatch.setitem(paged_torch._SHARED_PREFIX_COST, "cpu", 6 * block_size)
    rnd = random.Random(block_size)
    meta = run_step(rnd, [1, 1, 4, 1], block_size, (4, 2))  # nothing shared
    assert shared_groups(meta) == [] and all(t.prefix_pos is None for t in meta.torch_plan.tiles)
    meta = run_step(rnd, [1, 1, 4, 1], block_size, (4, 2), [(0, 2)] * 4)  # saves 3 x 2 blocks: not more than 6
    assert shared_groups(meta) == [] and all(t.prefix_pos is None for t in meta.torch_plan.tiles)
    assert shared_groups(run_step(rnd, [1, 1], block_size, (4, 2), [(0, 7)] * 2)) == [([0, 1], 7 * block_size)]
    monkeypatch.setitem(paged_torch._SHARED_PREFIX_COST, "cpu", None)  # cascade off (as on CUDA)
    assert shared_groups(run_step(rnd, [1] * 4, block_size, (4, 2), [(0, 5)] * 4)) == []


def test_only_blocks_cached_before_the_step_are_shared():
    # tables of 3 sequences agree on 4 blocks; sequence 2 had only 1 of them cached before this step (its new
    # tokens go into the second), so its queries would not see all of a longer shared part
    tables = [[7, 8, 9, 10, 1], [7, 8, 9, 10, 2], [7, 8, 9, 10, 3]]
    assert paged_torch._shared_prefix_groups(tables, [5, 5, 1], cost=0.5) == [([0, 1], 4)]  # 1 x 4 beat 2 x 1
    assert paged_torch._shared_prefix_groups(tables, [5, 5, 1], cost=4) == []  # neither saves more than it costs
    assert paged_torch._shared_prefix_groups(tables, [4, 5, 3], cost=0.5) == [([0, 1, 2], 3)]  # 2 x 3 beat 1 x 4


def test_prefix_groups_split_at_the_branch_that_saves_most():
    # one system-prompt block shared by all, then two images each under three questions
    tables = [[0, 1, 2, 3, 9], [0, 4, 5, 6, 10], [0, 1, 2, 3, 11], [0, 4, 5, 6, 12], [0, 1, 2, 3, 13], [0, 4, 5, 6, 14]]
    groups = paged_torch._shared_prefix_groups
    assert groups(tables, [5] * 6, cost=1) == [([0, 2, 4], 4), ([1, 3, 5], 4)]  # 2 x (2 x 4 - 1) beat 5 x 1 - 1
    assert groups(tables, [5] * 6, cost=8) == []  # 2 x 4 - 8 and 5 x 1 - 8 gain nothing
    assert groups([[3, 4], [3, 4]], [0, 2], cost=0.5) == []  # nothing cached on one


@pytest.mark.parametrize("cap_tokens", [0, 60, 150])
def test_batches_split_under_the_gather_cap_give_the_same_result(monkeypatch, cap_tokens):
    # cap 0: every sequence alone; otherwise runs of sequences whose padded contexts fit the cap
    monkeypatch.setitem(paged_torch._MAX_GATHER_BYTES, "cpu", cap_tokens * 2 * 2 * D * 4)  # K and V, 2 KV heads, fp32
    monkeypatch.setitem(paged_torch._SHARED_PREFIX_COST, "cpu", 4)
    rnd = random.Random(cap_tokens)
    run_step(rnd, [1] * 9, 4, (4, 2))
    run_step(rnd, [1, 3, 1, 1, 3, 7, 1, 3, 1], 4, (4, 2))
    run_step(rnd, [1, 3, 1, 1, 3, 7, 1, 3, 1], 4, (4, 2),
             [(0, 3), (0, 3), None, (1, 5), (1, 5), (0, 3), None, (1, 5), (0, 2)])


def test_gather_cap_splits_runs_by_padded_size():
    split = paged_torch._split_by_gather_size
    assert split([0, 1, 2, 3], [10, 5, 30, 40], 1, cap=30) == [[0, 1], [2], [3]]  # 2 x 10 fits, 3 x 30 does not
    assert split([3, 1, 0], [10, 5, 8, 12], 1, cap=30) == [[3, 1], [0]]


def test_vision_segments_of_equal_length_attend_batched_and_match_one_by_one():
    # images / windows of one packed vision call: equal lengths share one batched SDPA, a lone length is sliced;
    # every segment attends only within itself
    lengths = [5, 3, 5, 0, 5, 3, 7]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seg = Segments.of(cu)
    assert seg.bounds == tuple(cu.tolist()) and seg.max_len == 7
    assert sorted((n, r if isinstance(r, int) else r.numel()) for n, r in seg.groups) == [(3, 6), (5, 15), (7, 21)]
    q, k, v = torch.randn(3, int(cu[-1]), 4, 16).unbind(0)
    out = varlen_attention(q, k, v, seg, scale=0.25)
    for a, b in zip(seg.bounds[:-1], seg.bounds[1:], strict=True):
        if b > a:
            ref = torch.softmax(torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * 0.25, -1)
            torch.testing.assert_close(out[a:b], torch.einsum("hqk,khd->qhd", ref, v[a:b]), atol=1e-5, rtol=1e-5)
