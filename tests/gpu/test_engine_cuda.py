"""The engine on CUDA against transformers on CUDA, greedy, on the bundled (trained) model: 100 held-out prompts
plus same-image questions (the cascade path). The harness is parity.py (checked on CPU by test_parity_harness.py).

- float32 (TF32 off on both sides): every prompt's tokens equal transformers'.
- bfloat16: at least 95% of prompts equal transformers' bf16 tokens. bf16 rounds differently in a different
  kernel order (paged split-KV decode, flash-attn varlen vs transformers' SDPA), so a near-tie between the two
  best logits can flip one token and everything after it; the trained model keeps such ties rare.

Marked `gpu` and skipped without CUDA; scripts/gpu_check.sh runs them.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from parity import CONFIGS, MAX_NEW, TARGET, engine_greedy, make_workload, match_rate, sized, transformers_greedy

from vlmq.workers.engine.engine import Engine, Request

BF16_MIN_MATCH = 0.95

# per test: the first one also builds the transformers reference (2 x 148 generate calls)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    return Path(shutil.copytree(TARGET, tmp_path_factory.mktemp("m") / "tiny-shapes"))


@pytest.fixture(scope="module")
def workload():
    return make_workload()


@pytest.fixture(scope="module")
def reference(model_dir, workload):
    return {dtype: transformers_greedy(model_dir, workload, dtype) for dtype in (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_float32_greedy_equals_transformers_on_every_prompt(model_dir, workload, reference, name):
    tokens = engine_greedy(model_dir, workload, torch.float32, **sized(name))
    assert match_rate(tokens, reference[torch.float32]) == 1.0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bfloat16_greedy_matches_transformers_bf16_on_95_percent(model_dir, workload, reference, name):
    rate = match_rate(engine_greedy(model_dir, workload, torch.bfloat16, **sized(name)), reference[torch.bfloat16])
    print(f"bf16 {name}: {rate:.1%} of prompts equal transformers")
    assert rate >= BF16_MIN_MATCH


def test_kv_cache_sized_from_free_memory_after_profiling(model_dir, workload, reference):
    engine = Engine.from_model_dir(model_dir, "cuda", kv_cache_memory_fraction=0.3, max_model_len=4096)
    try:
        assert engine.config.num_blocks * engine.config.block_size >= 4096
        assert engine.runner.kv_caches[0][0].dtype is torch.bfloat16  # the CUDA default
        outputs = engine.generate([Request(img, q, MAX_NEW) for img, q in workload[:8]])
    finally:
        engine.close()
    assert all(o.error is None and o.token_ids for o in outputs)
