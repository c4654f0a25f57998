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


class UpCommand:
    """``python -m vlmq.cli up ARGS`` in its own session (as a terminal runs it), its output read on a thread.

    ``ready()`` waits for the Ctrl-C hint and returns what was printed and its ``export`` lines; ``close()`` leaves
    nothing running, whatever the test did.
    """

    def __init__(self, *args: str, env: dict[str, str]) -> None:
        import queue
        import threading

        self.proc = subprocess.Popen([sys.executable, "-m", "vlmq.cli", "up", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        assert self.proc.stdout is not None
        stdout = self.proc.stdout
        self.reader = threading.Thread(target=lambda: [self.lines.put(line) for line in stdout], daemon=True)
        self.reader.start()
        self.started: dict[int, str] = {}

    def ready(self, timeout: float = 240) -> tuple[str, dict[str, str]]:
        import shlex

        printed: list[str] = []
        while not printed or "Ctrl-C" not in printed[-1]:
            printed.append(self.lines.get(timeout=timeout))
        exports = dict(shlex.split(line.removeprefix("export "))[0].split("=", 1)
                       for line in printed if line.startswith("export "))
        self.started = descendants(self.proc.pid)
        return "".join(printed), exports

    def close(self) -> None:
        import signal

        if self.proc.poll() is None:  # the test failed: leave nothing behind all the same
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            for pid in self.started:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
        self.reader.join(10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
