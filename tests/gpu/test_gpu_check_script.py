"""scripts/gpu_check.sh, checked on CPU: its dry run lists the setup and the four steps, every path it names
exists, the benchmark scripts accept the flags it passes, without CUDA it refuses clearly and writes nothing, and
its setup makes vlmq importable in a bare copy of the tree (as on the device: nothing installed, no network)."""
import importlib.util
import json
import os
import shlex
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def run_check(*args, env=None, root=ROOT, timeout=120):
    return subprocess.run(["bash", str(root / "scripts" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, cwd=root)


def listed_steps() -> dict[str, list[str]]:
    result = run_check("--dry-run", env={"PY": "python", "OUT": "bench-results/gpu"})
    assert result.returncode == 0, result.stderr
    steps = {}
    for line in result.stdout.splitlines():
        if not line.startswith("#"):  # the setup, described
            name, cmd = line.split(": ", 1)
            steps[name.split()[0]] = shlex.split(cmd)
    return steps


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_lists_kernel_tests_and_benchmark_then_engine_tests_and_benchmark_into_bench_results_gpu():
    steps = listed_steps()
    assert list(steps) == ["kernel-tests", "kernels", "engine-tests", "tp", "engine"]
    for name, path in (("kernel-tests", "tests/kernels"), ("engine-tests", "tests/gpu"),
                       ("tp", "tests/gpu/test_tensor_parallel_gpu.py")):
        cmd = steps[name]
        assert cmd[:3] == ["python", "-m", "pytest"] and cmd[cmd.index("-m", 3) + 1] == "gpu"
        assert path in cmd and (ROOT / path).exists()
        assert any(a.startswith("--junitxml=bench-results/gpu/") for a in cmd)
    for name in ("kernels", "engine"):
        out = steps[name][steps[name].index("--out") + 1]
        assert out.startswith("bench-results/gpu/") and out.endswith(".json")
        assert (ROOT / steps[name][1]).is_file()


def test_the_step_limits_fit_one_device_command():
    dry = run_check("--dry-run", env={"PY": "python"}).stdout
    limits = [int(line.split("(timeout ")[1].split("s)")[0]) for line in dry.splitlines() if "(timeout " in line]
    assert sum(limits[:-1]) < 560 and "within 560s in all" in dry  # the budget; the device tool allows 600 s


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


@pytest.fixture
def bare(tmp_path) -> tuple[Path, Path]:
    """A copy of the tree and a Python that has this one's packages but not vlmq: a venv whose .pth lists this
    interpreter's site-packages as plain paths (their own .pth files, vlmq's editable hook among them, stay off)."""
    tree = tmp_path / "tree"
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"],
                            capture_output=True)
    if listed.returncode:  # not a git checkout (a copied tree): everything but build outputs
        shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns("*.so", "__pycache__", "build", "*.egg-info"))
    else:
        for name in filter(None, listed.stdout.decode().split("\0")):
            if (ROOT / name).is_file():
                (tree / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, tree / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "host.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return tree, python


@pytest.mark.slow
@pytest.mark.parametrize(("setup_with", "env", "how"), [
    ("auto", {"CC": "false"}, "pip-editable"),  # pip; the optional C resampler fails to build: still installed
    ("hook", {}, "path-hook"),  # where pip cannot install: the path hook
])
def test_setup_makes_vlmq_importable_in_a_bare_copy(bare, tmp_path, setup_with, env, how):
    tree, python = bare
    imports = [str(python), "-c", "import vlmq.workers, vlmq.kernels; print(vlmq.kernels.__file__)"]
    assert subprocess.run(imports, cwd=tree / "scripts", capture_output=True).returncode != 0  # bare
    out = tmp_path / "out"
    result = run_check("--setup-only", root=tree, timeout=240,
                       env={"PY": str(python), "OUT": str(out), "SETUP_WITH": setup_with, **env})
    assert result.returncode == 0, result.stdout[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["setup"]["vlmq"] == how and summary["env"]["image_processor"] == "Qwen2VLImageProcessorPil"
    assert summary["env"]["c_resampler"] is False and "preflight: ok" in (out / "gpu_check.log").read_text()
    where = subprocess.run(imports, cwd=tree / "scripts", capture_output=True, text=True, check=True).stdout
    assert Path(where.strip()) == tree / "kernels" / "__init__.py"
