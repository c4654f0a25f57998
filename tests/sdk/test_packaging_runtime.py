"""The wheel is the runtime: the model folders a worker loads, and none of the tiny model's training code."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAINING = ("tiny", "train", "targets", "losses")  # scripts/tiny/ and its modules


def _imports(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


@pytest.mark.slow
def test_wheel_ships_the_model_folders_and_no_training_code(tmp_path: Path) -> None:
    # from a copy without build outputs: setuptools packs whatever an earlier build left in build/lib
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                                                 "*.so", ".venv", "bench-results"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                            str(tmp_path), str(source)], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    wheel = zipfile.ZipFile(next(tmp_path.glob("vlmq-*.whl")))
    modules = [n for n in wheel.namelist() if n.endswith(".py")]
    for folder in ("tiny-shapes", "tiny-shapes-draft"):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"):
            assert f"vlmq/workers/assets/{folder}/{name}" in wheel.namelist()
    shipped = [m for m in modules if set(Path(m).with_suffix("").parts) & set(TRAINING)]
    assert shipped == [], "training code in the wheel"
    for module in modules:
        imported = _imports(wheel.read(module).decode())
        assert not {n for n in imported if n.split(".")[0] == "tiny" or n.startswith("vlmq.workers.tiny")}, module
