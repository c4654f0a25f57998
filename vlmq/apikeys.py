"""API keys of ``vlmq serve``: each names one tenant; only its SHA-256 is stored.

Usage::

    key = apikeys.create(redis, "acme", name="ci")   # shown once: "vlmq-<43 url-safe chars>"
    apikeys.lookup(redis, key)                       # -> ApiKey(id, tenant, name, created_at), or None
    apikeys.revoke(redis, "key_1a2b3c4d5e6f")

A key is 32 random bytes (``secrets``), so an unsalted SHA-256 is as strong as a slow hash: nobody can guess a
preimage, and the server finds a key by its digest in one ``HGET`` (no comparison over candidates, so no timing
leak). The records live in one hash (``keys.api_keys``) with no TTL: a key lives until revoked.
``vlmq keys create|list|revoke`` (``vlmq.clikeys``) is the command-line door.
"""
from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import asdict, dataclass
from typing import Any

from vlmq import keys

KEY_PREFIX = "vlmq-"
MAX_NAME_CHARS = 64


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One key's record (never the key itself).

    Attributes:
        id: ``key_<12 hex>``: the first hex digits of its digest; what ``list`` shows and ``revoke`` takes.
        tenant: the tenant whose files, batches and jobs the key reaches.
        name: a label for people.
        created_at: epoch seconds.
    """

    id: str
    tenant: str
    name: str
    created_at: int


def digest(key: str) -> str:
    """The SHA-256 (hex) of a key: what is stored and looked up."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def create(redis: Any, tenant: str, name: str = "") -> str:
    """A new key for ``tenant``; returns it (the only time it is seen).

    Raises:
        ValueError: a bad tenant id, or a name over ``MAX_NAME_CHARS``.
    """
    keys.check_tenant(tenant)
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"a key's name has at most {MAX_NAME_CHARS} characters")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    hexdigest = digest(key)
    record = ApiKey(f"key_{hexdigest[:12]}", tenant, name, int(time.time()))
    redis.hset(keys.api_keys(), hexdigest, json.dumps(asdict(record)))
    return key


def lookup(redis: Any, key: str) -> ApiKey | None:
    """The record of ``key``, or None for a key never created or revoked."""
    if not key.startswith(KEY_PREFIX) or len(key) > 128:
        return None
    raw = redis.hget(keys.api_keys(), digest(key))
    return ApiKey(**json.loads(raw)) if raw else None


def list_keys(redis: Any, tenant: str | None = None) -> list[ApiKey]:
    """Every key's record (of one tenant, if given), oldest first."""
    records = [ApiKey(**json.loads(v)) for v in redis.hgetall(keys.api_keys()).values()]
    return sorted((r for r in records if tenant is None or r.tenant == tenant), key=lambda r: (r.created_at, r.id))


def revoke(redis: Any, key_id: str) -> bool:
    """Revoke the key with this id (``key_<12 hex>``); False if there is none. Takes effect on the next request."""
    if not key_id.startswith("key_") or len(key_id) != 16:
        return False
    doomed = [h for h in redis.hkeys(keys.api_keys()) if f"key_{h.decode()[:12]}" == key_id]
    return bool(doomed) and bool(redis.hdel(keys.api_keys(), *doomed))
