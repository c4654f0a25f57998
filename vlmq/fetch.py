"""A guarded HTTPS GET for images: the webhook address guard, redirects re-checked, a byte cap and a time cap.

Every hop of a fetch (the URL, then each redirect, at most ``max_redirects``) is checked by the caller's
``check_host`` (the operator's allow list, ``vlmq.remote``) and by the address guard (``vlmq.webhook_guard``):
the host is resolved once, **every** address must pass, and the connection goes to that checked address (no
second lookup to rebind); TLS SNI, ``Host`` and the certificate check use the URL's name. Only ``https://``.

The time cap covers one attempt in all (every hop's connect, handshake and reads): a server that trickles a
byte at a time is cut when it runs out. Bodies are read in chunks and refused once they pass ``max_bytes``.
5xx answers, timeouts and connection errors are retried ``retries`` times with a doubling backoff.

Errors are :class:`FetchError` with ``code`` ``fetch_refused`` (the allow list or the guard said no, or the
URL is malformed), ``fetch_failed`` (an HTTP error, too many redirects, a TLS or connection failure),
``fetch_timeout`` or ``fetch_too_large``.
"""
from __future__ import annotations

import http.client
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

from vlmq.delivery import _PinnedHTTP, _PinnedHTTPS, tls_context
from vlmq.webhook_guard import Network, Refused, Resolver, resolve, split_url

CHUNK = 64 * 1024
REDIRECTS = frozenset({301, 302, 303, 307, 308})


class _FetchHTTPS(_PinnedHTTPS):
    """Keeps its socket for the watchdog: http.client drops ``self.sock`` once a ``Connection: close`` answer's
    headers are read, while the body is still being read from that socket."""

    kept: socket.socket | None = None

    def connect(self) -> None:
        super().connect()
        self.kept = self.sock

    def abort(self) -> None:
        self.aborted = True
        if self.kept is not None:
            try:
                socket.socket.shutdown(self.kept, socket.SHUT_RDWR)
            except OSError:
                pass


