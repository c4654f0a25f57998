"""The plain-torch references against the definition of attention (float64 ground truth)."""
import math

import pytest
import torch
from kernel_testutil import assert_close, make_case, rand_kv

from vlmq.kernels import reference


def naive_attention(q, k, v, scale):
    # One query row, one head at a time: softmax(q k^T * scale) v, lse = log sum exp.
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for i in range(q.shape[0]):
        for h in range(q.shape[1]):
            s = [float(q[i, h] @ k[j, h // group]) * scale for j in range(k.shape[0])]
            if s:
                m = max(s)
                w = [math.exp(x - m) for x in s]
                out[i, h] = sum(wj * v[j, h // group] for j, wj in enumerate(w)) / sum(w)
                lse[i, h] = m + math.log(sum(w))
    return out, lse


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 1)])
@pytest.mark.parametrize("num_kv", [0, 1, 7])
def test_attention_matches_definition(num_heads, num_kv_heads, num_kv):
    q = torch.randn(3, num_heads, 8, dtype=torch.float64)
    k, v = rand_kv(num_kv, num_kv_heads, 8)
    out, lse = reference.attention(q, k, v, scale=0.3)
    ref_out, ref_lse = naive_attention(q, k, v, 0.3)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-12)


def test_causal_aligns_queries_with_the_last_keys():
    q = torch.randn(3, 2, 8, dtype=torch.float64)
    k, v = rand_kv(5, 1, 8)
    out, lse = reference.attention(q, k, v, causal=True)
    for i in range(3):
        o, s = reference.attention(q[i:i + 1], k[:3 + i], v[:3 + i])
        torch.testing.assert_close(out[i:i + 1], o, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(lse[i:i + 1], s, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("split", [0, 1, 6, 11, 12])
def test_merge_of_disjoint_sets_is_attention_over_the_union(split):
    q = torch.randn(4, 4, 16, dtype=torch.float64)
    k, v = rand_kv(12, 2, 16)
    perm = torch.randperm(12)  # A and B need not be contiguous
    a, b = perm[:split], perm[split:]
    out_a, lse_a = reference.attention(q, k[a], v[a])
    out_b, lse_b = reference.attention(q, k[b], v[b])
    out, lse = reference.merge_attn_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = reference.attention(q, k, v)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-12)


def test_merge_of_two_empty_sets_is_zero_with_minus_inf_lse():
    out_a = torch.randn(2, 3, 4)  # garbage outputs must be ignored
    lse = torch.full((2, 3), float("-inf"))
    out, merged = reference.merge_attn_states(out_a, lse, out_a, lse)
    assert torch.equal(out, torch.zeros_like(out))
    assert bool(torch.isneginf(merged).all())


def test_merge_n_folds_pairwise():
    q = torch.randn(2, 2, 8, dtype=torch.float64)
    k, v = rand_kv(9, 2, 8)
    parts = [reference.attention(q, k[i:i + 3], v[i:i + 3]) for i in (0, 3, 6)]
    outs, lses = torch.stack([p[0] for p in parts], -2), torch.stack([p[1] for p in parts], -1)
    out, lse = reference.merge_attn_states_n(outs, lses)
    ref_out, ref_lse = reference.attention(q, k, v)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_decode_reference_is_attention_over_the_gathered_kv(block_size):
    q, kc, vc, bt, lens, _, _, ref_out, ref_lse = make_case(
        [0, 0, 0], [17, 0, 33], [1, 1, 1], block_size, 4, 2, 16, torch.float64)
    out, lse = reference.paged_decode_attention(q, kc, vc, bt, lens)
    assert_close(out, lse, ref_out, ref_lse, torch.float32)


@pytest.mark.parametrize("prefix,suffixes", [(40, [3, 0, 21]), (0, [5, 9, 1]), (16, [0, 0, 0])])
def test_cascade_reference_is_attention_over_prefix_plus_suffix(prefix, suffixes):
    q, kc, vc, bt, lens, indptr, pre, ref_out, ref_lse = make_case(
        [prefix, 7], suffixes + [4], [3, 1], 16, 4, 2, 16, torch.float64)
    out, lse = reference.cascade_decode_attention(q, kc, vc, bt, lens, indptr, pre)
    assert_close(out, lse, ref_out, ref_lse, torch.float32)


def test_store_kv_skips_negative_slots():
    kc, vc = torch.zeros(3, 4, 1, 2), torch.zeros(3, 4, 1, 2)
    key = torch.arange(6.0).view(3, 1, 2)
    reference.store_kv(key, -key, kc, vc, torch.tensor([5, -1, 0]))
    assert torch.equal(kc[1, 1], key[0]) and torch.equal(kc[0, 0], key[2]) and torch.equal(vc[1, 1], -key[0])
    assert int((kc != 0).sum()) == 3  # key[0] = [0, 1] and key[2] = [4, 5]
