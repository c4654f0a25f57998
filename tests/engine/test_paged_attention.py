"""The CPU paged-attention path against a dense float64 reference, over steps that mix decodes and prefill chunks."""
import random

import pytest
import torch

from vlmq.workers.layers import paged_torch
from vlmq.workers.layers.attention import AttentionMetadata, paged_attention

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


def run_step(rnd: random.Random, query_lens: list[int], block_size: int, heads: tuple[int, int]) -> None:
    num_heads, num_kv_heads = heads
    num_blocks = 256
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, D)  # stale values where nothing was written
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, D)
    free = rnd.sample(range(num_blocks), num_blocks)  # scattered block tables
    context_lens = [q + rnd.choice([0, rnd.randint(1, 50)]) for q in query_lens]
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c in context_lens]
    keys = [torch.randn(c, num_kv_heads, D) for c in context_lens]
    values = [torch.randn(c, num_kv_heads, D) for c in context_lens]
    for table, k, v, q_len in zip(tables, keys, values, query_lens, strict=True):
        for pos in range(k.shape[0] - q_len):  # the context cached by earlier steps
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size)
    q = torch.randn(sum(query_lens), num_heads, D)
    new_k = torch.cat([k[-n:] for k, n in zip(keys, query_lens, strict=True)])
    new_v = torch.cat([v[-n:] for v, n in zip(values, query_lens, strict=True)])
    out = paged_attention(q, new_k, new_v, k_cache, v_cache, meta, D**-0.5)
    expected = torch.cat([reference(qs, k, v, D**-0.5)
                          for qs, k, v in zip(q.split(query_lens), keys, values, strict=True)])
    assert (out.double() - expected).abs().max().item() < 1e-5


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


@pytest.mark.parametrize("cap_tokens", [0, 60, 150])
def test_batches_split_under_the_gather_cap_give_the_same_result(monkeypatch, cap_tokens):
    # cap 0: every sequence alone; otherwise runs of sequences whose padded contexts fit the cap
    monkeypatch.setitem(paged_torch._MAX_GATHER_BYTES, "cpu", cap_tokens * 2 * 2 * D * 4)  # K and V, 2 KV heads, fp32
    rnd = random.Random(cap_tokens)
    run_step(rnd, [1] * 9, 4, (4, 2))
    run_step(rnd, [1, 3, 1, 1, 3, 7, 1, 3, 1], 4, (4, 2))


def test_gather_cap_splits_runs_by_padded_size():
    split = paged_torch._split_by_gather_size
    assert split([0, 1, 2, 3], [10, 5, 30, 40], 1, cap=30) == [[0, 1], [2], [3]]  # 2 x 10 fits, 3 x 30 does not
    assert split([3, 1, 0], [10, 5, 8, 12], 1, cap=30) == [[3, 1], [0]]
