"""``vlmq demo``: the whole pool on one machine, with the same code paths as production.

Starts an embedded Redis-compatible server, ``file://`` storage in a temporary
folder and one CPU worker process serving the bundled ``tiny-shapes`` model,
submits sample images through the SDK and prints what came back.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from vlmq.client import Client
from vlmq.embedded import Server, start_valkey
from vlmq.errors import VlmqError
from vlmq.jobs import Job, JobStatus
from vlmq.settings import Settings


def load_samples() -> list[tuple[bytes, str, str, str]]:
    """(image bytes, file name, prompt, expected answer) for each shipped sample."""
    root = resources.files("vlmq") / "demo_assets"
    manifest = json.loads((root / "samples.json").read_text())
    return [((root / s["file"]).read_bytes(), s["file"], s["prompt"], s.get("expected", "")) for s in manifest]


def start_worker(settings: Settings, log_path: Path,
                 args: Sequence[str] = ("--model", "tiny-shapes")) -> subprocess.Popen[bytes]:
    """A worker process (``vlmq worker ARGS``; by default one for the bundled model), logging to ``log_path``.

    It runs in its own session: Ctrl-C in the terminal reaches only the command that started it, which stops it.
    """
    env = {**os.environ, **settings.to_env()}
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "vlmq.workers.main", *args], env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """SIGTERM (Celery's warm shutdown), then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
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
    worker: subprocess.Popen[bytes] | None = None
    try:
        print("starting an embedded Redis-compatible server ...")
        valkey = start_valkey()
        settings = Settings(broker_url=valkey.url, storage_url=f"file://{workdir / 'storage'}")
        print(f"  {valkey.url}; storage {settings.storage_url}")
        print(f"starting one CPU worker for tiny-shapes (log: {workdir / 'worker.log'}) ...")
        worker = start_worker(settings, workdir / "worker.log")
        with Client(settings=settings) as client:
            picked = [samples[i % len(samples)] for i in range(num_jobs)]
            jobs = [client.submit(data, prompt, max_new_tokens=64) for data, _, prompt, _ in picked]
            print(f"submitted {len(jobs)} jobs")
            _wait_all(jobs, timeout)
            correct = _table(jobs, [(name, prompt, exp) for _, name, prompt, exp in picked])
            finished = sum(j.status() is JobStatus.FINISHED for j in jobs)
        print(f"{finished}/{len(jobs)} finished, {correct} answers match the expected ones")
        return 0 if finished == len(jobs) else 1
    except KeyboardInterrupt:
        print("\ninterrupted; shutting down")
        return 130
    except VlmqError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if worker is not None:
            stop_process(worker)
        if valkey is not None:
            valkey.stop()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
