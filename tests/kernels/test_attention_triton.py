"""Triton attention kernels (interpreter on CPU) against the references and the float64 ground truth."""
import pytest
import torch
from kernel_testutil import assert_close, gpu_test, make_case

from vlmq.kernels import (
    CascadePlan,
    cascade_decode_attention,
    merge_attn_states,
    paged_decode_attention,
    reference,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_matches_reference_including_empty_sides(dtype):
    out_a, out_b = torch.randn(3, 4, 64).to(dtype), torch.randn(3, 4, 64).to(dtype)
    lse_a, lse_b = torch.randn(3, 4) * 3, torch.randn(3, 4) * 3
    lse_a[0, :2] = float("-inf")  # A empty
    lse_b[1, 1:] = float("-inf")  # B empty
    lse_a[2, 3] = lse_b[2, 3] = float("-inf")  # both empty
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b, impl="triton")
    ref_out, ref_lse = reference.merge_attn_states(out_a.double(), lse_a, out_b.double(), lse_b)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out, lse, ref_out, ref_lse, dtype)
    assert torch.equal(out[2, 3], torch.zeros_like(out[2, 3]))
    torch.testing.assert_close(out[0, :2], out_b[0, :2], atol=0, rtol=0)


def test_merge_accepts_strided_views():
    full = torch.randn(2, 6, 3, 64)  # e.g. slices of one bigger buffer
    lse = torch.randn(2, 6, 3)
    out, merged = merge_attn_states(full[:, :, 0], lse[:, :, 0], full[:, :, 2], lse[:, :, 2], impl="triton")
    ref_out, ref_lse = reference.merge_attn_states(full[:, :, 0], lse[:, :, 0], full[:, :, 2], lse[:, :, 2])
    assert_close(out, merged, ref_out, ref_lse, torch.float32)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_decode_fp32(num_heads, num_kv_heads, head_dim, block_size):
    # Ragged lengths: empty, shorter than a block, several blocks (not a multiple of block or split size).
    q, kc, vc, bt, lens, _, _, ref_out, ref_lse = make_case(
        [0, 0, 0], [0, 5, 130], [1, 1, 1], block_size, num_heads, num_kv_heads, head_dim, torch.float32)
    for num_splits in (1, 3):
        out, lse = paged_decode_attention(q, kc, vc, bt, lens, num_splits=num_splits, impl="triton")
        assert_close(out, lse, ref_out, ref_lse, torch.float32)
    out, lse = paged_decode_attention(q, kc, vc, bt, lens, impl="torch")
    assert_close(out, lse, ref_out, ref_lse, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_decode_half_precision(dtype):
    q, kc, vc, bt, lens, _, _, ref_out, ref_lse = make_case(
        [0, 0], [70, 9], [1, 1], 16, 8, 2, 64, dtype)
    out, lse = paged_decode_attention(q, kc, vc, bt, lens, num_splits=2, impl="triton")
    assert out.dtype == dtype
    assert_close(out, lse, ref_out, ref_lse, dtype)


def test_paged_decode_odd_head_dim_and_explicit_scale():
    q, kc, vc, bt, lens, _, _, _, _ = make_case([0, 0], [20, 3], [1, 1], 8, 6, 3, 40, torch.float32)
    out, lse = paged_decode_attention(q, kc, vc, bt, lens, scale=0.05, max_context_len=20, impl="triton")
    ref_out, ref_lse = reference.paged_decode_attention(q.double(), kc.double(), vc.double(), bt, lens, scale=0.05)
    assert_close(out, lse, ref_out, ref_lse, torch.float32)


# Groups: (prefix_len, sequences, suffix lens). Covers a block-aligned prefix, a prefix ending
# mid-block (copy-on-write block), empty prefixes, empty suffixes and a group of one.
CASCADES = {
    "aligned": ([64, 0], [3, 1], [5, 0, 40, 17]),
    "mid_block": ([37, 20], [2, 2], [0, 30, 1, 0]),
    "singletons": ([10, 0, 33], [1, 1, 1], [0, 12, 70]),
}


@pytest.mark.parametrize("case", sorted(CASCADES))
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 1, 64), (4, 2, 128)])
def test_cascade_fp32_equals_attention_over_whole_context(case, num_heads, num_kv_heads, head_dim):
    prefix_lens, group_sizes, suffix_lens = CASCADES[case]
    q, kc, vc, bt, lens, indptr, pre, ref_out, ref_lse = make_case(
        prefix_lens, suffix_lens, group_sizes, 16, num_heads, num_kv_heads, head_dim, torch.float32)
    out, lse = cascade_decode_attention(q, kc, vc, bt, lens, indptr, pre, num_splits=2, impl="triton")
    assert_close(out, lse, ref_out, ref_lse, torch.float32)
    out, lse = cascade_decode_attention(q, kc, vc, bt, lens, indptr, pre, impl="torch")
    assert_close(out, lse, ref_out, ref_lse, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cascade_half_precision_with_big_group_and_empty_group(dtype, monkeypatch):
    # 12 sequences x 2 query heads per KV head = 24 rows over one prefix; with 16 rows per
    # program that is two query tiles, each reading the prefix once.
    from vlmq.kernels import _triton_attn

    monkeypatch.setattr(_triton_attn, "MAX_BLOCK_M", 16)
    sizes = [12, 0, 1]
    q, kc, vc, bt, lens, indptr, pre, ref_out, ref_lse = make_case(
        [50, 16, 0], [int(x) for x in torch.randint(0, 20, (13,))], sizes, 32, 4, 2, 64, dtype)
    plan = CascadePlan.from_lens(lens, indptr, pre)
    assert plan.max_group_size == 12 and plan.max_prefix_len == 50
    out, lse = cascade_decode_attention(q, kc, vc, bt, lens, indptr, pre, plan=plan, impl="triton")
    assert out.dtype == dtype
    assert_close(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize("bad", ["heads", "dtype", "stride", "lens", "indptr", "prefix", "impl"])
def test_wrappers_reject_bad_arguments(bad):
    q, kc, vc, bt, lens, indptr, pre, _, _ = make_case([16], [4, 2], [2], 16, 4, 2, 64, torch.float32)
    kwargs = dict(q=q, k_cache=kc, v_cache=vc, block_tables=bt, context_lens=lens, group_indptr=indptr,
                  prefix_lens=pre, impl="triton")
    if bad == "heads":
        kwargs["q"] = torch.randn(2, 3, 64)
    elif bad == "dtype":
        kwargs["k_cache"] = kc.half()
    elif bad == "stride":
        kwargs["q"] = torch.randn(2, 64, 4).transpose(1, 2)
    elif bad == "lens":
        kwargs["context_lens"] = lens + 1000
    elif bad == "indptr":
        kwargs["group_indptr"] = torch.tensor([0, 1])
    elif bad == "prefix":
        kwargs["prefix_lens"] = torch.tensor([5])  # > context length of sequence 1
        kwargs["context_lens"] = torch.tensor([20, 4], dtype=torch.int32)
    elif bad == "impl":
        kwargs["impl"] = "cuda"
    with pytest.raises(ValueError):
        cascade_decode_attention(**kwargs)


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(28, 4, 128), (16, 2, 64)])
@pytest.mark.parametrize("block_size", [16, 256])  # the engine's CUDA blocks: 16, and 256 with flash-attn
def test_gpu_decode_and_cascade_large(dtype, num_heads, num_kv_heads, head_dim, block_size):
    # 64 sequences: 4 groups of 16 sharing 1000-3000 token prefixes; auto picks Triton on CUDA.
    prefix_lens = [1000, 2000, 3000, 1234]
    suffix_lens = [int(x) for x in torch.randint(0, 300, (64,))]
    q, kc, vc, bt, lens, indptr, pre, ref_out, ref_lse = make_case(
        prefix_lens, suffix_lens, [16] * 4, block_size, num_heads, num_kv_heads, head_dim, dtype, device="cuda")
    out, lse = cascade_decode_attention(q, kc, vc, bt, lens, indptr, pre)
    assert out.is_cuda
    assert_close(out, lse, ref_out, ref_lse, dtype)
    out, lse = paged_decode_attention(q, kc, vc, bt, lens)
    assert_close(out, lse, ref_out, ref_lse, dtype)
    out, lse = paged_decode_attention(q, kc, vc, bt, lens, num_splits=7)
    assert_close(out, lse, ref_out, ref_lse, dtype)


