"""``vlmq demo``: the whole pool on one machine, with the same code paths as production.

Starts an embedded Redis-compatible server, ``file://`` storage in a temporary
folder, one CPU worker process serving the bundled ``tiny-shapes`` model and one
webhook delivery worker, submits sample images through the SDK with a webhook to
a receiver in this process (on 127.0.0.1, allow-listed for the demo only), and
prints what came back by polling and by webhook.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any

from vlmq.client import Client
from vlmq.embedded import Server, start_valkey
from vlmq.errors import VlmqError
from vlmq.jobs import Job, JobStatus
from vlmq.settings import Settings
from vlmq.webhooks import new_secret, verify


def load_samples() -> list[tuple[bytes, str, str, str]]:
    """(image bytes, file name, prompt, expected answer) for each shipped sample."""
    root = resources.files("vlmq") / "demo_assets"
    manifest = json.loads((root / "samples.json").read_text())
    return [((root / s["file"]).read_bytes(), s["file"], s["prompt"], s.get("expected", "")) for s in manifest]


WORKER_ARGS = ("-m", "vlmq.workers.main", "--model", "tiny-shapes")


def start_worker(settings: Settings, log_path: Path, args: Sequence[str] = WORKER_ARGS) -> subprocess.Popen[bytes]:
    """A process running ``python ARGS`` (by default a worker for the bundled model), logging to ``log_path``.

    It runs in its own session: Ctrl-C in the terminal reaches only the command that started it, which stops it.
    """
    env = {**os.environ, **settings.to_env()}
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


class Receiver:
    """A webhook receiver on 127.0.0.1 that verifies each signature and keeps the job ids it was told about."""

    def __init__(self, secret: str) -> None:
        self.job_ids: set[str] = set()
        self.rejected = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                try:
                    receiver.job_ids.add(verify(secret, body, dict(self.headers.items()))["data"]["id"])
                    self.send_response(204)
                except Exception:  # a bad signature: refuse it (the delivery worker retries)
                    receiver.rejected += 1
                    self.send_response(401)
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/vlmq-events"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, job_ids: set[str], timeout: float) -> int:
        """How many of ``job_ids`` were received (waiting up to ``timeout`` s for them all)."""
        deadline = time.monotonic() + timeout
        while not job_ids <= self.job_ids and time.monotonic() < deadline:
            time.sleep(0.1)
        return len(job_ids & self.job_ids)


def stop_processes(procs: Sequence[subprocess.Popen[bytes]], timeout: float = 20.0) -> None:
    """SIGTERM every process at once (Celery's warm shutdown: each hands back or finishes its jobs), then SIGKILL
    what outlives ``timeout``."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _progress(done: int, total: int, started: float) -> None:
    width = 30
    filled = width * done // max(total, 1)
    bar = "#" * filled + "-" * (width - filled)
    print(f"\r  [{bar}] {done}/{total} jobs  {time.monotonic() - started:5.1f} s", end="", flush=True)


def _wait_all(jobs: list[Job], timeout: float) -> None:
    started = time.monotonic()
    pending = set(range(len(jobs)))
    while pending and time.monotonic() - started < timeout:
        pending = {i for i in pending if not jobs[i].status().is_final}
        _progress(len(jobs) - len(pending), len(jobs), started)
        time.sleep(0.2)
    print()


def _table(jobs: list[Job], meta: list[tuple[str, str, str]]) -> int:
    print(f"{'image':<22} {'class':<5} {'tokens':>6} {'ok':<3} {'secs':>5}  answer")
    correct = 0
    for job, (name, prompt, expected) in zip(jobs, meta, strict=True):
        info = job.info()
        if info["status"] != JobStatus.FINISHED.value:
            print(f"{name:<22} {info['cost_class']:<5} {info['vision_tokens']:>6} --- {'':>5}  "
                  f"[{info['status']}] {info.get('error_type', '')} {info.get('error_message', '')}")
            continue
        result = job.result()
        ok = result.text.strip() == expected.strip()
        correct += ok
        print(f"{name:<22} {info['cost_class']:<5} {info['vision_tokens']:>6} {'yes' if ok else 'no':<3} "
              f"{result.timings['total']:5.2f}  {prompt} -> {result.text}")
    return correct


def run_demo(num_jobs: int = 16, keep: bool = False, timeout: float = 600.0) -> int:
    """Run the demo; returns a process exit code (0 when every job finished)."""
    samples = load_samples()
    workdir = Path(tempfile.mkdtemp(prefix="vlmq-demo-"))
    valkey: Server | None = None
    workers: list[subprocess.Popen[bytes]] = []
    secret = new_secret()
    receiver = Receiver(secret)
    try:
        print("starting an embedded Redis-compatible server ...")
        valkey = start_valkey()
        # the demo's own receiver listens on 127.0.0.1: allow exactly that address past the webhook guard
        settings = Settings(broker_url=valkey.url, storage_url=f"file://{workdir / 'storage'}",
                            webhook_secrets=secret, webhook_allow="127.0.0.1/32", webhook_poll=0.1)
        print(f"  {valkey.url}; storage {settings.storage_url}")
        print(f"starting one CPU worker for tiny-shapes (log: {workdir / 'worker.log'}) and one webhook delivery "
              f"worker (log: {workdir / 'delivery.log'}) ...")
        workers.append(start_worker(settings, workdir / "worker.log"))
        workers.append(start_worker(settings, workdir / "delivery.log", ("-m", "vlmq.delivery")))
        with Client(settings=settings, webhook=receiver.url) as client:
            picked = [samples[i % len(samples)] for i in range(num_jobs)]
            jobs = [client.submit(data, prompt, max_new_tokens=64) for data, _, prompt, _ in picked]
            print(f"submitted {len(jobs)} jobs")
            _wait_all(jobs, timeout)
            correct = _table(jobs, [(name, prompt, exp) for _, name, prompt, exp in picked])
            finished = sum(j.status() is JobStatus.FINISHED for j in jobs)
        told = receiver.wait({j.id for j in jobs}, timeout=30)
        print(f"{finished}/{len(jobs)} finished, {correct} answers match the expected ones")
        print(f"webhooks: {told}/{len(jobs)} signed job events received at {receiver.url} and verified "
              f"({receiver.rejected} refused)")
        return 0 if finished == told == len(jobs) else 1
    except KeyboardInterrupt:
        print("\ninterrupted; shutting down")
        return 130
    except VlmqError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        stop_processes(workers)
        receiver.server.shutdown()
        if valkey is not None:
            valkey.stop()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
