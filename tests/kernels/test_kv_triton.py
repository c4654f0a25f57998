"""KV store and block quantisation: Triton (interpreter on CPU) against the references, round-trip bounds."""
import pytest
import torch
from kernel_testutil import gpu_test

from vlmq.kernels import attention, dequantize_kv_blocks, quantize_kv_blocks, store_kv

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 5])
def test_store_kv_writes_each_token_at_its_slot(impl, cache_dtype, block_size):
    num_blocks, num_kv_heads, head_dim = 4, 2, 64
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(5, num_kv_heads, head_dim, dtype=cache_dtype)
    value = torch.randn(5, num_kv_heads, head_dim, dtype=cache_dtype)
    slots = torch.tensor([0, -1, block_size + 3, 4 * block_size - 1, -7])
    store_kv(key, value, k_cache, v_cache, slots, impl=impl)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // block_size, slot % block_size], key[t])
            assert torch.equal(v_cache[slot // block_size, slot % block_size], value[t])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3  # padding tokens wrote nothing


def test_store_kv_rejects_a_slot_past_the_cache_and_a_dtype_mismatch():
    k_cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError):
        store_kv(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), k_cache, k_cache.clone(), torch.tensor([8]))
    with pytest.raises(ValueError):
        store_kv(torch.zeros(1, 1, 8).half(), torch.zeros(1, 1, 8).half(), k_cache, k_cache.clone(), torch.tensor([1]))


def kv_blocks(num_blocks=3, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32):
    # Heads with very different ranges: per-(block, head) scales must keep the small ones precise.
    x = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    x = x * torch.tensor([0.01, 30.0])[:num_kv_heads].view(1, 1, -1, 1)
    x[1, :, 0] = 0  # an all-zero block head: scale 0, exact round trip
    return x.to(dtype)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int8_round_trip_error_is_at_most_half_a_step(head_dim, dtype):
    x = kv_blocks(head_dim=head_dim, dtype=dtype)
    q, scales = quantize_kv_blocks(x, torch.int8, impl="triton")
    ref_q, ref_scales = quantize_kv_blocks(x, torch.int8, impl="torch")
    assert q.dtype == torch.int8 and scales.shape == (3, 2) and scales.dtype == torch.float32
    assert torch.equal(scales, ref_scales)
    assert int((q.int() - ref_q.int()).abs().max()) <= 1  # identical but for a 1-ulp tie
    back = dequantize_kv_blocks(q, scales, torch.float32, impl="triton")
    torch.testing.assert_close(back, dequantize_kv_blocks(q, scales, torch.float32, impl="torch"), atol=0, rtol=0)
    err = (back - x.float()).abs()
    step = scales[:, None, :, None]
    assert bool((err <= step * 0.5 * (1 + 1e-5)).all())
    assert torch.equal(back[1, :, 0], torch.zeros_like(back[1, :, 0]))
    # Relative to each head's range the error is <= 1/254 (0.39 %).
    assert float((err / x.float().abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-30)).max()) <= 0.5 / 127 + 1e-6


@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp8_round_trip_error_is_relative(head_dim):
    x = kv_blocks(head_dim=head_dim)
    q, scales = quantize_kv_blocks(x, FP8, impl="triton")
    ref_q, ref_scales = quantize_kv_blocks(x, FP8, impl="torch")
    assert q.dtype == FP8
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))  # same rounding (nearest even)
    assert torch.equal(scales, ref_scales)
    back = dequantize_kv_blocks(q, scales, torch.float32, impl="triton")
    step = scales[:, None, :, None]
    # e4m3: 3 mantissa bits -> relative error <= 2^-4; below 2^-6 * scale subnormal spacing 2^-9 * scale.
    assert bool(((back - x).abs() <= torch.maximum(x.abs() * 2.0 ** -4, step * 2.0 ** -10) * (1 + 1e-6)).all())


def test_dequantize_returns_the_requested_dtype_and_rejects_bad_scales():
    q, scales = quantize_kv_blocks(kv_blocks(), torch.int8)
    assert dequantize_kv_blocks(q, scales, torch.bfloat16, impl="triton").dtype == torch.bfloat16
    with pytest.raises(ValueError):
        dequantize_kv_blocks(q, scales[:1], torch.float16)
    with pytest.raises(ValueError):
        quantize_kv_blocks(kv_blocks(), torch.int32)


@gpu_test
@pytest.mark.parametrize("dtype", [torch.int8, FP8])
def test_gpu_quantise_large(dtype):
    x = torch.randn(512, 16, 8, 128, device="cuda", dtype=torch.float16)
    q, scales = quantize_kv_blocks(x, dtype)
    ref_q, ref_scales = quantize_kv_blocks(x, dtype, impl="torch")
    torch.testing.assert_close(scales, ref_scales, atol=0, rtol=1e-6)
    assert int((q.float() - ref_q.float()).abs().gt(0).sum()) <= x.numel() // 1000  # device division: rare ties
    back = dequantize_kv_blocks(q, scales, torch.float32)
    # Half a step: int8 0.5 * scale; e4m3 top binade [256, 448] has steps of 32, so 16 * scale.
    assert float((back - x.float()).abs().max()) <= float(scales.max()) * (0.5 if dtype == torch.int8 else 16) * 1.01


@gpu_test
def test_gpu_store_kv_large():
    k_cache = torch.zeros(1024, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(1024 * 16, device="cuda")[:4096]
    slots[::7] = -1
    store_kv(key, -key, k_cache, v_cache, slots)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    store_kv(key, -key, ref_k, ref_v, slots, impl="torch")
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("dtype,bound", [(torch.int8, 5e-3), (FP8, 3e-2)])
def test_attention_over_round_tripped_kv_stays_close(dtype, bound):
    # What a KV tier costs a decode step: 512 randn tokens, Qwen2-VL-7B heads (28 q / 4 kv, D 128).
    # Measured: int8 ~2e-3, fp8 ~1.2e-2 max |out difference| (outputs are ~0.25 in size).
    k, v = torch.randn(32, 16, 4, 128), torch.randn(32, 16, 4, 128)
    q = torch.randn(1, 28, 128)
    out, lse = attention(q, k.flatten(0, 1), v.flatten(0, 1))
    kq = dequantize_kv_blocks(*quantize_kv_blocks(k, dtype), torch.float32).flatten(0, 1)
    vq = dequantize_kv_blocks(*quantize_kv_blocks(v, dtype), torch.float32).flatten(0, 1)
    out_q, lse_q = attention(q, kq, vq)
    assert float((out_q - out).abs().max()) < bound
    assert float((lse_q - lse).abs().max()) < bound
