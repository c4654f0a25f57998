"""``vlmq serve`` as a real child process on a free loopback port, for the tests (and scripts/bench_serve.py), and
what a test of the door gets (``Door``; the ``door`` fixture in this folder's conftest makes one). Tests import
these from here, never from ``conftest``: several folders have a conftest, and ``import conftest`` finds whichever
was imported first."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from workerproc import TINY_CLASSES

from vlmq.settings import Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeProcess:
    """``python -m vlmq.cli serve`` with ``settings`` in its environment, logging to ``log_path``."""

    def __init__(self, settings: Settings, log_path: Path, **env: str) -> None:
        self.port, self.log_path = free_port(), log_path
        self.url = f"http://127.0.0.1:{self.port}"
        full = {**{k: v for k, v in os.environ.items() if not k.startswith("VLMQ_")}, **settings.to_env(), **env}
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "vlmq.cli", "serve", "--port", str(self.port),
                                          "--log-level", "warning"], env=full, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vlmq serve exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/readyz", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"vlmq serve not ready after {timeout} s:\n{self.log()[-4000:]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Door:
    """What a test of the HTTP door gets."""

    settings: Settings
    serve: ServeProcess
    url: str  # OPENAI_BASE_URL
    key_a: str  # a key of tenant "acme"
    key_b: str  # a key of tenant "globex"


def serve_settings(redis_url: str, s3_url: str, prefix: str) -> Settings:
    return Settings(broker_url=redis_url, storage_url=f"s3://vlmq-test/{prefix}", s3_endpoint_url=s3_url,
                    cost_classes=TINY_CLASSES, worker_batch=16)
