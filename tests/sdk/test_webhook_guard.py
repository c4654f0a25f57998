"""The webhook address guard: what submit refuses, and what a name must resolve to at delivery time."""
from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
from typing import Any

import pytest

from vlmq.errors import InvalidRequest
from vlmq.settings import Settings
from vlmq.webhook_guard import Refused, check_url, check_webhook, parse_networks, resolve
from vlmq.webhooks import parse_secrets

LOOPBACK_ONLY = parse_networks("127.0.0.1/32")


@pytest.mark.parametrize(("url", "why"), [
    ("http://127.0.0.1:8080/hook", "loopback"),
    ("http://127.1.2.3/", "loopback"),
    ("https://localhost/hook", "loopback"),
    ("http://10.1.2.3/", "private"),
    ("http://172.16.0.9/", "private"),
    ("http://192.168.1.1/", "private"),
    ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
    ("http://169.254.10.1/", "link-local"),
    ("http://[::1]:9000/", "loopback"),
    ("http://[fd12:3456::1]/", "private"),
    ("http://[fe80::1]/", "link-local"),
    ("http://[::ffff:10.0.0.1]/", "private"),
    ("http://[::ffff:127.0.0.1]/", "loopback"),  # an IPv4 address written as IPv6 is judged as the IPv4 one
    ("http://224.0.0.1/", "multicast"),
    ("http://0.0.0.0/", "unspecified"),
    ("http://100.64.0.1/", "not a public address"),
])
def test_submit_refuses_internal_literal_addresses(url: str, why: str) -> None:
    with pytest.raises(InvalidRequest, match=why) as info:
        check_webhook(url, "")
    assert info.value.code == "bad_webhook"


@pytest.mark.parametrize(("url", "why"), [
    ("ftp://example.com/x", "http:// or https://"),
    ("file:///etc/passwd", "http:// or https://"),
    ("example.com/hook", "http:// or https://"),
    ("https://", "needs a host"),
    ("https://user:pw@example.com/", "credentials"),
    ("https://example.com/a b", "spaces"),
    ("https://example.com:99999/", "port"),
    ("https://example.com/" + "a" * 3000, "at most"),
])
def test_submit_refuses_malformed_urls(url: str, why: str) -> None:
    with pytest.raises(InvalidRequest, match=why):
        check_webhook(url, "")


def test_public_addresses_and_allow_listed_networks_pass() -> None:
    assert check_url("https://hooks.example.com/vlmq?x=1") == "https://hooks.example.com/vlmq?x=1"
    assert check_url("http://93.184.216.34/") == "http://93.184.216.34/"
    assert check_url("http://127.0.0.1:8080/", LOOPBACK_ONLY)
    with pytest.raises(Refused, match="loopback"):  # the allow-list is exact: 127.0.0.2 is still refused
        check_url("http://127.0.0.2:8080/", LOOPBACK_ONLY)
    assert check_webhook("http://[::1]/", "::1/128")


def fake_dns(table: dict[str, list[str]]) -> Any:
    """A resolver with getaddrinfo's signature over a fixed table (no hosts file, no network)."""
    def getaddrinfo(host: str, port: int, *_: object) -> list[Any]:
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))
                for ip in table[host]]
    return getaddrinfo


DNS = fake_dns({"internal.example": ["10.9.8.7"], "meta.example": ["169.254.169.254"], "six.example": ["::1"],
                "rebind.example": ["93.184.216.34", "127.0.0.1"], "public.example": ["93.184.216.34"]})


@pytest.mark.parametrize(("host", "why"), [
    ("internal.example", "10.9.8.7 is a private address"),
    ("meta.example", "cloud metadata"),
    ("six.example", "::1 is a loopback address"),
    ("rebind.example", "127.0.0.1 is a loopback address"),  # one internal answer among public ones is enough
])
def test_delivery_refuses_names_resolving_to_internal_addresses(host: str, why: str) -> None:
    with pytest.raises(Refused, match=why):
        resolve(host, 443, (), DNS)


def test_delivery_connects_to_the_checked_address() -> None:
    assert resolve("public.example", 443, (), DNS) == "93.184.216.34"
    assert resolve("rebind.example", 443, parse_networks("127.0.0.1/32"), DNS) == "93.184.216.34"
    with pytest.raises(OSError):  # a name that does not resolve is an ordinary (retryable) failure
        resolve("nowhere.example", 443, (), DNS)


