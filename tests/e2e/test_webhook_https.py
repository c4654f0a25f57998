"""https webhooks end to end: a real delivery worker process against real TLS receivers on loopback.

Certificates are made here: a private CA that the delivery worker trusts through ``VLMQ_WEBHOOK_CA_FILE``, a
certificate it signed for ``localhost`` (and 127.0.0.1), one it signed for another name, and a self-signed one
for ``localhost``. Receivers listen where ``localhost`` resolves and are called as ``https://localhost:<port>``,
so the worker connects to the pinned, guard-checked address while SNI, ``Host`` and the certificate check use
the name.
"""
from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from receiver import Receiver
from standardwebhooks import Webhook
from test_jobrunner import EchoBackend, png
from test_webhooks import settled, wait_attempts
from workerproc import ready_worker

from vlmq import delivery, webhooks
from vlmq.client import Client
from vlmq.settings import Settings
from vlmq.workers.batcher import Batcher
from vlmq.workers.jobrunner import WorkerContext, run_job

pytestmark = pytest.mark.timeout(120)
SECRET = webhooks.new_secret()
TIMEOUT = 1.0
SCHEDULE = (0.3, 0.6)  # two retries, then failed
DB = 9  # its own database (see test_webhooks.py)
LOCAL = socket.getaddrinfo("localhost", 0, 0, socket.SOCK_STREAM)[0][4][0]  # where the worker will connect


@dataclass(frozen=True)
class Pem:
    cert: Path
    key: Path


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_cert(folder: Path, stem: str, names: list[str], issuer: tuple[x509.Certificate, Any] | None = None,
              ca: bool = False) -> tuple[Pem, x509.Certificate, Any]:
    """A certificate for ``names`` (DNS names or IP addresses), signed by ``issuer`` (else by itself)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    sans: list[x509.GeneralName] = []
    for n in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            sans.append(x509.DNSName(n))
    issuer_cert, issuer_key = issuer or (None, key)
    builder = (x509.CertificateBuilder().subject_name(_name(f"vlmq test {stem}"))
               .issuer_name(issuer_cert.subject if issuer_cert else _name(f"vlmq test {stem}"))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                                        critical=True)
        builder = builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    else:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if issuer_cert is not None:
        ski = issuer_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        builder = builder.add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski),
                                        critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    pem = Pem(folder / f"{stem}.pem", folder / f"{stem}.key")
    pem.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return pem, cert, key


@pytest.fixture(scope="module")
def pems(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Pem]:
    folder = tmp_path_factory.mktemp("tls")
    ca, ca_cert, ca_key = make_cert(folder, "ca", [], ca=True)
    return {"ca": ca, "good": make_cert(folder, "good", ["localhost", "127.0.0.1"], (ca_cert, ca_key))[0],
            "other_name": make_cert(folder, "other", ["receiver.example.com"], (ca_cert, ca_key))[0],
            "self_signed": make_cert(folder, "self", ["localhost", "127.0.0.1"])[0]}


def server_context(pem: Pem, sni: list[str | None]) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pem.cert, pem.key)
    context.sni_callback = lambda _sock, name, _ctx: sni.append(name)  # type: ignore[assignment,misc,return-value]
    return context


@pytest.fixture(scope="module")
def settings(redis_url: str, pems: dict[str, Pem], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """One delivery worker that trusts the private CA; receivers on loopback are allow-listed."""
    url, tmp = f"{redis_url.rsplit('/', 1)[0]}/{DB}", tmp_path_factory.mktemp("https")
    settings = Settings(broker_url=url, storage_url=f"file://{tmp}/store", webhook_allow="127.0.0.1/32 ::1/128",
                        webhook_secrets=SECRET, webhook_ca_file=str(pems["ca"].cert), webhook_poll=0.05,
                        webhook_retry_schedule=",".join(map(str, SCHEDULE)), webhook_timeout=TIMEOUT)
    with ready_worker(url, settings, tmp / "delivery.log", entry=("-m", "vlmq.delivery")):
        yield settings


@pytest.fixture
def tls_receiver(pems: dict[str, Pem]) -> Iterator[Callable[[str], tuple[Receiver, list[str | None]]]]:
    started: list[Receiver] = []

    def start(which: str) -> tuple[Receiver, list[str | None]]:
        sni: list[str | None] = []
        started.append(Receiver(host=LOCAL, tls=server_context(pems[which], sni)))
        return started[-1], sni

    yield start
    for r in started:
        r.stop()


@pytest.fixture
def gpu(settings: Settings) -> Iterator[WorkerContext]:
    """The GPU worker's job adapter in this process, with an echo backend instead of a model."""
    with Client(settings=settings) as client:
        yield WorkerContext(settings, client.redis, client.storage, Batcher(EchoBackend(), 4), "tiny-shapes", "unit")


def https_url(r: Receiver) -> str:
    return f"https://localhost:{r.port}/hook"


def test_a_receiver_with_a_private_ca_gets_a_signed_event_with_sni_and_host(
        settings: Settings, gpu: WorkerContext, tls_receiver: Callable[..., tuple[Receiver, list[str | None]]]) -> None:
    r, sni = tls_receiver("good")
    with Client(settings=settings) as client:
        job = client.submit(png(), "hello", max_new_tokens=3, webhook=https_url(r))
        run_job(gpu, job.id)
        got = r.wait_for(1)[0]
        event = Webhook(SECRET).verify(got.body, got.headers)
        assert event["type"] == "job.finished" and event["data"]["result"] == job.result().raw
        assert got.headers["host"] == f"localhost:{r.port}"  # the URL's name, though the worker dialled an address
        assert sni == ["localhost"] and r.tls_failures == []
        wait_attempts(client.redis, job.id, settled)
        assert [(a["outcome"], a["status_code"]) for a in job.deliveries()] == [("delivered", 200)]


