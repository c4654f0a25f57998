"""The message gate: every raw message a worker pops is checked before kombu or Celery decodes any of it.

Producers hold Redis write access, so a message may come from another version, a buggy client or an
attacker. Only the envelope vlmq's SDK sends passes: kombu's JSON form with a base64 body, content type
and encoding on an allow list, no compression (unless ``Gate.max_decompressed_bytes`` allows it, checked
with a bounded decompressor), a small body holding ``[[job_id], {}, embed]`` for vlmq's task, and an ETA
no further ahead than ``max_eta_ahead_s`` (a far one would sit in memory and be redelivered every
visibility timeout). A refused message goes to ``vlmq:dead:<queue>`` with its reason and raw bytes
(bounded list, with a TTL) and is acked; it never reaches the consumer loop.
"""
from __future__ import annotations

import base64
import binascii
import bz2
import json
import lzma
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from vlmq import keys, rules
from vlmq.queue import TASK_NAME

MAX_BODY_BYTES = 16 * 1024  # a task body is about 150 bytes
MAX_DECOMPRESSED_BYTES = 0  # 0: compressed messages are refused; > 0 accepts zlib/bz2/lzma bodies up to this size
MAX_ETA_AHEAD_S = 60.0  # vlmq never sends an ETA; a short one (clock skew, countdown) is served, a far one refused
DEAD_LETTER_MAX = 1000  # newest dead letters kept per queue
DEAD_LETTER_TTL = 7 * 24 * 3600  # seconds a queue's dead letters are kept after the last one
DEAD_LETTER_RAW_BYTES = 8192  # raw bytes kept of each dead letter
CONTENT_TYPES = {"application/json": "utf-8", "application/x-msgpack": "binary"}  # Celery's JSON and msgpack
EMBED_KEYS = frozenset({"callbacks", "errbacks", "chain", "chord"})
_DECOMPRESSORS: dict[str, Callable[[], Any]] = {
    "application/x-gzip": zlib.decompressobj, "gzip": zlib.decompressobj, "zlib": zlib.decompressobj,
    "application/x-bz2": bz2.BZ2Decompressor, "bzip2": bz2.BZ2Decompressor,
    "application/x-lzma": lzma.LZMADecompressor, "lzma": lzma.LZMADecompressor, "xz": lzma.LZMADecompressor,
}
# headers Celery's protocol 2 sends; their types (None allowed where Celery sends null)
_OPT_STR = (str, type(None))
_HEADER_TYPES: dict[str, Any] = {
    "lang": str, "task": str, "id": str, "shadow": _OPT_STR, "eta": _OPT_STR, "expires": _OPT_STR,
    "group": _OPT_STR, "group_index": (int, type(None)), "retries": int, "timelimit": list, "root_id": _OPT_STR,
    "parent_id": _OPT_STR, "argsrepr": _OPT_STR, "kwargsrepr": _OPT_STR, "origin": _OPT_STR,
    "ignore_result": (bool, type(None)), "replaced_task_nesting": int, "stamped_headers": (list, type(None)),
    "stamps": dict, "redelivered": bool,
}
_SCALARS = (str, int, float, bool, type(None))
_MAX_STR = 1024