# Issue 36 item 9: IPv6 forms that deliver to an IPv4 host are judged by that host, and reserved ranges are
# refused by our own table (Python's is_global differs by version: 192.0.0.8 passes on 3.11).
EMBEDDED_AND_RESERVED = [
    ("64:ff9b::a9fe:a9fe", "169.254.169.254 is the cloud metadata address"),  # NAT64 of the metadata address
    ("64:ff9b::a00:1", "10.0.0.1 is a private address"),  # NAT64 of a private address
    ("64:ff9b:1::a9fe:a9fe", "local-use NAT64"),  # RFC 8215: the operator's own translator
    ("64:ff9b:1:ffff::1", "local-use NAT64"),
    ("2002:7f00:1::1", "127.0.0.1 is a loopback address"),  # 6to4
    ("2002:a9fe:a9fe::", "cloud metadata"),
    ("::127.0.0.1", "127.0.0.1 is a loopback address"),  # IPv4-compatible
    ("::ffff:0:7f00:1", "127.0.0.1 is a loopback address"),  # SIIT (IPv4-translated)
    ("::ffff:0:a9fe:a9fe", "cloud metadata"),
    ("fec0::1", "site-local"),
    ("192.0.0.8", "IETF protocol assignment"),
    ("192.0.2.1", "documentation"),
    ("198.18.0.1", "benchmarking"),
    ("2001:db8::1", "documentation"),
    ("3fff::1", "documentation"),
    ("5f00::1", "SRv6"),
    ("::5db8:d822", "deprecated IPv4-compatible"),  # even for a public IPv4: no host has such an address
]


@pytest.mark.parametrize(("address", "why"), EMBEDDED_AND_RESERVED)
def test_submit_refuses_ipv6_forms_of_internal_ipv4_and_reserved_ranges(address: str, why: str) -> None:
    host = f"[{address}]" if ":" in address else address
    with pytest.raises(InvalidRequest, match=why) as info:
        check_webhook(f"http://{host}/hook", "")
    assert info.value.code == "bad_webhook"


@pytest.mark.parametrize(("address", "why"), EMBEDDED_AND_RESERVED)
def test_delivery_refuses_names_resolving_to_ipv6_forms_of_internal_ipv4(address: str, why: str) -> None:
    with pytest.raises(Refused, match=why):
        resolve("hooks.example", 443, (), fake_dns({"hooks.example": ["93.184.216.34", address]}))


@pytest.mark.parametrize("address", ["64:ff9b::5db8:d822", "2002:5db8:d822::1", "::ffff:0:5db8:d822",
                                     "::ffff:93.184.216.34", "2606:4700::1111"])
def test_a_public_ipv4_host_reached_through_nat64_or_6to4_still_passes(address: str) -> None:
    assert check_url(f"http://[{address}]/hook")
    resolved = resolve("six.example", 443, (), fake_dns({"six.example": [address]}))
    assert ipaddress.ip_address(resolved) == ipaddress.ip_address(address)


def test_localhost_through_the_real_resolver_is_refused_without_the_allow_list() -> None:
    with pytest.raises(Refused, match="loopback"):
        resolve("localhost", 80)
    assert resolve("localhost", 80, parse_networks("127.0.0.0/8 ::1/128")) in ("127.0.0.1", "::1")


def test_webhook_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="VLMQ_WEBHOOK_ALLOW"):
        Settings(webhook_allow="not-a-network")
    with pytest.raises(ValueError, match="VLMQ_WEBHOOK_RETRY_SCHEDULE"):
        Settings(webhook_retry_schedule="5,soon")
    with pytest.raises(ValueError, match="positive"):
        Settings(webhook_timeout=0)
    assert Settings.from_env({"VLMQ_WEBHOOK_TIMEOUT": "0.5"}).webhook_timeout == 0.5
    with pytest.raises(ValueError, match="whsec_"):
        parse_secrets("whsec_short")
    assert len(parse_secrets("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw whsec_dGVzdHNlY3JldHRlc3RzZWNyZXQ=")) == 2


def test_the_delivery_worker_will_not_start_without_a_secret() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLMQ_")}
    run = subprocess.run([sys.executable, "-m", "vlmq.cli", "delivery"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode != 0 and "VLMQ_WEBHOOK_SECRETS" in run.stderr
