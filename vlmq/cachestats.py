"""Fleet cache accounting: what the pool's caches hold and how often they hit (``Client.cache_stats``, ``vlmq cache``).

Two sources: the archive in the pool's storage (``kv/<model-hash>/...``, listed; the hash is named by the
``vlmq.keys.kv_models`` hash workers write) and the counters every live worker publishes in its heartbeat hash
(``vlmq.keys.worker_stats``, gone when the worker stops renewing it, so totals cover live workers only).
Hit rates come from counter pairs: ``<tier>_hits`` / ``<tier>_misses`` and ``<tier>_hit_tokens`` /
``<tier>_query_tokens``.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

from vlmq import keys
from vlmq.fleet import read_hashes
from vlmq.storage import Storage

_TEXT_FIELDS = ("model", "classes", "own_queue_classes", "at")  # the rest of a heartbeat hash are integer counters


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def worker_stats(redis: Any) -> dict[str, dict[str, Any]]:
    """The heartbeat hash of every live worker: slug -> fields (counters as ints)."""
    return {slug: {k: _field(k, v) for k, v in fields.items()}
            for slug, fields in read_hashes(redis, keys.WORKER_STATS).items()}


def _field(name: str, value: str) -> Any:
    if name in _TEXT_FIELDS:
        return value
    try:
        return int(value)
    except ValueError:
        return value


def hit_rates(counters: dict[str, Any]) -> dict[str, float | None]:
    """``<tier>`` -> hit rate from its counter pairs (None before the first lookup)."""
    rates: dict[str, float | None] = {}
    pairs = (("_hits", "_misses", False), ("_hit_tokens", "_query_tokens", True))
    for name, value in counters.items():
        for hit, other, is_total in pairs:
            if name.endswith(hit) and isinstance(value, int):
                tier = name.removesuffix(hit)
                rest = counters.get(tier + other, 0)
                total = rest if is_total else value + rest
                rates[tier] = value / total if total else None
    return rates


def archive_stats(storage: Storage, model_names: dict[str, str]) -> dict[str, dict[str, Any]]:
    """model-hash -> objects, bytes and (when a worker named it) the model name, from listing ``kv/``."""
    out: dict[str, dict[str, Any]] = {}
    for obj in storage.list_objects(keys.KV_ROOT):
        model_hash = obj.key.removeprefix(keys.KV_ROOT).split("/", 1)[0]
        entry = out.setdefault(model_hash, {"model": model_names.get(model_hash), "objects": 0, "bytes": 0})
        entry["objects"] += 1
        entry["bytes"] += obj.size
    return out


def kv_model_names(redis: Any) -> dict[str, str]:
    """model-hash -> model name, as workers registered them."""
    return {_text(k): _text(v) for k, v in redis.hgetall(keys.kv_models()).items()}


def cache_stats(redis: Any, storage: Storage) -> dict[str, Any]:
    """The fleet's caches: per-model archive objects/bytes, per-model counter totals and hit rates, per worker."""
    workers = worker_stats(redis)
    totals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for fields in workers.values():
        model_totals = totals[fields.get("model", "?")]
        model_totals["workers"] += 1
        for name, value in fields.items():
            if isinstance(value, int) and name not in ("encoder_cache_bytes", "encoder_bytes_per_token"):
                model_totals[name] += value
    return {
        "archive": archive_stats(storage, kv_model_names(redis)),
        "models": {model: {"counters": dict(c), "hit_rates": hit_rates(c)} for model, c in totals.items()},
        "workers": workers,
    }


def model_hashes(redis: Any, model: str) -> list[str]:
    """The archive hashes of a model: those workers registered under its name, or ``model`` itself if a hash."""
    named = [h for h, name in kv_model_names(redis).items() if name == model]
    return named or [model]


def purge(redis: Any, storage: Storage, model: str) -> tuple[int, int]:
    """Delete a model's archive (every object under ``kv/<model-hash>/``); returns (objects, bytes) deleted.

    ``model`` is a model name workers registered, or a model hash as ``cache_stats`` shows it.
    """
    objects = size = 0
    for model_hash in model_hashes(redis, model):
        if "/" in model_hash or not model_hash:
            raise ValueError(f"not a model name or hash: {model!r}")
        for obj in list(storage.list_objects(keys.kv_prefix(model_hash))):
            storage.delete(obj.key)
            objects, size = objects + 1, size + obj.size
    return objects, size
