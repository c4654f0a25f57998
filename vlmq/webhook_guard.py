"""Which webhook targets vlmq may call: only http(s), and never an internal address unless allow-listed.

A webhook URL comes from a producer, and the delivery worker sends a request to it from inside the pool's
network, so an unchecked URL lets any producer reach loopback services, private networks or the cloud
metadata endpoint (server-side request forgery). Two checks, one policy:

- at submit (:func:`check_webhook`): http(s) only, no credentials in the URL, and a literal address (or
  ``localhost``) must not be refused;
- at delivery (:func:`resolve`): the host is resolved and **every** address it resolves to must pass;
  the request then goes to that checked address (no second lookup to rebind), and redirects are never
  followed (``vlmq.delivery``).

Refused: loopback, private (10/8, 172.16/12, 192.168/16, 100.64/10, IPv6 ULA fc00::/7), link-local
(169.254/16, fe80::/10; the metadata address 169.254.169.254 by name), multicast, unspecified and reserved
ranges, and IPv4 addresses written as IPv6 (``::ffff:10.0.0.1``). ``VLMQ_WEBHOOK_ALLOW`` lists networks
exempt from the guard (tests run their receiver on 127.0.0.1 and allow exactly that).
"""
from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from vlmq.errors import InvalidRequest

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[..., list[Any]]  # socket.getaddrinfo's signature
MAX_URL_CHARS = 2048
METADATA = frozenset({ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")})


class Refused(ValueError):
    """A webhook target the guard refuses (its URL, or an address its host resolves to)."""


def parse_networks(raw: str) -> tuple[Network, ...]:
    """Parse ``127.0.0.1/32,::1/128`` (commas or spaces) into networks.

    Raises:
        ValueError: an entry is not a network or address.
    """
    try:
        return tuple(ipaddress.ip_network(part, strict=False) for part in raw.replace(",", " ").split())
    except ValueError as e:
        raise ValueError(f"must list networks such as 127.0.0.1/32: {e}") from None


def refusal(ip: IPAddress, allow: Sequence[Network] = ()) -> str | None:
    """Why the guard refuses ``ip`` (None when it may be called)."""
    if any(ip in net for net in allow if net.version == ip.version):
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return refusal(ip.ipv4_mapped, allow)
    checks = ((ip in METADATA, "the cloud metadata address"), (ip.is_loopback, "a loopback address"),
              (ip.is_link_local, "a link-local address"), (ip.is_multicast, "a multicast address"),
              (ip.is_unspecified, "the unspecified address"), (ip.is_private, "a private address"),
              (not ip.is_global, "not a public address"))
    for hit, why in checks:
        if hit:
            return f"{ip} is {why}"
    return None


def split_url(url: object) -> tuple[str, str, int]:
    """(scheme, host, port) of a webhook URL that is well formed: http(s), a host, no credentials.

    Raises:
        Refused: anything else.
    """
    if not isinstance(url, str) or not url or len(url) > MAX_URL_CHARS:
        raise Refused(f"a webhook must be an http(s) URL of at most {MAX_URL_CHARS} characters")
    if any(c.isspace() or ord(c) < 32 for c in url):
        raise Refused("a webhook URL must not contain spaces or control characters")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise Refused(f"a webhook must be an http:// or https:// URL, got scheme {parts.scheme!r}")
    if not parts.hostname:
        raise Refused("a webhook URL needs a host")
    if parts.username is not None or parts.password is not None:
        raise Refused("a webhook URL must not carry credentials (user:password@); verify the signature instead")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:
        raise Refused(f"bad webhook port: {e}") from None
    return parts.scheme, parts.hostname, port


def _literal(host: str) -> IPAddress | None:
    if host == "localhost" or host.endswith(".localhost"):  # RFC 6761: always loopback
        return ipaddress.ip_address("127.0.0.1")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def check_url(url: object, allow: Sequence[Network] = ()) -> str:
    """The submit-time check: a well-formed http(s) URL whose literal address (if any) is not refused.

    Names are resolved at delivery time, not here (they may change, and submit must stay fast).

    Raises:
        Refused: naming the reason.
    """
    _, host, _ = split_url(url)
    ip = _literal(host)
    why = refusal(ip, allow) if ip is not None else None
    if why:
        raise Refused(f"webhook {url!r} refused: {why}; internal targets need VLMQ_WEBHOOK_ALLOW")
    return str(url)


def check_webhook(url: object, allow_text: str) -> str:
    """:func:`check_url` for ``Client.submit``: raises ``InvalidRequest`` (code ``bad_webhook``)."""
    try:
        return check_url(url, parse_networks(allow_text))
    except Refused as e:
        raise InvalidRequest(str(e), code="bad_webhook") from None


def resolve(host: str, port: int, allow: Sequence[Network] = (),
            resolver: Resolver = socket.getaddrinfo) -> str:
    """The address to connect to for ``host``: every address it resolves to must pass the guard.

    Args:
        host: a name or literal address.
        port: the port (passed to the resolver).
        allow: networks exempt from the guard.
        resolver: ``socket.getaddrinfo`` or a stand-in with its signature (tests).

    Returns:
        The first resolved address, as text; connect to exactly this one.

    Raises:
        Refused: some address is refused (a name resolving to both public and internal addresses is refused
            too: DNS answers can alternate).
        OSError: the name does not resolve (retryable).
    """
    try:
        found: list[IPAddress] = [ipaddress.ip_address(host)]
    except ValueError:  # a name (``localhost`` too: the resolver says where it points)
        found = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in resolver(host, port, 0, socket.SOCK_STREAM)]
    if not found:
        raise OSError(f"{host} resolved to no address")
    for ip in found:
        why = refusal(ip, allow)
        if why:
            raise Refused(f"{host} resolves to {ip}: {why}" if str(ip) != host else why)
    return str(found[0])
