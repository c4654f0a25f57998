"""KV cache sizing: how many blocks fit in a byte budget (`num_blocks_in_budget` is pure arithmetic).

One block holds `block_size` token slots of K and V in every layer:

    block_bytes = 2 (K and V) × num_layers × num_kv_heads × head_dim × block_size × dtype_bytes

so a budget of B bytes holds floor(B / block_bytes) blocks. Qwen2-VL-7B in bf16 (28 layers, 4 KV heads of
128) with 16-token blocks: 917,504 bytes a block, 56 KiB a token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .block_manager import num_blocks_for


@dataclass(frozen=True, slots=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int  # 2 for bf16 / fp16, 4 for float32

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVCacheShape.{name} must be a positive int, got {value!r}")

    @classmethod
    def of_model(cls, model) -> KVCacheShape:
        # what the model's make_kv_caches allocates (ModelRunner's default): every LM layer, the weights' dtype
        return cls(len(model.language_model.layers), model.num_kv_heads, model.head_dim,
                   model.lm_head.weight.element_size())

    def block_bytes(self, block_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * block_size * self.dtype_bytes


def num_blocks_in_budget(budget_bytes: int, shape: KVCacheShape, block_size: int, max_model_len: int) -> int:
    """Blocks of `block_size` tokens that fit in `budget_bytes`; at least one `max_model_len`-token sequence's worth.

    Raises ValueError when not even one sequence of `max_model_len` tokens fits: a cache that small would
    reject the longest requests the model accepts (or, with a tiny budget, every request).
    """
    if budget_bytes < 0:
        raise ValueError(f"the KV cache budget must be >= 0 bytes, got {budget_bytes}")
    if block_size < 1 or max_model_len < 1:
        raise ValueError(f"block_size ({block_size}) and max_model_len ({max_model_len}) must be positive")
    block_bytes = shape.block_bytes(block_size)
    num_blocks = int(budget_bytes) // block_bytes
    need = num_blocks_for(max_model_len, block_size)
    if num_blocks < need:
        raise ValueError(
            f"a KV cache budget of {budget_bytes / 2**20:.1f} MiB holds {num_blocks} blocks of {block_size} tokens "
            f"({block_bytes} bytes each), but one {max_model_len}-token sequence needs {need} "
            f"({need * block_bytes / 2**20:.1f} MiB); raise kv_cache_bytes / kv_cache_memory_fraction or lower "
            f"max_model_len")
    return num_blocks


def memory_budget(free_bytes: int, fraction: float) -> int:
    """`fraction` of the device memory that is free (after the weights are loaded), in bytes."""
    if not 0 < fraction <= 1:  # also rejects NaN
        raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {fraction}")
    return int(free_bytes * fraction)


def kv_cache_num_blocks(model, device: torch.device, block_size: int, kv_cache_bytes: int | None = None,
                        kv_cache_memory_fraction: float | None = None, max_model_len: int | None = None) -> int:
    """KV blocks that fit the budget: `kv_cache_bytes`, or a fraction of the CUDA memory free now."""
    if (kv_cache_bytes is None) == (kv_cache_memory_fraction is None):
        raise ValueError("give exactly one of kv_cache_bytes and kv_cache_memory_fraction")
    if kv_cache_memory_fraction is not None:
        if device.type != "cuda":
            raise ValueError("kv_cache_memory_fraction needs a CUDA device; give kv_cache_bytes on CPU")
        kv_cache_bytes = memory_budget(torch.cuda.mem_get_info(device)[0], kv_cache_memory_fraction)
    shape = KVCacheShape.of_model(model)
    max_len = max_model_len or model.config.text_config.max_position_embeddings
    return num_blocks_in_budget(kv_cache_bytes, shape, block_size, max_len)
