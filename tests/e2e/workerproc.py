"""Helpers for end-to-end tests: real worker processes against the test servers."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from vlmq.settings import Settings

# Cost classes scaled to the bundled model, whose images are at most 18 x 18 = 324 tokens (the defaults are sized
# for real Qwen2-VL checkpoints and would put every tiny-shapes image in xs or s).
TINY_CLASSES = "xs=64,s=256,m=1024,l=4096,xl"


class WorkerProcess:
    """``python -m vlmq.workers.main`` (or another ``entry``: a script) as a child process, logging to a file."""

    def __init__(self, settings: Settings, log_path: Path, *extra: str,
                 entry: tuple[str, ...] = ("-m", "vlmq.workers.main"), cwd: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        env = {**os.environ, **settings.to_env(), **(env or {})}
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, *entry, *extra], env=env, cwd=cwd,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if " ready." in self.log():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"worker not ready after {timeout} s:\n{self.log()[-4000:]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def ready_worker(redis_url: str, settings: Settings, log_path: Path, *extra: str,
                 entry: tuple[str, ...] = ("-m", "vlmq.workers.main")) -> Iterator[WorkerProcess]:
    """An emptied Redis database and one ready worker process (or another ``entry``), stopped on exit."""
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    worker = WorkerProcess(settings, log_path, *extra, entry=entry)
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.stop()


def descendants(root: int) -> dict[int, str]:
    """pid -> command name of every live process below ``root``."""
    parents: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if rest[0] != "Z":
            parents[int(entry.name)] = (int(rest[1]), name)
    found, frontier = {}, {root}
    while frontier:
        frontier = {pid for pid, (ppid, _) in parents.items() if ppid in frontier}
        found.update({pid: parents[pid][1] for pid in frontier})
    return found


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"
