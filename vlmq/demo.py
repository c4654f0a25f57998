"""``vlmq demo``: the whole pool on one machine, with the same code paths as production.

Starts an embedded Redis-compatible server, ``file://`` storage in a temporary
folder, one CPU worker process serving the bundled ``tiny-shapes`` model and one
webhook delivery worker, submits sample images through the SDK with a webhook to
a receiver in this process (on 127.0.0.1, allow-listed for the demo only), and
prints what came back by polling and by webhook. With the serve extra installed it also starts ``vlmq serve``
and asks one question through the OpenAI API (``POST /v1/chat/completions``, a data: image, a bearer key).
"""
from __future__ import annotations

import base64
import importlib.util
import json
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any

from vlmq.children import (
    Child,
    ChildFailed,
    check_alive,
    signals_ignored,
    signals_interrupt,
    start_child,
    stop_children,
    wait_ready,
)
from vlmq.client import Client
from vlmq.embedded import Server, start_valkey
from vlmq.errors import VlmqError
from vlmq.jobs import Job, JobStatus
from vlmq.progress import Progress
from vlmq.settings import Settings
from vlmq.webhooks import new_secret, verify


def load_samples() -> list[tuple[bytes, str, str, str]]:
    """(image bytes, file name, prompt, expected answer) for each shipped sample."""
    root = resources.files("vlmq") / "demo_assets"
    manifest = json.loads((root / "samples.json").read_text())
    return [((root / s["file"]).read_bytes(), s["file"], s["prompt"], s.get("expected", "")) for s in manifest]


WORKER_ARGS = ("-m", "vlmq.workers.main", "--model", "tiny-shapes")
DELIVERY_ARGS = ("-m", "vlmq.delivery")
READY_TIMEOUT = 300.0  # s: the worker loads its model, the delivery worker connects


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


def _wait_all(jobs: list[Job], timeout: float, children: list[Child]) -> None:
    progress = Progress("jobs", sys.stdout)
    started = time.monotonic()
    pending = set(range(len(jobs)))
    try:
        while pending and time.monotonic() - started < timeout:
            check_alive(children)
            pending = {i for i in pending if not jobs[i].status().is_final}
            progress.update(len(jobs) - len(pending), len(jobs))
            time.sleep(0.2)
    finally:
        progress.close()


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


def _start(settings: Settings, valkey: Server, workdir: Path, children: list[Child]) -> dict[str, str]:
    """The worker, the delivery worker and (with the serve extra) ``vlmq serve``, watched with the embedded server
    until all are ready; returns the OpenAI exports (empty without the serve extra)."""
    print(f"starting one CPU worker for tiny-shapes (log: {workdir / 'worker.log'}) and one webhook delivery "
          f"worker (log: {workdir / 'delivery.log'}) ...", flush=True)
    children.append(start_child("worker", settings, workdir / "worker.log", WORKER_ARGS))
    children.append(start_child("webhook delivery worker", settings, workdir / "delivery.log", DELIVERY_ARGS))
    exports: dict[str, str] = {}
    if importlib.util.find_spec("starlette") and importlib.util.find_spec("uvicorn"):
        from vlmq.embedded import free_port
        from vlmq.up import start_serve

        serve, lines = start_serve(settings, free_port(), workdir)
        children.append(serve)
        exports = dict(line.removeprefix("export ").split("=", 1) for line in lines)
    wait_ready([Child("embedded Redis-compatible server", valkey.proc), *children], READY_TIMEOUT)
    return exports


def _ask_over_http(exports: dict[str, str], image: bytes, prompt: str) -> str:
    """One chat completion through ``vlmq serve``, as any OpenAI client sends it."""
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    body = {"model": "tiny-shapes", "max_tokens": 64, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": prompt}]}]}
    request = urllib.request.Request(f"{exports['OPENAI_BASE_URL']}/chat/completions", json.dumps(body).encode(),
                                     {"Authorization": f"Bearer {exports['OPENAI_API_KEY']}",
                                      "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return str(json.loads(answer.read())["choices"][0]["message"]["content"])


def run_demo(num_jobs: int = 16, keep: bool = False, timeout: float = 600.0) -> int:
    """Run the demo; returns a process exit code (0 when every job finished).

    A child that exits or is not ready in time stops the demo with its cause and the end of its log (exit 1);
    Ctrl-C, SIGTERM and SIGHUP stop it (exit 130) and everything it started.
    """
    samples = load_samples()
    workdir = Path(tempfile.mkdtemp(prefix="vlmq-demo-"))
    valkey: Server | None = None
    children: list[Child] = []
    secret = new_secret()
    receiver = Receiver(secret)
    try:
        with signals_interrupt():
            print("starting an embedded Redis-compatible server ...", flush=True)
            valkey = start_valkey()
            # the demo's own receiver listens on 127.0.0.1: allow exactly that address past the webhook guard;
            # the other settings come from the environment (VLMQ_MODELS can point tiny-shapes at another folder)
            settings = Settings.from_env(broker_url=valkey.url, storage_url=f"file://{workdir / 'storage'}",
                                         webhook_secrets=secret, webhook_allow="127.0.0.1/32", webhook_poll=0.1)
            print(f"  {valkey.url}; storage {settings.storage_url}", flush=True)
            exports = _start(settings, valkey, workdir, children)
            watched = [Child("embedded Redis-compatible server", valkey.proc), *children]
            code = _run_jobs(settings, receiver, [samples[i % len(samples)] for i in range(num_jobs)], timeout,
                             watched)
            if exports:
                data, name, prompt, expected = samples[0]
                text = _ask_over_http(exports, data, prompt)
                print(f"OpenAI API (vlmq serve at {exports['OPENAI_BASE_URL']}): {name}: {prompt!r} -> {text!r} "
                      f"({'matches' if text == expected else 'expected ' + repr(expected)})", flush=True)
            return code
    except KeyboardInterrupt:
        print("\ninterrupted; shutting down", flush=True)
        return 130
    except ChildFailed as e:
        print(f"vlmq demo: {e}\nstopping", file=sys.stderr, flush=True)
        return 1
    except VlmqError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        with signals_ignored():
            stop_children(children)
            receiver.server.shutdown()
            if valkey is not None:
                valkey.stop()
            if not keep:
                shutil.rmtree(workdir, ignore_errors=True)


def _run_jobs(settings: Settings, receiver: Receiver, picked: list[tuple[bytes, str, str, str]], timeout: float,
              watched: list[Child]) -> int:
    with Client(settings=settings, webhook=receiver.url) as client:
        jobs = [client.submit(data, prompt, max_new_tokens=64) for data, _, prompt, _ in picked]
        print(f"submitted {len(jobs)} jobs", flush=True)
        _wait_all(jobs, timeout, watched)
        correct = _table(jobs, [(name, prompt, exp) for _, name, prompt, exp in picked])
        finished = sum(j.status() is JobStatus.FINISHED for j in jobs)
    told = receiver.wait({j.id for j in jobs}, timeout=30)
    print(f"{finished}/{len(jobs)} finished, {correct} answers match the expected ones")
    print(f"webhooks: {told}/{len(jobs)} signed job events received at {receiver.url} and verified "
          f"({receiver.rejected} refused)", flush=True)
    return 0 if finished == told == len(jobs) else 1
