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
(169.254/16, fe80::/10; the metadata address 169.254.169.254 by name), multicast, unspecified, and the
reserved ranges of :data:`RESERVED` (IETF assignments such as 192.0.0.0/24, documentation, benchmarking,
site-local fec0::/10, local-use NAT64 64:ff9b:1::/48, ...), from our own table so the verdict does not
change with the Python version. An IPv6 address that carries an IPv4 one to an IPv4 host (mapped
``::ffff:a.b.c.d``, SIIT ``::ffff:0:a.b.c.d``, NAT64 ``64:ff9b::a.b.c.d``, 6to4 ``2002:AABB:CCDD::``, the
deprecated IPv4-compatible ``::a.b.c.d``) is judged by that IPv4 address: on an IPv6-only cluster with NAT64,
``64:ff9b::a9fe:a9fe`` reaches 169.254.169.254. ``VLMQ_WEBHOOK_ALLOW`` lists networks exempt from the guard
(tests run their receiver on 127.0.0.1 and allow exactly that).
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
# Not globally reachable (IANA special-purpose registries); Python's own is_private/is_global differ by version.
RESERVED: tuple[tuple[Network, str], ...] = tuple((ipaddress.ip_network(net), why) for net, why in (
    ("0.0.0.0/8", "'this network'"), ("192.0.0.0/24", "an IETF protocol assignment"),
    ("192.0.2.0/24", "a documentation address"), ("198.51.100.0/24", "a documentation address"),
    ("203.0.113.0/24", "a documentation address"), ("192.88.99.0/24", "the deprecated 6to4 relay anycast"),
    ("198.18.0.0/15", "a benchmarking address"), ("240.0.0.0/4", "a reserved address"),
    ("::/96", "a deprecated IPv4-compatible address"), ("64:ff9b:1::/48", "a local-use NAT64 address"),
    ("100::/64", "a discard-only address"), ("2001::/23", "an IETF protocol assignment"),
    ("2001:db8::/32", "a documentation address"), ("3fff::/20", "a documentation address"),
    ("5f00::/16", "an SRv6 segment identifier"), ("fec0::/10", "a deprecated site-local address"),
))
NAT64 = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052 well-known prefix: the last 32 bits are the IPv4 host
SIIT = ipaddress.ip_network("::ffff:0:0:0/96")  # RFC 2765 IPv4-translated
COMPATIBLE = ipaddress.ip_network("::/96")  # RFC 4291, deprecated; :: and ::1 are judged as themselves


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


def embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form delivers to (mapped, SIIT, NAT64, 6to4, IPv4-compatible), or None."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in NAT64 or ip in SIIT or (ip in COMPATIBLE and not (ip.is_loopback or ip.is_unspecified)):
        return ipaddress.IPv4Address(int(ip) & 0xFFFF_FFFF)
    return None


def refusal(ip: IPAddress, allow: Sequence[Network] = ()) -> str | None:
    """Why the guard refuses ``ip`` (None when it may be called)."""
    if any(ip in net for net in allow if net.version == ip.version):
        return None
    inner = embedded_ipv4(ip) if isinstance(ip, ipaddress.IPv6Address) else None
    if inner is not None:
        why = refusal(inner, allow)
        if why:
            return f"{ip} carries an IPv4 address: {why}"
        if ip not in COMPATIBLE:  # a public IPv4 host reached through NAT64, 6to4 or a mapping
            return None
    checks = ((ip in METADATA, "the cloud metadata address"), (ip.is_loopback, "a loopback address"),
              (ip.is_link_local, "a link-local address"), (ip.is_multicast, "a multicast address"),
              (ip.is_unspecified, "the unspecified address"))
    for hit, why in checks:
        if hit:
            return f"{ip} is {why}"
    for net, why in RESERVED:
        if ip in net:
            return f"{ip} is {why} ({net})"
    if ip.is_private:
        return f"{ip} is a private address"
    return None if ip.is_global else f"{ip} is not a public address"


def split_url(url: object) -> tuple[str, str, int]:
    """(scheme, host, port) of a webhook URL that is well formed: http(s), a host, no credentials.

    Raises:
        Refused: anything else.
    """
    if not isinstance(url, str) or not url or len(url) > MAX_URL_CHARS:
        raise Refused(f"a webhook must be an http(s) URL of at most {MAX_URL_CHARS} characters")
    if any(c.isspace() or ord(c) < 32 for c in url):
        raise Refused("a webhook URL must not contain spaces or control characters")
    if not url.isascii() and any(0xD800 <= ord(c) <= 0xDFFF for c in url):
        raise Refused("a webhook URL must be valid Unicode text (it holds a lone surrogate such as \\ud800)")
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
