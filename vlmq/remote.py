"""Images where they live: ``https://`` URLs and ``s3://`` objects in other buckets, priced at submit from their
header, fetched by the worker.

``s3://bucket/key`` of a bucket that ``VLMQ_IMAGE_FETCH_ALLOW`` lists (``s3://bucket``) goes the same way through
the storage client (a ranged ``get_object``; ``vlmq.remote_s3``); the pool's own bucket is never read this way.

At submit (:func:`price`) the SDK checks the URL against ``VLMQ_IMAGE_FETCH_ALLOW`` and reads only the first
bytes of the image (``Range: bytes=0-N``, N growing from 64 KiB while the header is cut short; a server that
ignores ``Range`` is read whole, up to ``VLMQ_MAX_IMAGE_BYTES``). What it priced is kept as a *descriptor*
(URL, total size, ETag, the header bytes' length and SHA-256, format, size, orientation, mode): the job's input
key is ``inputs/<sha256 of the descriptor>`` (nothing is uploaded; the same URL with the same bytes gives the
same key, so affinity routes by it), and the record's ``fetches`` field maps that key to the descriptor.

At run time (:func:`fetch`) the worker checks the descriptor against its key and the allow list again (a
forged record gets nothing the operator did not allow), fetches the bytes through the guard
(:mod:`vlmq.fetch`), and fails the job with ``fetch_changed`` unless the size, the header bytes and the probed
layout are the ones priced. The bytes are then decoded and pixel-hashed like an uploaded image's, so the
encoder and prefix caches key them the same way.
"""
from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

from vlmq import keys
from vlmq.errors import InvalidRequest
from vlmq.fetch import FetchError, FetchPolicy, Response, get, shown
from vlmq.images import ImageInfo, ImageLimits, probe, probe_head
from vlmq.remote_s3 import s3_get
from vlmq.settings import Settings
from vlmq.webhook_guard import Resolver, parse_networks

FIRST_BYTES = 64 * 1024  # the first ranged read; grows 8x while the header is cut short
GROWTH = 8


def is_remote(value: object) -> bool:
    """Whether an image argument is an ``http(s)://`` URL (fetched by the worker, priced from its header; plain
    ``http://`` is refused by the fetch with ``fetch_refused``)."""
    return isinstance(value, str) and value[:8].lower().startswith(("https://", "http://"))


def is_s3(value: object) -> bool:
    return isinstance(value, str) and value[:5].lower() == "s3://"


def allowed_hosts(settings: Settings) -> tuple[frozenset[str], tuple[str, ...]]:
    """(exact host names, ``.suffix`` wildcards) from ``VLMQ_IMAGE_FETCH_ALLOW`` (``s3://`` entries left out)."""
    entries = [e.lower().rstrip(".") for e in settings.image_fetch_allow.replace(",", " ").split()]
    names = [e for e in entries if not e.startswith("s3://")]
    return frozenset(n for n in names if not n.startswith("*.")), tuple(n[1:] for n in names if n.startswith("*."))


def host_check(settings: Settings) -> Callable[[str], None]:
    """A ``check_host`` for :class:`vlmq.fetch.FetchPolicy`: refuses names ``VLMQ_IMAGE_FETCH_ALLOW`` lacks."""
    exact, suffixes = allowed_hosts(settings)

    def check(host: str) -> None:
        name = host.lower().rstrip(".")
        if name not in exact and not name.endswith(suffixes or ("\0",)):
            raise FetchError("fetch_refused", f"{host} is not in VLMQ_IMAGE_FETCH_ALLOW; the operator lists the "
                             "hosts images may be fetched from")

    return check


def policy(settings: Settings, resolver: Resolver | None = None) -> FetchPolicy:
    """The fetch policy ``settings`` describe (``resolver``: a stand-in for ``socket.getaddrinfo`` in tests)."""
    from vlmq.delivery import tls_context

    return FetchPolicy(host_check(settings), parse_networks(settings.image_fetch_networks),
                       settings.image_fetch_timeout, settings.image_fetch_redirects, settings.image_fetch_retries,
                       tls=tls_context(settings.image_fetch_ca_file), resolver=resolver or socket.getaddrinfo)


@dataclass(frozen=True, slots=True)
class Descriptor:
    """What the SDK priced of a fetched image; the worker holds the fetched bytes to it."""

    url: str
    size: int  # total bytes
    etag: str  # as the server sent it ("" when none)
    head_len: int  # bytes the price was read from
    head_sha256: str
    format: str
    width: int
    height: int
    orientation: int
    mode: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def info(self) -> ImageInfo:
        return ImageInfo(self.format, self.width, self.height, self.orientation, self.mode, 1)


