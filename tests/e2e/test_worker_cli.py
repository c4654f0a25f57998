"""`vlmq worker` on a machine that cannot use CUDA: one clear line, not a traceback."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when CUDA is unusable")


@pytest.mark.parametrize("args", [["--device", "cuda"], ["--device", "cuda:1"], ["--gpus", "all"]])
def test_asking_for_a_gpu_without_one_exits_with_one_line(args: list[str]) -> None:
    run = subprocess.run([sys.executable, "-m", "vlmq.cli", "worker", *args], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("vlmq worker: cannot use device 'cuda") and "use --device cpu" in lines[0]
