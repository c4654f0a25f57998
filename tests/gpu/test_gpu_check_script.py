"""scripts/gpu_check.sh, checked on CPU: its dry run lists the three steps, every path it names exists, the
benchmark scripts accept the flags it passes, and without CUDA it refuses clearly and writes nothing."""
import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def run_check(*args, env=None):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, cwd=ROOT)


def listed_steps() -> dict[str, list[str]]:
    result = run_check("--dry-run", env={"PY": "python", "OUT": "bench-results/gpu"})
    assert result.returncode == 0, result.stderr
    steps = {}
    for line in result.stdout.splitlines():
        name, cmd = line.split(": ", 1)
        steps[name.split()[0]] = shlex.split(cmd)
    return steps


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_lists_tests_then_kernel_then_engine_benchmarks_writing_into_bench_results_gpu():
    steps = listed_steps()
    assert list(steps) == ["tests", "kernels", "engine"]
    assert steps["tests"][:3] == ["python", "-m", "pytest"] and "-m" in steps["tests"][3:]
    assert steps["tests"][steps["tests"].index("-m", 3) + 1] == "gpu"
    for path in ("tests/kernels", "tests/gpu"):
        assert path in steps["tests"] and (ROOT / path).is_dir()
    for name in ("kernels", "engine"):
        out = steps[name][steps[name].index("--out") + 1]
        assert out.startswith("bench-results/gpu/") and out.endswith(".json")
        assert (ROOT / steps[name][1]).is_file()


def test_benchmark_scripts_accept_the_flags_the_check_passes():
    steps = listed_steps()
    kernels = load("bench_kernels_gpu").parse_args(steps["kernels"][2:])
    assert kernels.iters == 20 and not kernels.dry_run
    engine = load("bench_engine_gpu").parse_args(steps["engine"][2:])
    assert engine.max_new_tokens == 32 and engine.models == ["2b", "7b"] and not engine.dry_run


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_refuses_and_writes_nothing(tmp_path):
    out = tmp_path / "gpu"
    result = run_check(env={"PY": sys.executable, "OUT": str(out)})
    assert result.returncode == 2 and "no CUDA device" in result.stdout
    assert not out.exists()
