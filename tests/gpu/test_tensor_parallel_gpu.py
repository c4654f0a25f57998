"""Tensor parallelism over NCCL, one GPU per rank: the sharded language model's logits equal the whole model's on
the same GPU kind, and greedy tokens are the same (the CPU test's program, tests/engine/tp_rank.py, with
TP_DEVICE=cuda). Marked `gpu`; skipped, saying why, on a machine with fewer than 2 GPUs. scripts/gpu_check.sh runs
it as its `tp` step."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from test_tensor_parallel import TINY, run_group, tolerance  # noqa: E402
from tiny.internvl import build_internvl  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 2, reason=f"needs 2 or more CUDA devices; {GPUS} here")]


def test_nccl_shards_give_the_whole_models_logits_and_tokens(tmp_path: Path) -> None:
    folders = [Path(shutil.copytree(TINY, tmp_path / "tiny-shapes")), build_internvl(tmp_path / "internvl")]
    for size in sorted({2, min(4, GPUS)}):
        ranks = run_group(folders, size, tmp_path / f"tp{size}", device="cuda")
        for folder in map(str, folders):
            for out in (r[folder] for r in ranks):
                assert out["max_diff"] <= tolerance(out["max_logit"]), (size, folder, out["max_diff"])
                assert out["tp"] == out["whole"] and out["loaded_as_cut"], (size, folder)
