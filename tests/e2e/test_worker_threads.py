"""A real worker's threads after real jobs: torch's OpenMP team lives on the model thread only (workers/native.py).

Every thread the worker makes (and each Celery job thread, at its first task) carries its name into the kernel, and
the threads it starts inherit that name: a pool thread that started an OpenMP team would show as two threads of one
name. Counted in /proc after small and large images (a large one makes the preprocessing run parallel-sized ops).
"""
from __future__ import annotations

import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import inputs
import pytest
from test_pool import png
from workerproc import TINY_CLASSES, ready_worker

from vlmq.client import Client
from vlmq.settings import Settings

pytestmark = pytest.mark.timeout(300)


def kernel_names(pid: int) -> Counter[str]:
    names: Counter[str] = Counter()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            names[(task / "comm").read_text().strip()] += 1
        except OSError:  # the thread ended
            continue
    return names


def torch_threads() -> int:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], check=True,
                         capture_output=True, text=True, timeout=120)
    return int(out.stdout)


def test_only_the_model_thread_runs_an_openmp_team(redis_url: str, tmp_path: Path) -> None:
    settings = Settings(broker_url=redis_url, storage_url=f"file://{tmp_path / 'store'}", cost_classes=TINY_CLASSES,
                        worker_batch=4)
    with ready_worker(redis_url, settings, tmp_path / "worker.log") as worker:
        process_name = Path(f"/proc/{worker.proc.pid}/comm").read_text().strip()
        unnamed_at_ready = kernel_names(worker.proc.pid)[process_name]
        with Client(settings=settings) as client:
            images = [inputs.encode(inputs.rgb(), "PNG"), png(1000, 750, 1), png(640, 480, 2), png(1344, 1008, 3)]
            jobs = [client.submit(image, "Describe the image.", max_new_tokens=32, ignore_eos=True)
                    for image in images for _ in range(2)]
            for job in jobs:
                assert len(job.result(timeout=180).token_ids) == 32
        deadline = time.monotonic() + 20
        while "load" in (names := kernel_names(worker.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)  # the load thread's team exits after that thread does
        assert "load" not in names  # the model loaded on a thread that is gone, with its team
        assert names["model"] == torch_threads()  # the model thread and its team
        assert any(name.startswith("preprocess_") for name in names) and any(n.startswith("job_") for n in names)
        repeated = {name: n for name, n in names.items() if n > 1 and name not in ("model", process_name)}
        assert repeated == {}  # no other named thread started a team
        assert names[process_name] == unnamed_at_ready  # nor the main thread, nor one a library made


def test_the_worker_logs_where_its_start_up_went(redis_url: str, tmp_path: Path) -> None:
    settings = Settings(broker_url=redis_url, storage_url=f"file://{tmp_path / 'store'}", cost_classes=TINY_CLASSES)
    with ready_worker(redis_url, settings, tmp_path / "worker.log") as worker:
        deadline = time.monotonic() + 20
        while "start-up:" not in worker.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        line = next(x for x in worker.log().splitlines() if "start-up:" in x)
    phases = re.findall(r"([a-z][a-zA-Z -]*?) (\d+\.\d+) s", line.split("start-up:", 1)[1])
    names = [name for name, _ in phases]
    assert names == ["interpreter and CLI", "imports", "model load", "worker set-up", "celery start",
                     "exec to consuming"]
    seconds = [float(s) for _, s in phases]
    assert abs(sum(seconds[:-1]) - seconds[-1]) < 0.05 and 0 < seconds[-1] < 120