class Refused(Exception):
    """A message the gate will not deliver; ``str()`` is ``"<code>: <detail>"``."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")


@dataclass(slots=True)
class Gate:
    """Checks raw messages of vlmq's queues; see the module docstring."""

    max_body_bytes: int = MAX_BODY_BYTES
    max_decompressed_bytes: int = MAX_DECOMPRESSED_BYTES
    max_eta_ahead_s: float = MAX_ETA_AHEAD_S
    clock: Callable[[], float] = time.time

    def check(self, queue: str, raw: bytes) -> tuple[dict[str, Any] | None, str]:
        """The envelope to hand to kombu, or None and the reason it is refused."""
        try:
            envelope = _envelope(raw)
            _check_properties(envelope["properties"], queue)
            body = self._body(envelope)
            _check_headers(envelope["headers"], self.clock(), self.max_eta_ahead_s)
            _check_task_body(body, envelope["content-type"])
        except Refused as e:
            return None, str(e)
        return envelope, ""

    def _body(self, envelope: dict[str, Any]) -> bytes:
        content_type, encoding = envelope.get("content-type"), envelope.get("content-encoding")
        if content_type not in CONTENT_TYPES or CONTENT_TYPES[content_type] != encoding:
            raise Refused("bad_content_type", f"{content_type!r} / {encoding!r}; accepted: {CONTENT_TYPES}")
        body = envelope.get("body")
        if not isinstance(body, str) or len(body) > self.max_body_bytes * 4 // 3 + 4:
            raise Refused("bad_body", "the body must be a base64 string of at most "
                          f"{self.max_body_bytes} bytes")
        try:
            data = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError) as e:
            raise Refused("bad_body", f"not base64: {e}") from None
        compression = envelope["headers"].get("compression")
        return data if compression is None else self._decompressed(data, compression)

    def _decompressed(self, data: bytes, compression: object) -> bytes:
        if not self.max_decompressed_bytes:
            raise Refused("compressed", f"compression {compression!r} is not accepted (MAX_DECOMPRESSED_BYTES)")
        factory = _DECOMPRESSORS.get(compression) if isinstance(compression, str) else None
        if factory is None:
            raise Refused("compressed", f"compression {compression!r} is not one of {sorted(_DECOMPRESSORS)}")
        try:
            out = factory().decompress(data, self.max_decompressed_bytes + 1)
        except (OSError, EOFError, ValueError, zlib.error, lzma.LZMAError) as e:
            raise Refused("compressed", f"cannot decompress: {e}") from None
        if len(out) > self.max_decompressed_bytes:
            raise Refused("compressed", f"decompresses to more than {self.max_decompressed_bytes} bytes")
        return out

    def dead_letter(self, redis: Any, queue: str, reason: str, raw: bytes) -> None:
        """Keep a refused message (its reason and first raw bytes) in ``vlmq:dead:<queue>``, bounded."""
        entry = json.dumps({"reason": reason, "queue": queue, "at": self.clock(), "size": len(raw),
                            "raw_b64": base64.b64encode(raw[:DEAD_LETTER_RAW_BYTES]).decode()})
        key = keys.dead_letter(queue)
        redis.pipeline().lpush(key, entry).ltrim(key, 0, DEAD_LETTER_MAX - 1).expire(key, DEAD_LETTER_TTL).execute()


def dead_letters(redis: Any, queue: str) -> list[dict[str, Any]]:
    """The dead letters of one queue, newest first, with ``raw`` as bytes."""
    entries = [json.loads(e) for e in redis.lrange(keys.dead_letter(queue), 0, -1)]
    for e in entries:
        e["raw"] = base64.b64decode(e.pop("raw_b64"))
    return entries


def _envelope(raw: bytes) -> dict[str, Any]:
    try:
        envelope = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise Refused("not_json", f"the message is not JSON: {e}") from None
    if not isinstance(envelope, dict):
        raise Refused("not_an_envelope", f"the message is a JSON {type(envelope).__name__}, not kombu's envelope")
    for field, kind in (("properties", dict), ("headers", dict)):
        if not isinstance(envelope.get(field), kind):
            raise Refused("not_an_envelope", f"{field!r} is missing or not an object")
    return envelope


