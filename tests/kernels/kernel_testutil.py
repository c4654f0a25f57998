"""Builders for paged-KV test cases, and the tolerances the kernel tests use."""
from __future__ import annotations

import pytest
import torch

from vlmq.kernels import reference

# (atol, rtol) against a float64 ground truth; outputs are O(1) (softmax-weighted randn).
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
LSE_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

def gpu_test(fn):
    """Mark a test ``gpu`` and skip it without a CUDA device."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.mark.gpu(skip(fn))


def build_paged(prefixes, suffixes, group_sizes, block_size, num_kv_heads, head_dim, dtype, device="cpu"):
    """Paged cache where the sequences of group g share prefixes[g] ([P_g] tokens).

    Full prefix blocks are shared (same block ids in every table of the group); a
    partly filled last prefix block is copied per sequence (copy on write). Unused
    cache slots are NaN and unused table entries -1, so a kernel reading outside a
    sequence fails the comparison. Returns (k_cache, v_cache, block_tables,
    context_lens, group_indptr, prefix_lens, full_kv) with full_kv[i] = (k, v) of
    sequence i, [L_i, Hkv, D] each, float64.
    """
    tables, full_kv, writes = [], [], []
    next_block = 0
    seq = 0
    for g, size in enumerate(group_sizes):
        pk, pv = prefixes[g]
        n_shared = pk.shape[0] // block_size
        shared = list(range(next_block, next_block + n_shared))
        next_block += n_shared
        for _ in range(size):
            sk, sv = suffixes[seq]
            k, v = torch.cat([pk, sk]), torch.cat([pv, sv])
            n_own = -(-k.shape[0] // block_size) - n_shared
            table = shared + list(range(next_block, next_block + max(0, n_own)))
            next_block += max(0, n_own)
            start = 0 if seq == sum(group_sizes[:g]) else n_shared * block_size  # shared blocks written once
            writes.append((table, k[start:], v[start:], start))
            tables.append(table)
            full_kv.append((k, v))
            seq += 1
    num_blocks = next_block + 3
    perm = torch.randperm(num_blocks)  # scatter logical blocks over the pool
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    for table, k, v, start in writes:
        pos = torch.arange(start, start + k.shape[0])
        slots = perm[torch.tensor(table, dtype=torch.long)[pos // block_size]] * block_size + pos % block_size
        reference.store_kv(k.to(dtype), v.to(dtype), k_cache, v_cache, slots)
    width = max([len(t) for t in tables] + [1])
    block_tables = torch.full((len(tables), width), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, :len(t)] = perm[torch.tensor(t, dtype=torch.long)].int()
    context_lens = torch.tensor([kv[0].shape[0] for kv in full_kv], dtype=torch.int32)
    indptr = torch.tensor([0] + list(group_sizes)).cumsum(0).int()
    prefix_lens = torch.tensor([p[0].shape[0] for p in prefixes], dtype=torch.int32)
    out = (k_cache, v_cache, block_tables, context_lens, indptr, prefix_lens)
    return tuple(x.to(device) for x in out) + (full_kv,)


def rand_kv(n, num_kv_heads, head_dim):
    return (torch.randn(n, num_kv_heads, head_dim, dtype=torch.float64),
            torch.randn(n, num_kv_heads, head_dim, dtype=torch.float64))


def make_case(prefix_lens, suffix_lens, group_sizes, block_size, num_heads, num_kv_heads, head_dim, dtype,
              device="cpu"):
    """Random q, paged cache and float64 ground truth (attention over each sequence's whole KV)."""
    prefixes = [rand_kv(p, num_kv_heads, head_dim) for p in prefix_lens]
    suffixes = [rand_kv(s, num_kv_heads, head_dim) for s in suffix_lens]
    *paged, full_kv = build_paged(prefixes, suffixes, group_sizes, block_size, num_kv_heads, head_dim, dtype, device)
    q = torch.randn(len(suffix_lens), num_heads, head_dim, dtype=torch.float64)
    # Ground truth from the values actually stored (rounded to dtype), in float64.
    truth = [reference.attention(q[i:i + 1].to(dtype).double(), k.to(dtype).double(), v.to(dtype).double())
             for i, (k, v) in enumerate(full_kv)]
    out = torch.cat([t[0] for t in truth]).to(device)
    lse = torch.cat([t[1] for t in truth]).to(device)
    return (q.to(dtype).to(device), *paged, out, lse)


def assert_close(out, lse, ref_out, ref_lse, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref_out.double(), atol=atol, rtol=rtol)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "empty/non-empty lse pattern differs"
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite].double(), atol=LSE_TOL[dtype], rtol=0)
