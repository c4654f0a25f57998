"""The processes ``vlmq demo`` and ``vlmq up`` start: each watched, and every one stopped however they end.

A child that exits, or is not ready within a bound, raises :class:`ChildFailed` with the cause and the last
lines of its log, so the command stops everything and exits non-zero instead of waiting for ever. SIGTERM and
SIGHUP stop the command the way Ctrl-C does (:func:`signals_interrupt`), so its clean-up always runs. Usage::

    with signals_interrupt():
        try:
            children = [start_child("worker", settings, folder / "worker.log", WORKER_ARGS)]
            wait_ready(children, timeout=300)
            ...
            check_alive(children)          # in every wait loop
        finally:
            stop_children(children)
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from vlmq.settings import Settings

LOG_TAIL_LINES = 15
READY_MARKER = " ready."  # what a worker's log says once it serves (Celery's "celery@... ready.")


class ChildFailed(RuntimeError):
    """A child process exited, or did not get ready in time; the message says which, why, and its log's end."""


@dataclass
class Child:
    """A started process, what to call it, and the log it writes (None: it writes none)."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path | None = None
    marker: str = READY_MARKER  # what its log says once it is ready

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def is_ready(self) -> bool:
        return self.log_path is None or self.marker in self.log_path.read_text(errors="replace")

    def failure(self, what: str) -> ChildFailed:
        where = f" (log: {self.log_path})" if self.log_path else ""
        tail = self.log_tail()
        return ChildFailed(f"the {self.name} {what}{where}" + (f"; its last lines:\n{tail}" if tail else ""))

    def check(self) -> None:
        """Raise :class:`ChildFailed` if the process has exited."""
        if (code := self.proc.poll()) is not None:
            raise self.failure(f"exited with status {code}")


def start_child(name: str, settings: Settings, log_path: Path, args: Sequence[str],
                marker: str = READY_MARKER) -> Child:
    """``python ARGS`` with the settings in its environment, logging to ``log_path``.

    It runs in its own session: Ctrl-C in the terminal reaches only the command that started it, which stops it.
    """
    env = {**os.environ, **settings.to_env()}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return Child(name, proc, log_path, marker)


def check_alive(children: Sequence[Child]) -> None:
    """Raise :class:`ChildFailed` for the first child that has exited."""
    for child in children:
        child.check()


def wait_ready(children: Sequence[Child], timeout: float, poll: float = 0.2) -> None:
    """Block until every child's log says it is ready; raise :class:`ChildFailed` on an exit or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not all(child.is_ready() for child in children):
        check_alive(children)
        if time.monotonic() > deadline:
            late = next(child for child in children if not child.is_ready())
            raise late.failure(f"is not ready after {timeout:.0f} s")
        time.sleep(poll)


def stop_children(children: Sequence[Child], timeout: float = 20.0) -> None:
    """SIGTERM every child at once (Celery's warm shutdown: each hands back or finishes its jobs), then SIGKILL
    what outlives ``timeout``."""
    for child in children:
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _handled(signums: tuple[signal.Signals, ...], handler: Any) -> Iterator[None]:
    previous = {s: signal.signal(s, handler) for s in signums}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def signals_interrupt() -> contextlib.AbstractContextManager[None]:
    """SIGINT (Ctrl-C), SIGTERM and SIGHUP raise KeyboardInterrupt inside the block, so ``finally`` clauses stop
    the children; on leaving, the previous handlers come back. SIGINT too: a process started in the background of
    a script inherits SIGINT ignored, and Python then never raises KeyboardInterrupt for it."""
    return _handled((signal.SIGINT, signal.SIGTERM, signal.SIGHUP), _interrupt)


def signals_ignored() -> contextlib.AbstractContextManager[None]:
    """SIGTERM, SIGHUP and SIGINT ignored inside the block: a second signal must not cut a clean-up short."""
    return _handled((signal.SIGTERM, signal.SIGHUP, signal.SIGINT), signal.SIG_IGN)
