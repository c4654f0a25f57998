"""scripts/bench_engine_gpu.py on CPU: its arguments, the 2B / 7B model shapes it builds, and a dry run that
writes the per-resolution table it promises."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_engine_gpu.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_engine_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_defaults_cover_both_models_four_resolutions_and_three_batch_sizes(bench):
    args = bench.parse_args([])
    assert args.models == ["2b", "7b"] and args.mixed_models == ["2b"]
    assert args.resolutions == [(256, 256), (448, 448), (1024, 1024), (1920, 1080)]
    assert args.batches == [1, 8, 64]
    assert args.out == "bench-results/gpu/engine.json"
    with pytest.raises(SystemExit):
        bench.parse_args(["--models", "2b,70b"])


@pytest.mark.parametrize(("name", "billions"), [("2b", 2.2), ("7b", 8.3)])
def test_model_shapes_have_the_published_parameter_counts(bench, name, billions):
    from transformers import Qwen2VLForConditionalGeneration

    with torch.device("meta"):  # shapes only, no memory
        model = Qwen2VLForConditionalGeneration._from_config(bench.model_config(name))
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.1)
    assert sum(bench.mrope_section(bench.SHAPES[name][0])) == 64  # head_dim 128 / 2 rotary frequencies


@pytest.mark.slow
def test_dry_run_writes_the_per_resolution_table(bench, tmp_path):
    out = tmp_path / "gpu" / "engine.json"
    bench.main(["--dry-run", "--out", str(out)])
    report = json.loads(out.read_text())["models"]["tiny"]
    assert report["complete"] is True
    assert [r["resolution"] for r in report["resolutions"]] == ["64x64", "112x84"]
    cell = report["resolutions"][0]["batches"]["2"]
    assert {"ttft_s", "prefill_tok_s", "decode_tok_s", "tok_s"} <= set(cell["engine"])
    assert cell["transformers"]["tok_s"] > 0 and cell["speedup"] > 0
    assert 0 < report["resolutions"][1]["vision_share_of_ttft"]
    assert report["mixed_captions"]["best_transformers_batch"] == 2


@pytest.mark.slow
def test_a_run_stopped_midway_keeps_the_mixed_captions_and_the_rows_it_measured(bench, tmp_path, monkeypatch):
    # as when gpu_check.sh's time limit stops it: what was measured before is on disk
    measured = bench.bench_resolution

    def stop_at_the_second(engine, hf, size, args, device):
        if size != args.resolutions[0]:
            raise KeyboardInterrupt
        return measured(engine, hf, size, args, device)

    monkeypatch.setattr(bench, "bench_resolution", stop_at_the_second)
    out = tmp_path / "engine.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--dry-run", "--out", str(out)])
    report = json.loads(out.read_text())["models"]["tiny"]
    assert report["complete"] is False and report["mixed_captions"]["engine"]["tok_s"] > 0
    assert [r["resolution"] for r in report["resolutions"]] == ["64x64"]
