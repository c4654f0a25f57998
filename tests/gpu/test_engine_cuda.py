"""The engine on CUDA against transformers on CUDA, greedy, on the bundled (trained) model: 100 held-out prompts
plus same-image questions (the cascade path).

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
from tiny.shapes import make_split, questions

from vlmq.workers.engine.device_defaults import default_block_size, flash_attn_installed
from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.models.processor import load_processor, render_prompt

TARGET = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny-shapes"
TEST_SEED = 9  # held out from training
MAX_NEW = 32
BF16_MIN_MATCH = 0.95

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    return Path(shutil.copytree(TARGET, tmp_path_factory.mktemp("m") / "tiny-shapes"))


@pytest.fixture(scope="module")
def workload():
    examples = make_split(TEST_SEED, 100)
    prompts = [(e.image, e.question) for e in examples]
    for e in examples[:16]:  # the same image asked again: shared image prefixes decode together (cascade)
        prompts += [(e.image, q) for q, _ in questions(e.scene) if q != e.question][:3]
    return prompts


def transformers_greedy(model_dir: Path, workload, dtype: torch.dtype) -> list[list[int]]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    model = model.to("cuda").eval()
    processor = load_processor(model_dir)
    eos = model.generation_config.eos_token_id
    out = []
    for image, question in workload:
        inputs = processor(text=[render_prompt(processor, question)], images=[image], return_tensors="pt").to("cuda")
        with torch.inference_mode():
            ids = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
        completion = ids[0, inputs["input_ids"].shape[1]:].tolist()
        out.append(completion[:-1] if completion and completion[-1] == eos else completion)
    del model
    torch.cuda.empty_cache()
    return out


@pytest.fixture(scope="module")
def reference(model_dir, workload):
    return {dtype: transformers_greedy(model_dir, workload, dtype) for dtype in (torch.float32, torch.bfloat16)}


def engine_greedy(model_dir: Path, workload, dtype: torch.dtype, **config) -> list[list[int]]:
    engine = Engine.from_model_dir(model_dir, "cuda", dtype=dtype, **config)
    try:
        outputs = engine.generate([Request(img, q, MAX_NEW) for img, q in workload], prepare_all_first=True)
    finally:
        engine.close()
    assert all(o.error is None for o in outputs)
    return [o.token_ids for o in outputs]


def match_rate(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


# default: 256-token blocks (flash-attn paged prefill where installed), CUDA graphs on
# block16: small blocks, so same-image decodes share whole cached blocks: the cascade kernel; torch-path prefill
# no_graphs: the eager decode path
CONFIGS = {"default": {}, "block16": {"block_size": 16}, "no_graphs": {"cuda_graph_max_seqs": 0}}


def sized(name: str) -> dict:
    block_size = CONFIGS[name].get("block_size", default_block_size("cuda", flash_attn_installed()))
    return dict(CONFIGS[name], num_blocks=65536 // block_size)  # 64 Ki tokens of KV


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_float32_greedy_equals_transformers_on_every_prompt(model_dir, workload, reference, name):
    tokens = engine_greedy(model_dir, workload, torch.float32, **sized(name))
    assert match_rate(tokens, reference[torch.float32]) == 1.0


@pytest.mark.parametrize("name", sorted(CONFIGS))
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