def _get(url: str, settings: Settings, limits: ImageLimits, resolver: Resolver | None,
         first_bytes: int | None = None) -> Response:
    if is_s3(url):
        return s3_get(url, settings, limits.max_bytes, first_bytes)
    return get(url, policy(settings, resolver), max_bytes=limits.max_bytes, first_bytes=first_bytes)


def _total_size(r: Response) -> int:
    if r.status == 206:
        total = r.headers.get("content-range", "").rpartition("/")[2]
        if total.isdigit():
            return int(total)
        raise FetchError("fetch_failed", f"{shown(r.url)} answered 206 without a total size in Content-Range")
    return len(r.body)


def price(url: str, settings: Settings, limits: ImageLimits, resolver: Resolver | None = None) -> Descriptor:
    """Reads the header of the image at ``url`` (a ranged GET) and returns what it priced.

    Raises:
        InvalidRequest: the codes of :class:`vlmq.fetch.FetchError` (``fetch_refused``, ``fetch_failed``,
            ``fetch_timeout``, ``fetch_too_large``) and of :func:`vlmq.images.probe_head` (``not_an_image``, ...).
    """
    want = FIRST_BYTES
    while True:
        try:
            r = _get(url, settings, limits, resolver, want)
        except FetchError as e:
            raise InvalidRequest(e.message, code=e.code) from None
        total = _total_size(r)
        if total > limits.max_bytes:
            raise InvalidRequest(f"{shown(url)} is {total} bytes, over the limit of {limits.max_bytes} "
                                 "(VLMQ_MAX_IMAGE_BYTES)", code="fetch_too_large")
        whole = len(r.body) >= total
        try:
            info = probe(r.body, limits) if whole else probe_head(r.body, limits)
        except InvalidRequest as e:
            if whole or e.code not in ("truncated_image", "corrupt_image"):
                raise
            want *= GROWTH  # the header runs past what was read
            continue
        return Descriptor(url, total, r.headers.get("etag", ""), len(r.body), hashlib.sha256(r.body).hexdigest(),
                          info.format, info.width, info.height, info.orientation, info.mode)


def descriptors(record: Mapping[str, str]) -> dict[str, Descriptor]:
    """The record's ``fetches`` (input key -> descriptor), each checked against the SHA-256 its key names.

    Raises:
        InvalidRequest: ``bad_record`` for a field that is not such a map.
    """
    text = record.get("fetches")
    if not text:
        return {}
    try:
        raw = json.loads(text)
        found = {key: Descriptor(**json.loads(value)) for key, value in raw.items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise InvalidRequest(f"job record fetches is not a map of descriptors: {e}", code="bad_record") from None
    for key, d in found.items():
        if keys.input_sha256(key) != d.sha256 or not (is_remote(d.url) or is_s3(d.url)):
            raise InvalidRequest(f"job record fetches entry {key[:80]!r} does not match its key", code="bad_record")
    return found


def fetch(d: Descriptor, settings: Settings, limits: ImageLimits, resolver: Resolver | None = None) -> bytes:
    """The worker's fetch: the bytes at ``d.url``, which must be the ones priced.

    Raises:
        FetchError: ``fetch_refused``, ``fetch_failed``, ``fetch_timeout``, ``fetch_too_large``, and
            ``fetch_changed`` when the size, the header bytes or the probed layout differ from ``d``.
    """
    data = _get(d.url, settings, limits, resolver).body
    if len(data) != d.size or hashlib.sha256(data[:d.head_len]).hexdigest() != d.head_sha256:
        raise FetchError("fetch_changed", f"{shown(d.url)} changed since it was priced ({len(data)} bytes now, "
                         f"{d.size} then); submit the job again")
    try:
        info = probe(data, limits)
    except InvalidRequest as e:
        raise FetchError("fetch_changed", f"{shown(d.url)} no longer holds a valid image ({e.code}: {e})") from None
    priced = (d.format, d.width, d.height, d.orientation, d.mode)
    if (info.format, info.width, info.height, info.orientation, info.mode) != priced:
        raise FetchError("fetch_changed", f"{shown(d.url)} is now {info.format} {info.width}x{info.height}, "
                         f"priced as {d.format} {d.width}x{d.height}; submit the job again")
    return data
