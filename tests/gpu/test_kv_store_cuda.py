"""The KV tiers' device-to-host path on CUDA: a demoted device tensor is copied into pinned host memory without
the step loop waiting, lands intact, and comes back to the device from the host tier.

Marked `gpu` and skipped without CUDA; scripts/gpu_check.sh runs it.
"""
import pytest
import torch

from vlmq.workers.kvstore.format import Expected
from vlmq.workers.kvstore.store import KVStore, KVStoreConfig, to_host_async

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
MODEL = "m" * 32


def test_a_device_block_lands_pinned_and_equal_in_the_host_tier():
    batch = torch.randn(4, 2, 8, 16, 2, 64, device="cuda", dtype=torch.bfloat16)  # 8 evicted blocks at once
    original = batch.clone()
    store = KVStore(MODEL, KVStoreConfig(host_bytes=1 << 24))
    try:
        for i in range(8):
            store.demote("prefix", f"b{i}", batch[:, :, i])
        batch.zero_()  # the step loop goes on writing the cache: the copies were taken before
        store.flush()
        for i in range(8):
            held = store.host.items[("prefix", f"b{i}")]
            assert held.is_pinned() and held.device.type == "cpu"
            assert torch.equal(held, original[:, :, i].cpu())
        expected = Expected("prefix", "b3", MODEL, (4, 2, 16, 2, 64), torch.bfloat16)
        back = store.fetch("prefix", "b3", expected, False).result(10).to("cuda", non_blocking=True)
        assert torch.equal(back, original[:, :, 3])
    finally:
        store.close()


def test_to_host_async_returns_before_the_copy_is_read():
    t = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    host, landed = to_host_async(t)
    assert landed is not None and host.is_pinned()
    landed()
    assert torch.equal(host, t.cpu())
