"""A worker that keeps crashing on start-up is reported and given up, not restarted forever."""
from __future__ import annotations

import os
import subprocess
import sys

from vlmq.workers.crashloop import RestartPolicy


def test_start_up_crashes_back_off_then_give_up_and_a_long_run_resets_the_count() -> None:
    policy = RestartPolicy(startup_window_s=60, max_startup_crashes=3)
    assert [policy.after_exit("0", 1.0), policy.after_exit("0", 1.0)] == [1.0, 2.0]
    assert policy.after_exit("1", 5.0) == 1.0  # slots are counted apart
    assert policy.after_exit("0", 1.0) is None
    assert policy.after_exit("1", 3600.0) == 0.0 and policy.crashes["1"] == 0


def test_the_supervisor_gives_up_a_gpu_whose_worker_dies_on_start_up(tmp_path) -> None:
    # a worker for a model that does not exist dies at once, every time, as one fed a poison message would;
    # GPU 7 is a fake one (VLMQ_FAKE_GPUS), so this runs without a GPU
    env = {**os.environ, "VLMQ_FAKE_GPUS": "7"}
    proc = subprocess.run([sys.executable, "-m", "vlmq.workers.main", "--gpus", "7", "--model", "no-such-model"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "restarting in 1 s" in proc.stderr and "restarting in 2 s" in proc.stderr
    assert "worker on GPU 7 crashed 3 times within 60 s of starting" in proc.stderr
    assert proc.stderr.count("unknown model 'no-such-model'") == 3  # started 3 times, not more
