"""Triton KV-cache kernels: scatter new tokens by slot, per-(block, head) quantisation and back.

Imported lazily by the wrappers in kv.py; shapes are checked there.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._triton_attn import LAUNCH


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    s_kt, s_kh, s_vt, s_vh, s_cb, s_ct, s_ch, s_db, s_dt, s_dh,
    block_size, num_kv_heads, head_dim, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    k = tl.load(key_ptr + t * s_kt + h * s_kh + d, mask=mask)
    v = tl.load(value_ptr + t * s_vt + h * s_vh + d, mask=mask)
    tl.store(k_cache_ptr + blk * s_cb + off * s_ct + h * s_ch + d, k, mask=mask)
    tl.store(v_cache_ptr + blk * s_db + off * s_dt + h * s_dh + d, v, mask=mask)


@triton.jit
def _round_to_e4m3(y):
    # Round to nearest even onto the e4m3 grid in fp32, so the final cast is exact (the
    # Triton interpreter's fp32->fp8 cast drops the carry into the next binade).
    a = tl.abs(y)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(a)) for normal fp32
    e = tl.maximum(e, -6)  # subnormals share the spacing of the lowest normal binade
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e-3): 3 mantissa bits
    inv_step = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)
    z = a * inv_step
    r = tl.floor(z + 0.5)
    r = tl.where((r - z == 0.5) & (r % 2 == 1), r - 1, r)
    return tl.where(y < 0, -r * step, r * step)


@triton.jit
def _quant_kernel(
    x_ptr, q_ptr, scale_ptr, s_xb, s_xt, s_xh, s_qb, s_qt, s_qh, s_sb, s_sh,
    block_size, head_dim, QMAX: tl.constexpr, IS_INT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    t = tl.arange(0, BLOCK_T)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (t < block_size) & (d < head_dim)
    x = tl.load(x_ptr + b * s_xb + t * s_xt + h * s_xh + d, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), 1), 0)
    inv = tl.where(amax > 0, QMAX / tl.where(amax > 0, amax, 1.0), 0.0)
    y = x * inv
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if IS_INT:
        y = tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5))  # round half away from zero
    else:
        y = _round_to_e4m3(y)
    tl.store(q_ptr + b * s_qb + t * s_qt + h * s_qh + d, y.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + b * s_sb + h * s_sh, amax / QMAX)


@triton.jit
def _dequant_kernel(
    q_ptr, scale_ptr, x_ptr, s_qb, s_qt, s_qh, s_xb, s_xt, s_xh, s_sb, s_sh,
    block_size, head_dim, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    t = tl.arange(0, BLOCK_T)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (t < block_size) & (d < head_dim)
    q = tl.load(q_ptr + b * s_qb + t * s_qt + h * s_qh + d, mask=mask).to(tl.float32)
    scale = tl.load(scale_ptr + b * s_sb + h * s_sh)
    tl.store(x_ptr + b * s_xb + t * s_xt + h * s_xh + d, (q * scale).to(x_ptr.dtype.element_ty), mask=mask)


def store_kv(key, value, k_cache, v_cache, slot_mapping):
    num_tokens, num_kv_heads, head_dim = key.shape
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, *key.stride()[:2], *value.stride()[:2],
        *k_cache.stride()[:3], *v_cache.stride()[:3], k_cache.shape[1], num_kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim), **LAUNCH,
    )


def quantize(blocks, q, scales, qmax, is_int):
    num_blocks, block_size, num_kv_heads, head_dim = blocks.shape
    _quant_kernel[(num_blocks, num_kv_heads)](
        blocks, q, scales, *blocks.stride()[:3], *q.stride()[:3], *scales.stride(), block_size, head_dim,
        QMAX=qmax, IS_INT=is_int, BLOCK_T=triton.next_power_of_2(block_size),
        BLOCK_D=triton.next_power_of_2(head_dim), **LAUNCH,
    )


def dequantize(q, scales, out):
    num_blocks, block_size, num_kv_heads, head_dim = q.shape
    _dequant_kernel[(num_blocks, num_kv_heads)](
        q, scales, out, *q.stride()[:3], *out.stride()[:3], *scales.stride(), block_size, head_dim,
        BLOCK_T=triton.next_power_of_2(block_size), BLOCK_D=triton.next_power_of_2(head_dim), **LAUNCH,
    )
