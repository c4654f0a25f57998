"""Packaging: the SDK stays torch-free; workers/ and kernels/ install under the vlmq namespace."""
from __future__ import annotations

import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_sdk_does_not_import_torch() -> None:
    code = ("import sys, vlmq, vlmq.client, vlmq.cli, vlmq.demo, vlmq.storage, vlmq.cost, vlmq.images, vlmq.fleet, "
            "vlmq.up; "
            "bad = [m for m in ('torch', 'transformers', 'vlmq.workers', 'vlmq.kernels') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_editable_install_maps_workers_and_kernels_under_vlmq() -> None:
    code = "import vlmq.workers, vlmq.kernels; print(vlmq.workers.__file__); print(vlmq.kernels.__file__)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(ROOT / "workers" / "__init__.py"), str(ROOT / "kernels" / "__init__.py")]


@pytest.mark.slow
def test_wheel_has_no_generic_top_level_names_and_imports(tmp_path: Path) -> None:
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                            str(tmp_path), str(ROOT)], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    wheel = next(tmp_path.glob("vlmq-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"vlmq"}
    assert "vlmq/workers/assets/tiny-shapes/model.safetensors" in names
    assert "vlmq/demo_assets/samples.json" in names
    assert "vlmq/py.typed" in names
    # installed into a folder of its own and imported from there (dependencies from this environment): a nested
    # venv with --system-site-packages would see the base interpreter's packages, not this venv's
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True)
    code = (f"import sys; sys.path.insert(0, {str(target)!r}); "
            "import vlmq.workers.main, vlmq.kernels, vlmq.workers.backends; import os; "
            "print(os.path.dirname(vlmq.workers.__file__))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(target / "vlmq" / "workers")
    # the same install seen from a checkout's root (the root first on sys.path, the wheel after it, the editable
    # install's finder off: -S, site-packages on the path without its .pth files): vlmq is the checkout's, whole
    code = (f"import sys; sys.path[1:1] = [{str(target)!r}, *{site.getsitepackages()!r}]; "
            "import vlmq.workers.main, vlmq.kernels; "
            "print(vlmq.__file__); print(vlmq.workers.__file__); print(vlmq.kernels.__file__)")
    run = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(ROOT / d / "__init__.py") for d in ("vlmq", "workers", "kernels")]
