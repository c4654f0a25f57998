"""`vlmq worker --gpus all` on fake GPUs (VLMQ_FAKE_GPUS, children on the CPU): a child killed with SIGKILL is
restarted and its jobs are served by the pool; SIGTERM stops the supervisor and every child cleanly."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_pool import png
from workerproc import TINY_CLASSES, alive

from vlmq.client import Client
from vlmq.settings import Settings

pytestmark = pytest.mark.slow
STARTED = re.compile(r"started the worker for GPU (\d+) \(on the CPU\): pid (\d+)")


def wait_until(check: Callable[[], bool], timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{log.read_text()[-4000:]}"
        time.sleep(0.1)


def test_a_killed_gpu_worker_is_restarted_and_loses_no_job(redis_url: str, tmp_path: Path) -> None:
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    settings = Settings(broker_url=redis_url, storage_url=f"file://{tmp_path / 'storage'}", cost_classes=TINY_CLASSES,
                        visibility_timeout=4, worker_batch=2, fake_gpus="0,1")
    log = tmp_path / "supervisor.log"
    with open(log, "wb") as out:
        supervisor = subprocess.Popen([sys.executable, "-m", "vlmq.workers.main", "--gpus", "all"],
                                      env={**os.environ, **settings.to_env()}, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True)
    try:
        wait_until(lambda: log.read_text().count(" ready.") == 2, 240, "two ready workers", log)
        children = {int(pid): gpu for gpu, pid in STARTED.findall(log.read_text())}
        assert sorted(children.values()) == ["0", "1"]
        with Client(settings=settings) as client:
            jobs = [client.submit(png(160, 120, i), "Describe the image.", max_new_tokens=48, ignore_eos=True)
                    for i in range(4)]
            names = {f"{socket.gethostname()}:{pid}": pid for pid in children}
            wait_until(lambda: any(j.info().get("worker") in names for j in jobs), 60, "a started job", log)
            victim_job = next(j for j in jobs if j.info().get("worker") in names)
            victim = names[victim_job.info()["worker"]]
            os.kill(victim, signal.SIGKILL)
            wait_until(lambda: len(STARTED.findall(log.read_text())) == 3, 60, "the restart", log)
            assert f"worker on GPU {children[victim]} exited with -9; restarting in 1 s" in log.read_text()
            for job in jobs:
                assert len(job.result(timeout=240).token_ids) == 48
            assert victim_job.info()["worker"] != f"{socket.gethostname()}:{victim}"
        latest = {gpu: int(pid) for gpu, pid in STARTED.findall(log.read_text())}  # the restarted one, for its GPU
        assert victim not in latest.values() and all(alive(pid) for pid in latest.values())
        supervisor.send_signal(signal.SIGTERM)  # a node drains: the supervisor forwards it to each child
        assert supervisor.wait(90) == 0, log.read_text()[-4000:]
        assert not any(alive(pid) for pid in latest.values())
    finally:
        if supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)
            supervisor.wait()
