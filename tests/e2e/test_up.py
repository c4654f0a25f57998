"""`vlmq up`: a producer in another shell runs an SDK example (docs/operations.md) against it with the printed
exports; Ctrl-C (SIGINT to its process group, as a terminal sends it) stops everything it started."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_pool import png
from workerproc import UpCommand, alive

pytestmark = pytest.mark.slow
# the producer docs/operations.md shows for `vlmq up`
SDK_EXAMPLE = """
from vlmq import Client

client = Client.from_env()
job = client.submit("photo.png", "Describe the image.", model="tiny-shapes", max_new_tokens=64)
print(job.id, job.status())
result = job.result(timeout=60)
print(result.text, result.usage, result.worker)
"""


def test_vlmq_up_serves_the_sdk_example_and_ctrl_c_leaves_nothing_running(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLMQ_")}
    up = UpCommand("--workers", "1", env=env)
    try:
        text, exports = up.ready()
        assert set(exports) == {"VLMQ_BROKER_URL", "VLMQ_STORAGE_URL"}, text
        started = up.started
        assert "valkey-server" in started.values() and len(started) >= 2, started

        (tmp_path / "photo.png").write_bytes(png(160, 120, 1))
        producer = subprocess.run([sys.executable, "-c", SDK_EXAMPLE], env={**env, **exports}, cwd=tmp_path,
                                  capture_output=True, text=True, timeout=120)
        assert producer.returncode == 0, producer.stderr
        job_line, result_line = producer.stdout.strip().splitlines()
        assert re.fullmatch(r"[0-9a-f]{32} (queued|started|finished)", job_line)
        assert "'generated_tokens'" in result_line

        os.killpg(up.proc.pid, signal.SIGINT)  # Ctrl-C in its terminal
        assert up.proc.wait(90) == 0
        assert not [f"{pid} {name}" for pid, name in started.items() if alive(pid)]
        storage = re.search(r"storage file://(\S+);", text)
        assert storage and not Path(storage[1]).exists()  # its temporary folder is gone too
    finally:
        up.close()
