"""KV tiers below the engine's caches: host memory, local disk and the pool's object store (the KV archive)."""
from __future__ import annotations

import logging
from pathlib import Path

from vlmq.settings import Settings
from vlmq.storage import Storage

from .identity import weights_identity
from .store import KVStore, KVStoreConfig

__all__ = ["KVStore", "KVStoreConfig", "store_from_settings", "weights_identity"]
log = logging.getLogger(__name__)


def store_from_settings(settings: Settings, model: str, model_dir: str | Path, storage: Storage | None) -> KVStore:
    """The worker's KV store: archiving in `storage` unless VLMQ_KV_ARCHIVE=0 (on by default), signed with
    VLMQ_KV_ARCHIVE_KEY; without a key there is no archive (said once in the log)."""
    config = KVStoreConfig(host_bytes=settings.kv_host_bytes, disk_dir=settings.kv_disk_dir or None,
                           disk_bytes=settings.kv_disk_bytes, archive_bytes=settings.kv_archive_bytes,
                           quant=settings.kv_quant(model), archive_key=settings.kv_archive_key.encode())
    if storage is not None and settings.kv_archive and not settings.kv_archive_key:
        log.warning("KV archive off: set VLMQ_KV_ARCHIVE_KEY (one secret shared by every worker, never by "
                    "producers) to share KV through %s", storage.url)
    archive = storage if settings.kv_archive and settings.kv_archive_key else None
    return KVStore(weights_identity(model_dir), config, archive)
