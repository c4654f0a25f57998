"""Cache isolation between tenants through a real worker (the two-tenant pool of test_tenants.py: real Valkey
with the generated ACL users, moto S3, one worker as the worker user).

Tenant bob's job on the same image and prompt as tenant acme's finished job gets no cache hit from it (no
encoder output, no prefix KV, nothing from the tiers or the archive): it is as slow as acme's first, so its
timing tells bob nothing. acme's own second job hits. Counted from the worker's published counters
(``vlmq.keys.worker_stats``, what ``vlmq top`` and ``Client.cache_stats`` read), which the worker updates
before it marks a job finished.
"""
from __future__ import annotations

from typing import Any

import pytest
from test_tenants import Pool, png, pool  # noqa: F401 (the module's two-tenant pool fixture)

from vlmq import keys

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
COUNTERS = ("encoded_images", "encoder_cache_hits", "prefix_cache_hit_tokens", "tier_restored_images",
            "tier_restored_blocks")


def counters(admin: Any) -> dict[str, int]:
    stats = admin.hgetall(keys.worker_stats("tenants-worker"))
    return {name: int(stats[name.encode()]) for name in COUNTERS}


def test_a_tenant_gets_no_cache_hit_from_another_tenants_identical_job(pool: Pool) -> None:  # noqa: F811 (the fixture)
    image, question = png((30, 160, 90), size=224), "How many shapes?"  # a prompt of several KV blocks
    used: dict[str, dict[str, int]] = {}
    for turn, tenant in (("acme", "acme"), ("bob", "bob"), ("acme again", "acme")):
        before = counters(pool.admin)  # nothing else runs on the worker meanwhile
        with pool.client(tenant) as client:
            client.submit(image, question, max_new_tokens=4).result(timeout=300)
        after = counters(pool.admin)
        used[turn] = {name: after[name] - before[name] for name in COUNTERS}
    cold = {"encoded_images": 1, "encoder_cache_hits": 0, "prefix_cache_hit_tokens": 0, "tier_restored_images": 0,
            "tier_restored_blocks": 0}
    assert used["acme"] == used["bob"] == cold  # bob's identical job computed everything afresh
    assert used["acme again"]["encoded_images"] == 0 and used["acme again"]["prefix_cache_hit_tokens"] > 0
