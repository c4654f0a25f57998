"""A profiling forward at the largest step the scheduler can emit, to size the KV cache from what is left.

`profile_forward` runs on any device (a CPU test checks it runs the model); `profiled_kv_bytes` is CUDA only: it
measures the allocator's peak during that forward and applies device_defaults.kv_budget_after_profile.
"""
from __future__ import annotations

import math

import torch

from vlmq.workers.layers.attention import AttentionMetadata

from .config import EngineConfig
from .device_defaults import kv_budget_after_profile


def square_grid(num_patches: int, merge: int) -> tuple[int, int, int]:
    """(t, h, w) of the largest square image of at most num_patches patches, sides a multiple of merge."""
    side = max(merge, math.isqrt(num_patches) // merge * merge)
    return 1, side, side


@torch.inference_mode()
def profile_forward(model, config: EngineConfig, device: torch.device) -> None:
    """One encoder call at the encoder budget (patch-based families) and one LM forward of
    max_num_batched_tokens tokens as one prefill, on a scratch KV cache just big enough."""
    vision = getattr(model.config, "vision_config", None)
    merge = getattr(getattr(model, "visual", None), "merge", None)
    if merge is not None and hasattr(vision, "temporal_patch_size"):  # Qwen-style patches; tiles are skipped
        grid = torch.tensor([square_grid(config.max_num_encoder_patches, merge)], device=device)
        dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        model.encode_images(torch.zeros(int(grid.prod()), dim, device=device), grid)
    num_tokens = config.max_num_batched_tokens
    num_blocks = -(-num_tokens // config.block_size)
    kv_caches = model.make_kv_caches(num_blocks, config.block_size, device=device)
    meta = AttentionMetadata.build([num_tokens], [num_tokens], [list(range(num_blocks))], config.block_size, device)
    embeds = model.language_model.embed_tokens(torch.zeros(num_tokens, dtype=torch.long, device=device))
    positions = model.decode_positions(0, num_tokens, 0).to(device)
    hidden = model.language_model(embeds, positions, meta, kv_caches)
    model.compute_logits(hidden[-config.max_num_seqs:])  # the sampled rows of a full step


def profiled_kv_bytes(model, config: EngineConfig, device: torch.device, fraction: float) -> int:
    """KV bytes on a CUDA device: fraction × free memory after the weights − the profiling forward's peak."""
    assert device.type == "cuda", device
    torch.cuda.synchronize(device)
    free, _ = torch.cuda.mem_get_info(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    profile_forward(model, config, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    return kv_budget_after_profile(free, fraction, peak)
