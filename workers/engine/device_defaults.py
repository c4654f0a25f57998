"""Defaults that depend on the device, as pure functions: weights/KV dtype, KV block size, the KV budget.

- dtype: float32 on CPU (exact parity with transformers in tests), bfloat16 on CUDA; an explicit dtype wins.
- block size: flash-attn's paged varlen kernel (prefill and mixed steps) reads pages of a multiple of 256 tokens,
  so on CUDA with flash-attn installed the default block is 256. Our Triton decode and cascade kernels take any
  block size. Any other block size still works on CUDA: steps with a prefill then run the torch path
  (`paged_torch`, padded SDPA over gathered blocks), slower but exact. On CPU the default stays 16 (finer prefix
  caching; the CPU gather is cheaper for small blocks).
- KV budget (CUDA): `fraction` of the memory free once the weights are loaded, less the activation peak of a
  profiling forward at the largest step the scheduler can emit (cuda_profile.py measures it):

      kv_bytes = fraction × free_after_weights − profile_peak_bytes
"""
from __future__ import annotations

import importlib.util

import torch

FLASH_PAGE_MULTIPLE = 256  # flash-attn's paged KV wants block_size % 256 == 0
CPU_BLOCK_SIZE = 16


def default_dtype(device_type: str, dtype: torch.dtype | None = None) -> torch.dtype:
    """Weights and KV dtype: the explicit one, else float32 on CPU and bfloat16 on an accelerator."""
    if dtype is not None:
        return dtype
    return torch.float32 if device_type == "cpu" else torch.bfloat16


def flash_attn_installed() -> bool:
    # find_spec does not import flash_attn (a CUDA extension): safe on CPU machines
    return importlib.util.find_spec("flash_attn") is not None


def default_block_size(device_type: str, flash_attn: bool) -> int:
    """KV block size when none is given: 256 where flash-attn's paged prefill can run (CUDA with flash-attn)."""
    return FLASH_PAGE_MULTIPLE if device_type == "cuda" and flash_attn else CPU_BLOCK_SIZE


def prefill_path(device_type: str, flash_attn: bool, block_size: int, dtype: torch.dtype) -> str:
    """Which kernel runs steps with a prefill chunk: "flash_paged" or "torch" (any block size, exact)."""
    if (device_type == "cuda" and flash_attn and block_size % FLASH_PAGE_MULTIPLE == 0
            and dtype in (torch.float16, torch.bfloat16)):
        return "flash_paged"
    return "torch"


def kv_budget_after_profile(free_after_weights: int, fraction: float, profile_peak_bytes: int) -> int:
    """Bytes for the KV cache: `fraction` of the memory free after the weights, less the profiled activation peak.

    Raises ValueError when nothing is left (the activations of the largest step would not fit next to any KV).
    """
    if not 0 < fraction <= 1:  # also rejects NaN
        raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {fraction}")
    if free_after_weights < 0 or profile_peak_bytes < 0:
        raise ValueError("free memory and the profiled peak must be >= 0 bytes")
    budget = int(free_after_weights * fraction) - int(profile_peak_bytes)
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {fraction} x {free_after_weights / 2**30:.2f} GiB free after the "
            f"weights, less {profile_peak_bytes / 2**30:.2f} GiB of activations at the largest step; raise "
            f"kv_cache_memory_fraction or lower max_num_batched_tokens / max_num_encoder_patches")
    return budget
