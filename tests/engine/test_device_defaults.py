"""CUDA defaults as pure functions (dtype, block size, prefill path, KV budget after profiling), and the profiling
forward itself, run on CPU with the bundled model."""
from pathlib import Path

import pytest
import torch

from vlmq.workers.engine.config import EngineConfig
from vlmq.workers.engine.cuda_profile import profile_forward, square_grid
from vlmq.workers.engine.device_defaults import (
    default_block_size,
    default_dtype,
    kv_budget_after_profile,
    prefill_path,
)
from vlmq.workers.engine.engine import Engine
from vlmq.workers.models.loader import load_model

TARGET = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny-shapes"


def test_dtype_is_float32_on_cpu_bfloat16_on_cuda_and_an_explicit_one_wins():
    assert default_dtype("cpu") is torch.float32
    assert default_dtype("cuda") is torch.bfloat16
    assert default_dtype("cuda", torch.float32) is torch.float32
    assert default_dtype("cpu", torch.bfloat16) is torch.bfloat16


def test_block_size_serves_flash_paged_prefill_on_cuda_only_where_flash_attn_is_installed():
    assert default_block_size("cpu", flash_attn=True) == 16
    assert default_block_size("cuda", flash_attn=False) == 16
    assert default_block_size("cuda", flash_attn=True) == 256
    assert prefill_path("cuda", True, default_block_size("cuda", True), torch.bfloat16) == "flash_paged"


@pytest.mark.parametrize(("device", "flash", "block", "dtype"), [
    ("cuda", True, 16, torch.bfloat16),  # an explicit small block: flash-attn cannot page it
    ("cuda", True, 512, torch.float32),  # flash-attn has no float32 kernel
    ("cuda", False, 256, torch.bfloat16),  # not installed
    ("cpu", True, 256, torch.bfloat16),
])
def test_any_other_block_size_or_dtype_prefills_through_the_torch_path(device, flash, block, dtype):
    assert prefill_path(device, flash, block, dtype) == "torch"


def test_kv_budget_is_the_fraction_of_free_memory_less_the_profiled_peak():
    gib = 2**30
    assert kv_budget_after_profile(100 * gib, 0.9, 6 * gib) == 84 * gib
    assert kv_budget_after_profile(10, 1.0, 0) == 10
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        kv_budget_after_profile(10 * gib, 0.5, 5 * gib)
    for bad in (0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            kv_budget_after_profile(gib, bad, 0)
    with pytest.raises(ValueError, match=">= 0"):
        kv_budget_after_profile(gib, 0.5, -1)


def test_square_grid_is_the_largest_merge_aligned_square_within_the_patch_budget():
    assert square_grid(16384, 2) == (1, 128, 128)
    assert square_grid(1000, 2) == (1, 30, 30)  # 31² = 961 fits but 31 is odd
    assert square_grid(3, 2) == (1, 2, 2)  # never below one merged token


def test_profiling_forward_runs_the_encoder_and_lm_at_the_step_budget():
    model = load_model(TARGET, "cpu", torch.float32)
    config = EngineConfig(max_num_batched_tokens=64, long_prefill_chunk_size=64, max_num_encoder_patches=256,
                          max_num_seqs=4)
    calls = []
    model.visual.register_forward_hook(lambda m, args, out: calls.append(("vision", args[1].tolist())))
    model.language_model.register_forward_hook(lambda m, args, out: calls.append(("lm", tuple(out.shape))))
    profile_forward(model, config, torch.device("cpu"))
    assert calls == [("vision", [[1, 16, 16]]), ("lm", (64, model.config.text_config.hidden_size))]


def test_cpu_engine_keeps_float32_and_16_token_blocks():
    engine = Engine.from_model_dir(TARGET, num_blocks=64)
    try:
        assert engine.config.block_size == 16
        assert engine.runner.kv_caches[0][0].dtype is torch.float32
    finally:
        engine.close()
