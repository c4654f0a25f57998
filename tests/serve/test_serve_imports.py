"""``vlmq serve`` is a producer: building its application imports no torch, transformers or worker code."""
from __future__ import annotations

import subprocess
import sys


def test_the_serve_app_imports_no_torch_and_no_worker_code() -> None:
    code = ("import sys; from vlmq.serve.app import create_app; from vlmq.settings import Settings; "
            "create_app(Settings()); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
            "or m.startswith('vlmq.workers')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
