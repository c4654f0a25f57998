"""Validating wrappers for the paged KV cache: store new tokens, quantise and dequantise blocks.

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim] for K and for V; token
``slot = block_id * block_size + offset``. Quantisation is symmetric, one float32
scale per (block, KV head), for the host / disk / S3 KV tiers.
"""
from __future__ import annotations

import torch

from . import reference
from ._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    Tensor,
    check,
    check_last_contiguous,
    check_shape,
    check_tensor,
    use_triton,
)

QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)
MAX_QUANT_TILE = 1 << 16  # block_size * head_dim elements held by one Triton program


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, *,
             impl: str = "auto") -> None:
    """Scatter new keys and values into the paged cache, in place.

    Parameters
    ----------
    key, value : Tensor
        [num_tokens, num_kv_heads, head_dim], float16 / bfloat16 / float32, unit stride on head_dim.
    k_cache, v_cache : Tensor
        [num_blocks, block_size, num_kv_heads, head_dim], key's dtype (copied bit for bit).
    slot_mapping : Tensor
        [num_tokens], int32 / int64: block_id * block_size + offset; a negative slot skips the token.
    impl : str
        "auto", "triton" or "torch".
    """
    check_tensor("key", key, 3, FLOAT_DTYPES, key.device)
    check_tensor("value", value, 3, (key.dtype,), key.device)
    check_shape("value", value, tuple(key.shape))
    check_tensor("k_cache", k_cache, 4, (key.dtype,), key.device)
    check_tensor("v_cache", v_cache, 4, (k_cache.dtype,), key.device)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check(tuple(k_cache.shape[2:]) == tuple(key.shape[1:]),
          f"cache heads/head_dim {tuple(k_cache.shape[2:])} != key's {tuple(key.shape[1:])}")
    check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES, key.device)
    check_shape("slot_mapping", slot_mapping, (key.shape[0],))
    for name, x in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_contiguous(name, x)
    if not slot_mapping.is_cuda and slot_mapping.numel():
        check(int(slot_mapping.max()) < k_cache.shape[0] * k_cache.shape[1], "slot_mapping points past the cache")
    if not use_triton(impl, key):
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    from . import _triton_kv

    if key.shape[0]:
        _triton_kv.store_kv(key, value, k_cache, v_cache, slot_mapping)


def quantize_kv_blocks(blocks: Tensor, dtype: torch.dtype = torch.int8, *,
                       impl: str = "auto") -> tuple[Tensor, Tensor]:
    """Quantise KV blocks with one scale per (block, KV head): scale = max|x| / QMAX.

    int8 (QMAX 127, round half away from zero) has a round-trip error of at most
    scale / 2 per element; float8_e4m3fn (QMAX 448, round to nearest even) a relative
    error of at most 2**-4, plus 2**-10 * scale near zero (subnormals).

    Parameters
    ----------
    blocks : Tensor
        [num_blocks, block_size, num_kv_heads, head_dim], float16 / bfloat16 / float32,
        for example ``k_cache[block_ids]``.
    dtype : torch.dtype
        torch.int8 or torch.float8_e4m3fn (Triton fp8 needs an sm89+ GPU or the interpreter).
    impl : str
        "auto", "triton" or "torch".

    Returns
    -------
    q : Tensor
        [num_blocks, block_size, num_kv_heads, head_dim], ``dtype``, contiguous.
    scales : Tensor
        [num_blocks, num_kv_heads], float32 (0 for an all-zero block head).
    """
    check_tensor("blocks", blocks, 4, FLOAT_DTYPES, blocks.device)
    check(dtype in QUANT_DTYPES, f"dtype must be one of {QUANT_DTYPES}, got {dtype}")
    check_last_contiguous("blocks", blocks)
    if not use_triton(impl, blocks):
        return reference.quantize_kv_blocks(blocks, dtype)
    from . import _triton_kv

    check(blocks.shape[1] * blocks.shape[3] <= MAX_QUANT_TILE, "block_size * head_dim too large for one program")
    q = torch.empty(blocks.shape, dtype=dtype, device=blocks.device)
    scales = torch.empty(blocks.shape[0], blocks.shape[2], dtype=torch.float32, device=blocks.device)
    if blocks.numel():
        _triton_kv.quantize(blocks, q, scales, reference.QMAX[dtype], dtype == torch.int8)
    return q, scales


def dequantize_kv_blocks(q: Tensor, scales: Tensor, dtype: torch.dtype = torch.float16, *,
                         impl: str = "auto") -> Tensor:
    """Inverse of :func:`quantize_kv_blocks`: x = q * scale.

    Parameters
    ----------
    q : Tensor
        [num_blocks, block_size, num_kv_heads, head_dim], int8 or float8_e4m3fn.
    scales : Tensor
        [num_blocks, num_kv_heads], float32.
    dtype : torch.dtype
        Output dtype: float16, bfloat16 or float32.
    impl : str
        "auto", "triton" or "torch".

    Returns
    -------
    blocks : Tensor
        [num_blocks, block_size, num_kv_heads, head_dim], ``dtype``, contiguous.
    """
    check_tensor("q", q, 4, QUANT_DTYPES, q.device)
    check_tensor("scales", scales, 2, (torch.float32,), q.device)
    check_shape("scales", scales, (q.shape[0], q.shape[2]))
    check(dtype in FLOAT_DTYPES, f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    check_last_contiguous("q", q)
    if not use_triton(impl, q):
        return reference.dequantize_kv_blocks(q, scales, dtype)
    from . import _triton_kv

    check(q.shape[1] * q.shape[3] <= MAX_QUANT_TILE, "block_size * head_dim too large for one program")
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if q.numel():
        _triton_kv.dequantize(q, scales, out)
    return out