@pytest.mark.parametrize(("which", "why"), [("self_signed", "self-signed certificate"),
                                            ("other_name", "Hostname mismatch")])
def test_an_untrusted_or_misnamed_certificate_is_retried_and_nothing_is_sent(
        settings: Settings, gpu: WorkerContext, tls_receiver: Callable[..., tuple[Receiver, list[str | None]]],
        which: str, why: str) -> None:
    r, sni = tls_receiver(which)
    with Client(settings=settings) as client:
        job = client.submit(png(), "hello", max_new_tokens=3, webhook=https_url(r))
        run_job(gpu, job.id)
        wait_attempts(client.redis, job.id, settled)
        attempts = job.deliveries()
    assert [a["outcome"] for a in attempts] == ["retry"] * len(SCHEDULE) + ["failed"]
    for a in attempts:
        assert a["status_code"] is None and a["error"].startswith("TLS certificate rejected") and why in a["error"]
        assert "VLMQ_WEBHOOK_CA_FILE" in a["error"]
    assert r.requests == []  # never sent without a verified certificate
    deadline = time.monotonic() + 5  # each attempt reached the handshake (the receiver's thread may lag a little)
    while len(r.tls_failures) < len(attempts) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(r.tls_failures) == len(attempts) and set(sni) == {"localhost"}


class TrickleServer:
    """Accepts TLS clients and answers the handshake with a record header, then one byte every 0.2 s for 8 s:
    every read gets data well within the timeout, so only a bound on the whole request ends it."""

    def __init__(self) -> None:
        self.sock = socket.create_server((LOCAL, 0), family=socket.AF_INET6 if ":" in LOCAL else socket.AF_INET)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.hello = threading.Event()  # a client's handshake began (its ClientHello arrived)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(1)
                self.hello.set()
                conn.sendall(b"\x16\x03\x03\x40\x00")  # a 16 KiB handshake record is coming ...
                for _ in range(40):  # ... a byte at a time
                    if self.stop.wait(0.2):
                        return
                    conn.sendall(b"\x00")
            except OSError:
                pass

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def test_a_trickled_tls_handshake_is_cut_at_the_timeout(settings: Settings) -> None:
    server = TrickleServer()
    rds = redis.Redis.from_url(settings.broker_url)
    try:
        webhooks.enqueue_event(rds, "batch.completed", {"id": "batch_trickle"},
                               f"https://localhost:{server.port}/hook")
        first = wait_attempts(rds, "batch_trickle", bool)[0]
    finally:
        server.close()
        rds.close()
    assert first["outcome"] == "retry" and first["error"].startswith("TimeoutError"), first
    assert first["duration_s"] < TIMEOUT + 0.5, first


def test_the_watchdog_cuts_a_tls_handshake_in_progress() -> None:
    """The bound on the whole request covers the handshake too, not only the socket's own timeout."""
    server = TrickleServer()
    conn = delivery._PinnedHTTPS("localhost", server.port, LOCAL, 30.0, delivery.tls_context())
    failed: list[BaseException] = []
    handshake = threading.Thread(target=lambda: failed.append(pytest.raises(OSError, conn.connect).value), daemon=True)
    try:
        handshake.start()
        assert server.hello.wait(5)  # the handshake is under way (the trickle lasts 8 s)
        conn.abort()
        handshake.join(2.0)
        assert not handshake.is_alive() and failed, "abort() left the TLS handshake running"
    finally:
        server.close()
        conn.close()


def test_post_honours_ssl_cert_file_and_checks_an_ip_literal(
        pems: dict[str, Pem], tls_receiver: Callable[..., tuple[Receiver, list[str | None]]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without VLMQ_WEBHOOK_CA_FILE the system trust store decides, and OpenSSL's SSL_CERT_FILE replaces it."""
    r, _ = tls_receiver("good")
    body, allow = json.dumps({"ok": True}).encode(), (ipaddress.ip_network("127.0.0.0/8"),
                                                      ipaddress.ip_network("::1/128"))
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    with pytest.raises(ssl.SSLCertVerificationError):  # the system store does not know the private CA
        delivery.post(https_url(r), {}, body, timeout=5, allow=allow)
    monkeypatch.setenv("SSL_CERT_FILE", str(pems["ca"].cert))
    assert delivery.post(https_url(r), {}, body, timeout=5, allow=allow).status == 200
    if LOCAL == "127.0.0.1":  # an IP literal is checked against the certificate's IP addresses
        assert delivery.post(f"https://127.0.0.1:{r.port}/hook", {}, body, timeout=5, allow=allow).status == 200
    assert [g.headers["host"] for g in r.requests][0] == f"localhost:{r.port}"


def test_a_bad_ca_file_stops_the_delivery_worker_at_start(settings: Settings, tmp_path: Path) -> None:
    bad = tmp_path / "not-a-ca.pem"
    bad.write_text("not a certificate\n")
    env = Settings(broker_url=settings.broker_url, storage_url=settings.storage_url, webhook_secrets=SECRET,
                   webhook_ca_file=str(bad)).to_env()
    run = subprocess.run([sys.executable, "-m", "vlmq.delivery"], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode != 0 and f"VLMQ_WEBHOOK_CA_FILE={str(bad)!r} is not a readable PEM" in run.stderr
