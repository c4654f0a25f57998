"""scripts/bench_kernels_gpu.py parses, runs its CPU smoke mode and writes the JSON it promises."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_kernels_gpu.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_kernels_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_writes_decode_and_cascade_tables(tmp_path, capsys):
    # The torch reference keeps this quick; the kernels themselves are tested in the other files.
    out = tmp_path / "bench.json"
    load_script().main(["--dry-run", "--impl", "torch", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["dry_run"] is True and result["impl"] == "torch" and result["complete"] is True
    assert {"batch", "context_len", "bandwidth_gbs", "frac_of_peak", "speedup_vs_sdpa"} <= set(result["decode"][0])
    cascade = result["cascade"][0]
    assert {"prefix_len", "group_size", "speedup", "max_abs_diff"} <= set(cascade)
    assert cascade["max_abs_diff"] < 1e-5  # cascade and per-sequence decode agree (float32)
    assert "shared-prefix" in capsys.readouterr().out


def test_gpu_mode_without_a_gpu_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--dry-run"):
        load_script().main(["--out", str(tmp_path / "x.json")])


def test_a_run_stopped_midway_keeps_the_rows_it_measured(tmp_path):
    # as when gpu_check.sh's time limit stops it: the cascade rows (measured first) are on disk
    out = tmp_path / "bench.json"
    script = load_script()

    def stopped(*args):
        raise KeyboardInterrupt

    script.decode_row = stopped
    with pytest.raises(KeyboardInterrupt):
        script.main(["--dry-run", "--impl", "torch", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["complete"] is False and result["decode"] == [] and len(result["cascade"]) == 1
