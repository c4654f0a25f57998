"""Backend choice and argument checks shared by the wrappers.

Wrappers raise ValueError on a bad shape, dtype, device or stride (a caller bug
that must not turn into an out-of-bounds read inside a kernel).
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

Tensor = torch.Tensor
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
IMPLS = ("auto", "triton", "torch")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(impl: str, x: Tensor) -> bool:
    """auto: Triton on a CUDA tensor, the torch reference otherwise; triton/torch force one."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return False
    if impl == "auto":
        return x.is_cuda and triton_available()
    if not triton_available():
        raise ValueError("impl='triton' needs the triton package (pip install triton)")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    return True


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_tensor(name: str, x: Tensor, ndim: int, dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    check(isinstance(x, torch.Tensor), f"{name} must be a torch.Tensor, got {type(x).__name__}")
    check(x.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")
    check(x.dtype in dtypes, f"{name} dtype must be one of {dtypes}, got {x.dtype}")
    check(x.device == device, f"{name} is on {x.device}, expected {device}")


def check_last_contiguous(name: str, x: Tensor) -> None:
    check(x.shape[-1] <= 1 or x.stride(-1) == 1, f"{name} needs a unit stride on its last dim, got {x.stride()}")


def check_shape(name: str, x: Tensor, shape: tuple[int, ...]) -> None:
    check(tuple(x.shape) == tuple(shape), f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def check_paged_cache(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    """q [T, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] of q's dtype, Hkv dividing H."""
    check_tensor("q", q, 3, FLOAT_DTYPES, q.device)
    check_tensor("k_cache", k_cache, 4, (q.dtype,), q.device)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_tensor("v_cache", v_cache, 4, (q.dtype,), q.device)
    check(k_cache.shape[3] == q.shape[2], f"head_dim of k_cache {k_cache.shape[3]} != q's {q.shape[2]}")
    check(k_cache.shape[2] > 0 and q.shape[1] % k_cache.shape[2] == 0,
          f"num_heads {q.shape[1]} must be a multiple of num_kv_heads {k_cache.shape[2]}")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_contiguous(name, x)


def check_block_tables(block_tables: Tensor, context_lens: Tensor, num_seqs: int, device: torch.device) -> None:
    """block_tables [num_seqs, max_blocks] int32/int64 (unit stride on dim 1); context_lens [num_seqs]."""
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES, device)
    check(block_tables.shape[0] == num_seqs, f"block_tables has {block_tables.shape[0]} rows, q has {num_seqs}")
    check_last_contiguous("block_tables", block_tables)
    check_tensor("context_lens", context_lens, 1, INDEX_DTYPES, device)
    check_shape("context_lens", context_lens, (num_seqs,))


def check_lens_fit(lens: Tensor, block_tables: Tensor, block_size: int, name: str) -> None:
    """Host-side only (no device sync on CUDA): 0 <= len <= capacity of the block table."""
    if lens.is_cuda or lens.numel() == 0:
        return
    check(int(lens.min()) >= 0, f"{name} must be >= 0")
    check(int(lens.max()) <= block_tables.shape[1] * block_size,
          f"{name} max {int(lens.max())} exceeds block table capacity {block_tables.shape[1] * block_size}")


def pick_num_splits(num_programs: int, max_kv_len: int, device: torch.device, min_tokens: int = 256) -> int:
    """Flash-decoding split count: enough programs to fill the device, splits of >= min_tokens tokens."""
    if max_kv_len <= min_tokens:
        return 1
    num_sms = 4
    if device.type == "cuda":
        num_sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    want = -(-2 * num_sms // max(1, num_programs))
    return max(1, min(want, -(-max_kv_len // min_tokens), 64))


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
