"""KV cache sizing from a memory budget: the block arithmetic, and the engine built from a byte budget."""
import shutil
from pathlib import Path

import pytest
import torch

from vlmq.workers.engine.engine import Engine
from vlmq.workers.engine.kv_budget import KVCacheShape, kv_cache_num_blocks, memory_budget, num_blocks_in_budget

TARGET = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny-shapes"
QWEN2_VL_7B = KVCacheShape(num_layers=28, num_kv_heads=4, head_dim=128, dtype_bytes=2)  # bf16


def test_block_bytes_count_k_and_v_in_every_layer():
    assert QWEN2_VL_7B.block_bytes(16) == 2 * 28 * 4 * 128 * 16 * 2 == 917_504
    assert QWEN2_VL_7B.block_bytes(1) * 16 == QWEN2_VL_7B.block_bytes(16)
    assert KVCacheShape(2, 2, 16, 4).block_bytes(4) == 2 * 2 * 2 * 16 * 4 * 4


def test_num_blocks_is_the_floor_of_budget_over_block_bytes():
    block = QWEN2_VL_7B.block_bytes(16)
    assert num_blocks_in_budget(1000 * block, QWEN2_VL_7B, 16, max_model_len=8192) == 1000
    assert num_blocks_in_budget(1001 * block - 1, QWEN2_VL_7B, 16, max_model_len=8192) == 1000
    assert num_blocks_in_budget(8 * 2**30, QWEN2_VL_7B, 16, max_model_len=32768) == 9362  # 8 GiB: 149,792 tokens


def test_budget_must_hold_one_max_length_sequence():
    block = QWEN2_VL_7B.block_bytes(16)
    # 32768 tokens = 2048 blocks exactly; 32769 tokens need a 2049th, partly filled block
    assert num_blocks_in_budget(2048 * block, QWEN2_VL_7B, 16, max_model_len=32768) == 2048
    with pytest.raises(ValueError, match="one 32769-token sequence needs 2049"):
        num_blocks_in_budget(2048 * block, QWEN2_VL_7B, 16, max_model_len=32769)
    with pytest.raises(ValueError, match="holds 0 blocks"):
        num_blocks_in_budget(block - 1, QWEN2_VL_7B, 16, max_model_len=1)
    with pytest.raises(ValueError, match=">= 0"):
        num_blocks_in_budget(-1, QWEN2_VL_7B, 16, max_model_len=1)


def test_memory_fraction_and_shape_validation():
    assert memory_budget(10_000, 0.9) == 9000
    assert memory_budget(10_000, 1.0) == 10_000
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
            memory_budget(10_000, bad)
    with pytest.raises(ValueError, match="head_dim"):
        KVCacheShape(28, 4, 0, 2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # A private copy: the bundled checkpoint may be rewritten while these tests run.
    return Path(shutil.copytree(TARGET, tmp_path_factory.mktemp("m") / "tiny-shapes"))


def test_engine_sized_from_a_byte_budget(model_dir):
    budget = 8 * 2**20
    engine = Engine.from_model_dir(model_dir, kv_cache_bytes=budget, block_size=16)
    model, text = engine.runner.model, engine.runner.model.config.text_config
    block = 2 * text.num_hidden_layers * text.num_key_value_heads * (text.hidden_size // text.num_attention_heads) \
        * 16 * 4  # float32 on CPU
    assert engine.config.num_blocks == engine.scheduler.block_manager.num_blocks == budget // block
    allocated = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in engine.runner.kv_caches)
    assert allocated == engine.config.num_blocks * block <= budget
    engine.close()
    # the tiny model accepts 4096 positions: 256 blocks of 16, 6 MiB in float32
    with pytest.raises(ValueError, match="one 4096-token sequence"):
        kv_cache_num_blocks(model, torch.device("cpu"), 16, kv_cache_bytes=6 * 2**20 - 1)
    assert kv_cache_num_blocks(model, torch.device("cpu"), 16, kv_cache_bytes=6 * 2**20 - 1, max_model_len=1024) > 0
    with pytest.raises(ValueError, match="needs a CUDA device"):
        kv_cache_num_blocks(model, torch.device("cpu"), 16, kv_cache_memory_fraction=0.5)
    with pytest.raises(ValueError, match="num_blocks or a KV cache budget"):
        Engine.from_model_dir(model_dir, kv_cache_bytes=budget, num_blocks=64)