def _text(value: object, what: str, code: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= 200:
        raise Refused(code, f"{what} must be a string of 1 to 200 characters")
    return value


def _check_properties(props: dict[str, Any], queue: str) -> None:
    _text(props.get("delivery_tag"), "delivery_tag", "bad_properties")
    info = props.get("delivery_info")
    if not isinstance(info, dict) or info.get("routing_key") != queue or not isinstance(info.get("exchange"), str):
        raise Refused("wrong_queue", f"delivery_info must name the queue it was popped from ({queue!r})")
    if props.get("body_encoding") != "base64":
        raise Refused("bad_properties", f"body_encoding must be 'base64', got {props.get('body_encoding')!r}")
    priority = props.get("priority")
    if priority is not None and (type(priority) is not int or not 0 <= priority <= 255):
        raise Refused("bad_properties", f"priority must be an integer from 0 to 255, got {priority!r}")
    _check_scalars(props, {"delivery_info"}, "bad_properties")


def _check_scalars(fields: dict[str, Any], skip: set[str], code: str) -> None:
    for name, value in fields.items():
        if name in skip:
            continue
        if not isinstance(value, _SCALARS) or (isinstance(value, str) and len(value) > _MAX_STR):
            raise Refused(code, f"{name!r} must be a short scalar")


def _check_headers(headers: dict[str, Any], now: float, max_eta_ahead_s: float) -> None:
    if headers.get("task") != TASK_NAME or headers.get("lang") != "py":
        raise Refused("wrong_task", f"task {headers.get('task')!r} is not {TASK_NAME!r} (Celery protocol 2)")
    _text(headers.get("id"), "the task id", "bad_headers")
    for name, kind in _HEADER_TYPES.items():
        if name in headers and not isinstance(headers[name], kind):
            raise Refused("bad_headers", f"header {name!r} has type {type(headers[name]).__name__}")
    limits = headers.get("timelimit", [None, None])
    if len(limits) != 2 or any(v is not None and (type(v) not in (int, float) or v < 0) for v in limits):
        raise Refused("bad_headers", f"timelimit must be [soft, hard] seconds or nulls, got {limits!r}")
    if headers.get("stamped_headers") or headers.get("stamps"):
        raise Refused("bad_headers", "vlmq messages carry no stamps")
    _check_scalars(headers, set(_HEADER_TYPES) | {"compression"}, "bad_headers")
    eta, expires = _when(headers, "eta"), _when(headers, "expires")
    if eta is not None and eta > now + max_eta_ahead_s:
        raise Refused("eta_too_far", f"ETA {headers['eta']} is more than {max_eta_ahead_s:g} s ahead")
    if expires is not None and expires <= now:
        raise Refused("expired", f"the message expired at {headers['expires']}")


def _when(headers: dict[str, Any], name: str) -> float | None:
    value = headers.get(name)
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise Refused("bad_headers", f"{name} {value[:40]!r} is not an ISO 8601 time") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()


def _check_task_body(body: bytes, content_type: str) -> None:
    decoded = _decode_body(body, content_type)
    if not isinstance(decoded, list | tuple) or len(decoded) != 3:
        raise Refused("bad_body", "the body must be [args, kwargs, embed] (Celery protocol 2)")
    args, kwargs, embed = decoded
    if not isinstance(args, list | tuple) or len(args) != 1 or not rules.is_job_id(args[0]):
        raise Refused("bad_args", f"args must be [job_id] with a job id as the SDK makes it, got {str(args)[:80]}")
    if kwargs != {}:
        raise Refused("bad_args", f"kwargs must be empty, got {str(kwargs)[:80]}")
    if not isinstance(embed, dict) or not set(embed) <= EMBED_KEYS or any(embed.values()):
        raise Refused("bad_body", "vlmq messages carry no callbacks, errbacks, chain or chord")


def _decode_body(body: bytes, content_type: str) -> Any:
    try:
        if content_type == "application/json":
            return json.loads(body.decode("utf-8"))
        import msgpack

        return msgpack.unpackb(body, raw=False)  # the body is already capped at max_body_bytes
    except (ValueError, RecursionError, TypeError) as e:  # msgpack's errors derive from ValueError
        raise Refused("bad_body", f"the body does not decode as {content_type}: {e}") from None
