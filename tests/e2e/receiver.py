"""A real webhook receiver for tests: ``http.server`` in a thread on a loopback address.

It records every request (headers, body, arrival time) and answers from a script of ``Answer``s, one per
request in order, then with ``default``. Only loopback traffic. With ``tls`` (a server-side SSL context) it
serves https and records failed handshakes in ``tls_failures``.
"""
from __future__ import annotations

import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Answer:
    status: int = 200
    sleep: float = 0.0  # seconds to wait before answering (a slow receiver, or one that times out)
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Received:
    headers: dict[str, str]
    body: bytes
    at: float  # time.monotonic() on arrival


class _IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class Receiver:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, script: list[Answer] | None = None,
                 default: Answer | None = None, tls: ssl.SSLContext | None = None) -> None:
        self.script = list(script or [])
        self.default = default or Answer()
        self.requests: list[Received] = []
        self.tls_failures: list[str] = []
        self._cond = threading.Condition()
        server_class = _IPv6Server if ":" in host else ThreadingHTTPServer
        self._server = server_class((host, port), self._handler())
        self._server.daemon_threads = True
        self.scheme = "https" if tls else "http"
        if tls:  # each handshake runs in its request's thread: a stalled client holds up no other
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True,
                                                  do_handshake_on_connect=False)
        self.host, self.port = host, self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}/hook"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def handle(self) -> None:
                if isinstance(self.request, ssl.SSLSocket):
                    try:
                        self.request.settimeout(10)
                        self.request.do_handshake()
                    except OSError as e:  # ssl.SSLError included: the client refused our certificate
                        with receiver._cond:
                            receiver.tls_failures.append(str(e))
                            receiver._cond.notify_all()
                        return
                super().handle()

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                answer = receiver._take(Received({k.lower(): v for k, v in self.headers.items()}, body,
                                                 time.monotonic()))
                time.sleep(answer.sleep)
                try:
                    self.send_response(answer.status)
                    for name, value in answer.headers.items():
                        self.send_header(name, value)
                    self.send_header("content-length", "0")
                    self.end_headers()
                except OSError:  # the sender gave up (its timeout) before this answer
                    pass

            def log_message(self, *_: Any) -> None:
                pass

        return Handler

    def _take(self, received: Received) -> Answer:
        with self._cond:
            self.requests.append(received)
            self._cond.notify_all()
            return self.script.pop(0) if self.script else self.default

    def wait_for(self, count: int, timeout: float = 15.0) -> list[Received]:
        """Block until ``count`` requests arrived; returns them all."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.requests) >= count, timeout):
                raise TimeoutError(f"{len(self.requests)} of {count} webhook requests arrived in {timeout} s")
            return list(self.requests)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
