"""Who is calling: a bearer key's tenant (``vlmq.apikeys``), and that tenant's ``vlmq.Client``.

Usage: ``door = Door(settings); client = door.client_for(bearer(request))`` (or ``door.client_of(tenant)``).

The clients are connection pools, one per tenant seen, not state: any replica builds the same ones.
"""
from __future__ import annotations

import threading
from typing import Any

import redis as redis_lib
from starlette.requests import Request

from vlmq import apikeys
from vlmq.client import Client
from vlmq.serve.errors import ApiError
from vlmq.settings import Settings


def bearer(request: Request) -> str:
    """The key of ``Authorization: Bearer <key>``.

    Raises:
        ApiError: 401 without one.
    """
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(401, "no API key: send Authorization: Bearer <key> (vlmq keys create --tenant ID)",
                       code="missing_api_key")
    return key.strip()


class Door:
    """Keys to tenants to clients, for one process.

    Args:
        settings: the pool's settings (every tenant's client gets them, with its ``tenant``).
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.redis = redis_lib.Redis.from_url(settings.broker_url, socket_connect_timeout=3, socket_timeout=10)
        self._clients: dict[str, Client] = {}
        self._lock = threading.Lock()

    def tenant(self, key: str) -> str:
        """The tenant of a key.

        Raises:
            ApiError: 401 for a key that was never created or was revoked.
        """
        record = apikeys.lookup(self.redis, key)
        if record is None:
            raise ApiError(401, "invalid API key (never created, or revoked)", code="invalid_api_key")
        return record.tenant

    def client_for(self, key: str) -> Client:
        """The client of a key's tenant (built once per tenant)."""
        return self.client_of(self.tenant(key))

    def client_of(self, tenant: str) -> Client:
        """A tenant's client (built once per tenant)."""
        with self._lock:
            if tenant not in self._clients:
                self._clients[tenant] = Client(settings=self.settings, tenant=tenant)
            return self._clients[tenant]

    def ready(self) -> dict[str, Any]:
        """Whether Redis and the object store answer (``/readyz``)."""
        self.redis.ping()
        from vlmq.storage import open_storage

        store = open_storage(self.settings.storage_url, self.settings.s3_endpoint_url, timeout=5)
        store.exists("readyz")
        return {"redis": "ok", "storage": "ok"}

    def close(self) -> None:
        """Release every connection."""
        for client in self._clients.values():
            client.close()
        self.redis.close()