@gpu_test
def test_gpu_fp32_decode_is_exact_to_1e5():
    q, kc, vc, bt, lens, _, _, ref_out, ref_lse = make_case(
        [0] * 8, [1, 17, 500, 4000, 0, 33, 2048, 999], [1] * 8, 16, 28, 4, 128, torch.float32, device="cuda")
    out, lse = paged_decode_attention(q, kc, vc, bt, lens)
    assert_close(out, lse, ref_out, ref_lse, torch.float32)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_cascade_reads_the_prefix_once_per_group_through_its_first_table(impl):
    # Point the prefix entries of every table but the group's first at a block of wrong values:
    # the cascade result stays exact (the prefix is read once for the group, through the first
    # table), while per-sequence decode over the same tables is wrong.
    q, kc, vc, bt, lens, indptr, pre, ref_out, ref_lse = make_case([32], [3, 9, 0], [3], 16, 4, 2, 64, torch.float32)
    wrong = int(torch.isnan(kc.flatten(1)).all(1).nonzero()[-1])  # a spare block of the pool
    kc[wrong], vc[wrong] = torch.randn_like(kc[wrong]), torch.full_like(vc[wrong], 100.0)
    bt[1:, :2] = wrong
    out, lse = cascade_decode_attention(q, kc, vc, bt, lens, indptr, pre, num_splits=1, impl=impl)
    assert_close(out, lse, ref_out, ref_lse, torch.float32)
    decoded, _ = paged_decode_attention(q, kc, vc, bt, lens, impl=impl)
    assert float((decoded[1:] - ref_out[1:]).abs().min()) > 1.0
