"""`vlmq demo` and `vlmq up` as a user runs them: answers, a clear exit when a child fails, nothing left behind.

Each runs as a real child process (`python -m vlmq.cli ...`) from the repository root with its output captured
(not a terminal), in its own session so the test can signal it and find every process it started.
"""
from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from workerproc import alive, descendants

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "workers" / "assets" / "tiny-shapes"


def _env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("VLMQ_")}, **extra}


class Command:
    """A `vlmq` command in its own session, its merged output read line by line on a thread."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "vlmq.cli", *args], cwd=ROOT, env=env or _env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.text = ""
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw.decode(errors="replace"))

    def wait_for(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text:
            self.text += self.lines.get(timeout=max(0.1, deadline - time.monotonic()))

    def finish(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self.reader.join(10)
        while not self.lines.empty():
            self.text += self.lines.get()
        return code

    def __enter__(self) -> Command:
        return self

    def __exit__(self, *_: object) -> None:
        self.kill_group()

    def kill_group(self) -> None:
        """Leave nothing behind, whatever the test found (its pipe closed too)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.reader.join(10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def test_demo_answers_every_job_and_logs_progress_as_lines() -> None:
    with Command("demo") as demo:
        code = demo.finish(timeout=480)
    assert code == 0, demo.text[-4000:]
    assert "16/16 finished" in demo.text
    assert "webhooks: 16/16" in demo.text
    assert "OpenAI API (vlmq serve at http://127.0.0.1:" in demo.text and "(matches)" in demo.text  # the HTTP door
    assert "\r" not in demo.text  # not a terminal: lines, never a redrawn bar
    assert "/16 jobs" in demo.text  # the progress lines themselves


@pytest.fixture
def broken_model(tmp_path: Path) -> str:
    """VLMQ_MODELS pointing tiny-shapes at a copy of its folder without weights."""
    broken = tmp_path / "tiny-shapes"
    shutil.copytree(BUNDLED, broken)
    (broken / "model.safetensors").unlink()
    return f"tiny-shapes={broken}"


def _fails_fast_naming_the_cause(command: Command, started: str, who: str) -> float:
    """Wait for the command to exit after `started` is printed; returns its seconds from start. It must exit 1,
    name the child that exited and its cause, and leave none of its processes running."""
    begun = time.monotonic()
    with command:
        command.wait_for(started, timeout=60)
        children = descendants(command.proc.pid)
        code = command.finish(timeout=60)
    assert code == 1, command.text[-4000:]
    assert f"the {who} exited with status 1" in command.text
    assert "cannot load model 'tiny-shapes': ValueError: no *.safetensors files in" in command.text  # its log's end
    assert not [f"{pid} {name}" for pid, name in children.items() if alive(pid)]
    return time.monotonic() - begun


def test_demo_whose_worker_cannot_load_its_model_exits_quickly_with_the_cause(broken_model: str) -> None:
    demo = Command("demo", env=_env(VLMQ_MODELS=broken_model))
    elapsed = _fails_fast_naming_the_cause(demo, "starting one CPU worker", "worker")
    assert elapsed < 30, f"{elapsed:.1f} s"


def test_vlmq_up_whose_worker_cannot_load_its_model_exits_with_the_cause(broken_model: str) -> None:
    up = Command("up", "--workers", "1", env=_env(VLMQ_MODELS=broken_model))
    _fails_fast_naming_the_cause(up, "starting 1 worker", "worker 0")


def _assert_signal_stops_everything(command: Command, needle: str, signum: int, code: int) -> None:
    with command:
        command.wait_for(needle, timeout=300)
        children = descendants(command.proc.pid)
        assert "valkey-server" in children.values() and len(children) >= 2, children
        os.kill(command.proc.pid, signum)  # the process alone, as a supervisor or `kill` sends it
        assert command.finish(timeout=90) == code, command.text[-3000:]
    assert not [f"{pid} {name}" for pid, name in children.items() if alive(pid)]


def test_sigterm_stops_a_running_demo_and_everything_it_started() -> None:
    _assert_signal_stops_everything(Command("demo", "--jobs", "64"), "submitted 64 jobs", signal.SIGTERM, 130)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_stops_vlmq_up_and_everything_it_started(signum: int) -> None:
    _assert_signal_stops_everything(Command("up", "--workers", "1"), "Ctrl-C stops", signum, 0)


def test_vlmq_worker_that_cannot_load_its_model_exits_with_one_line(broken_model: str, redis_url: str) -> None:
    run = subprocess.run([sys.executable, "-m", "vlmq.cli", "worker", "--model", "tiny-shapes", "--device", "cpu"],
                         cwd=ROOT, env=_env(VLMQ_MODELS=broken_model, VLMQ_BROKER_URL=redis_url),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "Traceback" not in run.stderr  # log lines before it (the KV archive's state) are log lines, not a trace
    assert run.stderr.strip().splitlines()[-1] == (
        f"vlmq worker: cannot load model 'tiny-shapes': ValueError: no *.safetensors files in "
        f"{broken_model.split('=', 1)[1]}; save the checkpoint with safe_serialization")