class FetchError(Exception):
    """A fetch that did not give a body: ``code`` names why, ``retryable`` whether trying later may help."""

    def __init__(self, code: str, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable


@dataclass(frozen=True, slots=True)
class FetchPolicy:
    """How fetches are bounded and guarded.

    Attributes:
        check_host: raises :class:`FetchError` (``fetch_refused``) for a host name the operator does not allow.
        networks: networks exempt from the address guard (``VLMQ_IMAGE_FETCH_NETWORKS``).
        timeout: seconds one attempt may take in all.
        max_redirects: redirects followed, each hop checked again.
        retries: further attempts after a retryable failure.
        backoff: seconds before the first retry (doubling).
        tls: the context https is verified with (None: the system's trust store).
        resolver: ``socket.getaddrinfo`` or a stand-in (tests).
    """

    check_host: Callable[[str], None]
    networks: tuple[Network, ...] = ()
    timeout: float = 30.0
    max_redirects: int = 3
    retries: int = 2
    backoff: float = 0.5
    tls: ssl.SSLContext | None = None
    resolver: Resolver = field(default=socket.getaddrinfo)


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes
    url: str  # the last hop's URL


def get(url: str, policy: FetchPolicy, *, max_bytes: int, first_bytes: int | None = None) -> Response:
    """GET ``url`` (only its first ``first_bytes`` bytes, by ``Range``, when given), retrying transient failures.

    A server that ignores ``Range`` answers 200 with the whole body, read up to ``max_bytes``.

    Raises:
        FetchError: see the module docstring.
    """
    delay = policy.backoff
    for attempt in range(policy.retries + 1):
        try:
            return _attempt(url, policy, max_bytes, first_bytes)
        except FetchError as e:
            if not e.retryable or attempt == policy.retries:
                raise
        time.sleep(delay)
        delay *= 2
    raise AssertionError("unreachable")


def _attempt(url: str, policy: FetchPolicy, max_bytes: int, first_bytes: int | None) -> Response:
    deadline = time.monotonic() + policy.timeout
    for _ in range(policy.max_redirects + 1):
        response = _hop(url, policy, max_bytes, first_bytes, deadline)
        if response.status not in REDIRECTS:
            return response
        location = response.headers.get("location", "")
        if not location:
            raise FetchError("fetch_failed", f"{shown(url)} answered {response.status} without a Location")
        url = urljoin(url, location)
    raise FetchError("fetch_failed", f"more than {policy.max_redirects} redirects (VLMQ_IMAGE_FETCH_REDIRECTS)")


def _target(url: str, policy: FetchPolicy) -> tuple[str, int, str]:
    """(host, port, address to connect to) of one hop: the allow list and the address guard both pass it."""
    try:
        scheme, host, port = split_url(url)
    except Refused as e:
        raise FetchError("fetch_refused", str(e).replace("a webhook", "an image").replace("webhook", "image")) from None
    if scheme != "https":
        raise FetchError("fetch_refused", f"{shown(url)}: images are fetched over https:// only")
    policy.check_host(host)
    try:
        return host, port, resolve(host, port, policy.networks, policy.resolver)
    except Refused as e:
        raise FetchError("fetch_refused", f"{shown(url)} refused: {e}; internal hosts need "
                         "VLMQ_IMAGE_FETCH_NETWORKS") from None
    except OSError as e:  # the name did not resolve: maybe later
        raise FetchError("fetch_failed", f"cannot resolve {host}: {e}", retryable=True) from None


def _hop(url: str, policy: FetchPolicy, max_bytes: int, first_bytes: int | None, deadline: float) -> Response:
    host, port, ip = _target(url, policy)
    left = deadline - time.monotonic()
    if left <= 0:
        raise FetchError("fetch_timeout", f"{shown(url)}: out of time (VLMQ_IMAGE_FETCH_TIMEOUT)", retryable=True)
    conn = _FetchHTTPS(host, port, ip, left, policy.tls or tls_context())
    watchdog = threading.Timer(left, conn.abort)
    watchdog.daemon = True
    watchdog.start()
    try:
        response = _exchange(conn, url, max_bytes, first_bytes)
        if conn.aborted:  # the watchdog cut the body short
            raise TimeoutError
        return response
    except FetchError:
        if conn.aborted:  # a body cut short by the watchdog reads as a short answer
            raise _timed_out(url, policy) from None
        raise
    except ssl.SSLCertVerificationError as e:
        raise FetchError("fetch_failed", f"{shown(url)}: TLS certificate rejected: {e.verify_message or e}; a "
                         "private CA goes in VLMQ_IMAGE_FETCH_CA_FILE") from None
    except (OSError, http.client.HTTPException) as e:
        if conn.aborted or isinstance(e, TimeoutError):
            raise _timed_out(url, policy) from None
        raise FetchError("fetch_failed", f"{shown(url)}: {type(e).__name__}: {e}", retryable=True) from None
    finally:
        watchdog.cancel()
        conn.close()


def _exchange(conn: _PinnedHTTP, url: str, max_bytes: int, first_bytes: int | None) -> Response:
    parts = urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    headers = {"user-agent": "vlmq-image-fetch", "accept-encoding": "identity"}
    if first_bytes is not None:
        headers["range"] = f"bytes=0-{first_bytes - 1}"
    conn.request("GET", path, headers=headers)
    with conn.getresponse() as response:  # closed however it ends (its file holds the socket open)
        return _answer(response, url, max_bytes)


def _answer(response: http.client.HTTPResponse, url: str, max_bytes: int) -> Response:
    got = {k.lower(): v for k, v in response.getheaders()}
    if response.status in REDIRECTS:
        return Response(response.status, got, b"", url)
    if response.status >= 500:
        raise FetchError("fetch_failed", f"{shown(url)} answered HTTP {response.status}", retryable=True)
    if response.status not in (200, 206):
        raise FetchError("fetch_failed", f"{shown(url)} answered HTTP {response.status}")
    return Response(response.status, got, _read_capped(response, url, max_bytes), url)


def _read_capped(response: http.client.HTTPResponse, url: str, max_bytes: int) -> bytes:
    declared = response.getheader("content-length") or ""
    if response.status == 200 and declared.isdigit() and int(declared) > max_bytes:
        raise FetchError("fetch_too_large", f"{shown(url)} is {declared} bytes, over the limit of {max_bytes} "
                         "(VLMQ_MAX_IMAGE_BYTES)")
    chunks, total = [], 0
    while chunk := response.read1(CHUNK):
        total += len(chunk)
        if total > max_bytes:
            raise FetchError("fetch_too_large", f"{shown(url)} sent more than {max_bytes} bytes "
                             "(VLMQ_MAX_IMAGE_BYTES)")
        chunks.append(chunk)
    body = b"".join(chunks)
    if declared.isdigit() and len(body) != int(declared):
        raise FetchError("fetch_failed", f"{shown(url)}: the answer ended after {len(body)} of {declared} bytes",
                         retryable=True)
    return body


def _timed_out(url: str, policy: FetchPolicy) -> FetchError:
    return FetchError("fetch_timeout", f"{shown(url)}: no complete answer within {policy.timeout:g} s "
                      "(VLMQ_IMAGE_FETCH_TIMEOUT)", retryable=True)


def shown(url: str) -> str:
    """The URL for messages and logs, without its query (a presigned URL's signature stays out of them)."""
    return repr(url.partition("?")[0][:120])
