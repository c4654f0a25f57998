"""A real HTTPS image server on loopback for the fetch tests: ranges, redirects, trickles, 5xx, changed bytes."""
from __future__ import annotations

import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Route:
    body: bytes = b""
    status: int = 200
    location: str = ""  # a redirect's target
    honour_range: bool = True
    trickle: float = 0.0  # seconds between bytes (0: all at once)
    fail_first: int = 0  # answer 503 this many times first


@dataclass
class Served:
    routes: dict[str, Route] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)  # (path, Range header)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        state = self.server.state
        state.requests.append((self.path, self.headers.get("range", "")))
        route = state.routes.get(self.path)
        if route is None:
            return self._send(404, b"no such image")
        if route.fail_first > 0:
            route.fail_first -= 1
            return self._send(503, b"busy")
        if route.location:
            self.send_response(route.status)
            self.send_header("Location", route.location)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        body, status, extra = route.body, route.status, {"ETag": f'"{hash(route.body) & 0xFFFF:x}"'}
        wanted = self.headers.get("range", "")
        if route.honour_range and wanted.startswith("bytes=0-"):
            end = min(int(wanted[len("bytes=0-"):]), len(body) - 1)
            body, status = body[:end + 1], 206
            extra["Content-Range"] = f"bytes 0-{end}/{len(route.body)}"
        return self._send(status, body, extra, route.trickle)

    def _send(self, status: int, body: bytes, extra: dict[str, str] | None = None, trickle: float = 0.0) -> None:
        self.send_response(status)
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            if not trickle:
                self.wfile.write(body)
                return
            for i in range(len(body)):
                self.wfile.write(body[i:i + 1])
                self.wfile.flush()
                time.sleep(trickle)
        except OSError:  # the client gave up
            pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: Served


class ImageServer:
    """Serves ``routes`` over TLS (``context``) at ``https://localhost:<port>/...``."""

    def __init__(self, host: str, context: ssl.SSLContext) -> None:
        self.httpd = _Server((host, 0), _Handler)
        self.httpd.state = Served()
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def routes(self) -> dict[str, Route]:
        return self.httpd.state.routes

    @property
    def requests(self) -> list[tuple[str, str]]:
        return self.httpd.state.requests

    def url(self, path: str, host: str = "localhost") -> str:
        return f"https://{host}:{self.port}{path}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
