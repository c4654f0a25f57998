"""From a checkout's root, with Hugging Face's ``kernels`` installed (transformers 5.25 depends on it): our
kernels/ folder never shadows it, every model family imports, and a worker started there answers a job.

Before vlmq/_toplevel.py, ``python -m ...`` from the root put the root first on sys.path, transformers' ``from
kernels import CUDAProperties`` found our kernels/ folder, no model module imported, and `vlmq demo` hung.
"""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
from test_pool import png
from workerproc import TINY_CLASSES, WorkerProcess

from vlmq.client import Client
from vlmq.settings import Settings

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
FAMILY_MODULES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl", "llava_next"]


@pytest.fixture(scope="module", autouse=True)
def hf_kernels_installed() -> None:
    """The package our folder could shadow, in this environment (the test extra lists it; a bare one gets it)."""
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "kernels"], check=True, timeout=600)


def test_every_family_imports_from_the_repo_root_beside_hf_kernels() -> None:
    code = ("import importlib, kernels, transformers.integrations.hub_kernels, vlmq.kernels; "
            f"[importlib.import_module('vlmq.workers.models.' + m) for m in {FAMILY_MODULES!r}]; "
            "import vlmq.workers.models.processor; "
            "print(kernels.__file__); print(vlmq.kernels.__file__); print(hasattr(kernels, 'CUDAProperties'))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    hf_file, ours, has_api = run.stdout.split()
    assert "site-packages" in Path(hf_file).parts, hf_file  # Hugging Face's package, not our folder
    assert Path(ours) == ROOT / "kernels" / "__init__.py"
    assert has_api == "True"


def test_top_level_workers_reads_as_a_bare_directory_to_transformers_probe() -> None:
    """No package ``workers`` is installed, so this is the path an environment without Hugging Face's ``kernels``
    takes for ``kernels`` (seen on the GPU machine: transformers' probe found our folder, found no metadata, imported
    it, and our folder's ModuleNotFoundError escaped the probe and every model import)."""
    code = ("from transformers.utils.import_utils import _is_package_available; "
            "print(_is_package_available('workers', return_version=True)); "
            "import workers; print(workers.__file__)\n"
            "try:\n from workers import celery_app\nexcept ImportError as e:\n print('refused:', e)")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines() == ["(False, 'N/A')", "None",
                                       "refused: cannot import name 'celery_app' from 'workers' (unknown location)"]


def test_a_worker_started_from_the_repo_root_answers_a_job(redis_url: str, tmp_path: Path) -> None:
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    settings = Settings(broker_url=redis_url, storage_url=f"file://{tmp_path / 'storage'}", cost_classes=TINY_CLASSES)
    worker = WorkerProcess(settings, tmp_path / "worker.log", cwd=ROOT)
    try:
        worker.wait_ready()
        with Client(settings=settings) as client:
            result = client.submit(png(320, 240, 3), "Describe the image.", max_new_tokens=32).result(timeout=120)
        assert result.text.strip()
        assert result.usage["generated_tokens"] > 0
    finally:
        worker.stop()
    assert "ImportError" not in worker.log()
