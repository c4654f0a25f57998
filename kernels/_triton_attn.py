"""Triton attention kernels: split-KV paged attention for groups of queries, split and pair merges.

Imported lazily by the wrappers (set TRITON_INTERPRET=1 before the first import to
run on CPU). Shapes are checked by the wrappers, not here.

One kernel serves both decode and the shared prefix: a *group* is a run of
sequences (rows group_indptr[g] .. group_indptr[g+1]-1 of q) that attend to the same
KV positions [kv_start, kv_end) through the block table of the group's first
sequence. Plain decode has one sequence per group; a shared prefix puts a whole
batch of sequences in one group, so the prefix KV is read once per query tile
instead of once per sequence. Query rows of a tile are (sequence, head) pairs of one
KV head, so a tile of BLOCK_M rows is a [BLOCK_M, D] x [D, BLOCK_N] matmul.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # globals read inside @triton.jit must be constexpr
MAX_BLOCK_M = 128  # query rows per program (tests lower it to get several tiles)
MAX_TILE = 4096  # elements per program in the merge kernels
# Explicit, so Triton 3.9 does not warn that its default changes (pytest turns warnings into errors).
LAUNCH = {"enable_fp_fusion": True}


@triton.jit
def _dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    # UPCAST: the interpreter multiplies bfloat16 operands wrongly, so it gets fp32 copies
    # of the same (already rounded) values; compiled kernels keep the native dot.
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=PREC)
    return c


@triton.jit
def _group_attn_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, indptr_ptr, start_ptr, end_ptr, out_ptr, lse_ptr,
    s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bt, s_ot, s_oh, s_os, s_lt, s_lh,
    qk_scale, group_size, num_m_tiles, tokens_per_split, block_size, head_dim,
    HAS_START: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    g = tl.program_id(0)
    kvh = tl.program_id(1) // num_m_tiles
    m_tile = tl.program_id(1) % num_m_tiles
    split = tl.program_id(2)
    seq0 = tl.load(indptr_ptr + g)
    num_rows = (tl.load(indptr_ptr + g + 1) - seq0) * group_size
    if m_tile * BLOCK_M >= num_rows:
        return
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    seq = seq0 + rows // group_size
    head = kvh * group_size + rows % group_size
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(q_ptr + seq[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    kv_start = 0
    if HAS_START:
        kv_start = tl.load(start_ptr + g).to(tl.int32)
    start = kv_start + split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, tl.load(end_ptr + g).to(tl.int32))
    bt_row = bt_ptr + seq0.to(tl.int64) * s_bt

    # Online softmax in base 2: scores are pre-multiplied by scale * log2(e).
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        p_ok = pos < end
        blk = tl.load(bt_row + pos // block_size, mask=p_ok, other=0).to(tl.int64)
        off = pos % block_size
        kv_mask = p_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + blk[:, None] * s_kb + off[:, None] * s_kt + kvh * s_kh + d[None, :],
                    mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), PREC, UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N]
        s = tl.where(p_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile has a visible key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        v = tl.load(v_ptr + blk[:, None] * s_vb + off[:, None] * s_vt + kvh * s_vh + d[None, :],
                    mask=kv_mask, other=0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, UPCAST)
        m_i = m_new

    has_kv = l_i > 0
    out = tl.where(has_kv[:, None], acc / tl.where(has_kv, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has_kv, (m_i + tl.log2(tl.where(has_kv, l_i, 1.0))) * LN2, float("-inf"))
    o_off = seq[:, None] * s_ot + head[:, None] * s_oh + split * s_os + d[None, :]
    tl.store(out_ptr + o_off, out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + seq * s_lt + head * s_lh + split, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    parts_ptr, part_lse_ptr, out_ptr, lse_ptr,
    s_pt, s_ph, s_ps, s_qt, s_qh, s_ot, s_oh, s_lt, s_lh,
    num_heads, num_splits, head_dim, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # N-way form of merge_attn_states over the splits of BLOCK_H heads of one token:
    # lse = log sum_s e^lse_s, out = sum_s e^(lse_s - lse) out_s.
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    sp = tl.arange(0, BLOCK_S)[None, :]  # [1, BLOCK_S]
    d = tl.arange(0, BLOCK_D)[None, None, :]
    hs_ok = (h < num_heads) & (sp < num_splits)
    lses = tl.load(part_lse_ptr + t * s_qt + h * s_qh + sp, mask=hs_ok, other=float("-inf"))
    m = tl.max(lses, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: keep exp() away from -inf - -inf
    w = tl.exp(lses - m[:, None])
    total = tl.sum(w, 1)
    inv = tl.where(total > 0, 1.0 / tl.where(total > 0, total, 1.0), 0.0)
    parts = tl.load(parts_ptr + t * s_pt + h[:, :, None] * s_ph + sp[:, :, None] * s_ps + d,
                    mask=hs_ok[:, :, None] & (d < head_dim), other=0.0)
    out = tl.sum(parts * (w * inv[:, None])[:, :, None], 1)  # [BLOCK_H, BLOCK_D]
    lse = tl.where(total > 0, m + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    h1 = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d2 = tl.arange(0, BLOCK_D)[None, :]
    tl.store(out_ptr + t * s_ot + h1[:, None] * s_oh + d2, out.to(out_ptr.dtype.element_ty),
             mask=(h1[:, None] < num_heads) & (d2 < head_dim))
    tl.store(lse_ptr + t * s_lt + h1 * s_lh, lse, mask=h1 < num_heads)


@triton.jit
def _merge_pair_kernel(
    oa_ptr, la_ptr, ob_ptr, lb_ptr, out_ptr, lse_ptr,
    s_oat, s_oah, s_obt, s_obh, s_ot, s_oh, s_lat, s_lah, s_lbt, s_lbh, s_lt, s_lh,
    num_heads, head_dim, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = h_ok[:, None] & (d < head_dim)
    la = tl.load(la_ptr + t * s_lat + h * s_lah, mask=h_ok, other=float("-inf")).to(tl.float32)
    lb = tl.load(lb_ptr + t * s_lbt + h * s_lbh, mask=h_ok, other=float("-inf")).to(tl.float32)
    m = tl.maximum(la, lb)
    m = tl.where(m == float("-inf"), 0.0, m)  # both empty: keep exp() away from -inf - -inf
    wa = tl.exp(la - m)
    wb = tl.exp(lb - m)
    total = wa + wb
    inv = tl.where(total > 0, 1.0 / tl.where(total > 0, total, 1.0), 0.0)
    oa = tl.load(oa_ptr + t * s_oat + h[:, None] * s_oah + d, mask=mask, other=0.0).to(tl.float32)
    ob = tl.load(ob_ptr + t * s_obt + h[:, None] * s_obh + d, mask=mask, other=0.0).to(tl.float32)
    out = oa * (wa * inv)[:, None] + ob * (wb * inv)[:, None]
    lse = tl.where(total > 0, m + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    tl.store(out_ptr + t * s_ot + h[:, None] * s_oh + d, out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + t * s_lt + h * s_lh, lse, mask=h_ok)


def group_attention(q, k_cache, v_cache, block_tables, group_indptr, kv_starts, kv_ends, out_parts, lse_parts,
                    *, scale, tokens_per_split, max_group_size):
    """Launch the group kernel; writes out_parts [T, H, S, D] fp32 and lse_parts [T, H, S] fp32."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    block_m = max(16, min(MAX_BLOCK_M, triton.next_power_of_2(max_group_size * group_size)))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = (64 if block_d <= 64 else 32) // (2 if q.dtype == torch.float32 else 1)  # no register spills
    num_m_tiles = triton.cdiv(max_group_size * group_size, block_m)
    num_groups, num_splits = group_indptr.shape[0] - 1, out_parts.shape[2]
    grid = (num_groups, num_kv_heads * num_m_tiles, num_splits)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    upcast = q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    starts = kv_starts if kv_starts is not None else kv_ends  # unused pointer when HAS_START is False
    _group_attn_kernel[grid](
        q, k_cache, v_cache, block_tables, group_indptr, starts, kv_ends, out_parts, lse_parts,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        *out_parts.stride()[:3], *lse_parts.stride()[:2],
        scale * LOG2E, group_size, num_m_tiles, tokens_per_split, k_cache.shape[1], head_dim,
        HAS_START=kv_starts is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        PREC=prec, UPCAST=upcast,
        num_warps=8 if block_m >= 128 else 4, **LAUNCH,
    )


def merge_splits(out_parts, lse_parts, out, lse):
    """Merge [T, H, S, D] / [T, H, S] partials into out [T, H, D] (its dtype) and lse [T, H] fp32."""
    num_tokens, num_heads, num_splits, head_dim = out_parts.shape
    block_s, block_d = triton.next_power_of_2(num_splits), triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_heads), max(1, MAX_TILE // (block_s * block_d)))
    _merge_splits_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        out_parts, lse_parts, out, lse, *out_parts.stride()[:3], *lse_parts.stride()[:2],
        *out.stride()[:2], *lse.stride(), num_heads, num_splits, head_dim,
        BLOCK_H=block_h, BLOCK_S=block_s, BLOCK_D=block_d, **LAUNCH,
    )


def merge_pair(out_a, lse_a, out_b, lse_b, out, lse):
    num_tokens, num_heads, head_dim = out_a.shape
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_heads), max(1, MAX_TILE // block_d))
    _merge_pair_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        out_a, lse_a, out_b, lse_b, out, lse, *out_a.stride()[:2], *out_b.stride()[:2], *out.stride()[:2],
        *lse_a.stride(), *lse_b.stride(), *lse.stride(), num_heads, head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        **LAUNCH,
    )
