"""``vlmq keys create|list|revoke`` as a user runs them, and the key store behind ``vlmq serve``."""
from __future__ import annotations

import json
import subprocess
import sys

from vlmq import apikeys, keys


def vlmq(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vlmq.cli", "keys", *args, "--broker", redis_url],
                          capture_output=True, text=True, timeout=60)


def test_keys_are_created_listed_and_revoked_and_only_their_digest_is_stored(redis_client, redis_url: str) -> None:
    made = vlmq(redis_url, "create", "--tenant", "acme", "--name", "ci", "--json")
    assert made.returncode == 0, made.stderr
    key = json.loads(made.stdout)["key"]
    assert key.startswith("vlmq-") and len(key) >= 45
    stored = redis_client.hgetall(keys.api_keys())
    assert key.encode() not in b"".join(k + v for k, v in stored.items())  # never the key itself
    assert list(stored) == [apikeys.digest(key).encode()]
    assert apikeys.lookup(redis_client, key).tenant == "acme"
    listed = json.loads(vlmq(redis_url, "list", "--json").stdout)
    assert [(r["tenant"], r["name"]) for r in listed] == [("acme", "ci")]
    assert vlmq(redis_url, "revoke", listed[0]["id"]).returncode == 0
    assert apikeys.lookup(redis_client, key) is None
    again = vlmq(redis_url, "revoke", listed[0]["id"])
    assert again.returncode == 1 and "no key" in again.stderr
    redis_client.delete(keys.api_keys())


def test_a_bad_tenant_or_a_missing_one_is_refused_clearly(redis_client, redis_url: str) -> None:
    bad = vlmq(redis_url, "create", "--tenant", "Not/A/Tenant")
    assert bad.returncode == 2 and "tenant id" in bad.stderr
    missing = vlmq(redis_url, "create")
    assert missing.returncode == 2 and "--tenant" in missing.stderr
    assert not redis_client.exists(keys.api_keys())
    assert apikeys.lookup(redis_client, "vlmq-" + "a" * 43) is None and apikeys.lookup(redis_client, "") is None
