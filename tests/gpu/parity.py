"""The greedy parity harness of test_engine_cuda.py, on any device: the workload, transformers' `generate` one
prompt at a time, the engine on the same prompts, and the engine configurations compared.

test_parity_harness.py runs it on the CPU, so the one GPU run cannot be lost to an API slip in the harness itself.
"""
from __future__ import annotations

from pathlib import Path

import torch
from tiny.shapes import make_split, questions

from vlmq.workers.engine.device_defaults import default_block_size, flash_attn_installed
from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.models.processor import load_processor, render_prompt

TARGET = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny-shapes"
TEST_SEED = 9  # held out from training
MAX_NEW = 32


def make_workload(num_prompts: int = 100, num_shared: int = 16) -> list[tuple]:
    """`num_prompts` held-out (image, question) pairs, then up to 3 more questions on each of the first
    `num_shared` images: shared image prefixes decode together (the cascade path)."""
    examples = make_split(TEST_SEED, num_prompts)
    prompts = [(e.image, e.question) for e in examples]
    for e in examples[:num_shared]:
        prompts += [(e.image, q) for q, _ in questions(e.scene) if q != e.question][:3]
    return prompts


def transformers_greedy(model_dir: Path, workload, dtype: torch.dtype, device: str = "cuda") -> list[list[int]]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    model = model.to(device).eval()
    processor = load_processor(model_dir)
    assert processor.image_processor.backend == "pil"  # the engine's pixels (test_processor_choice.py)
    eos = model.generation_config.eos_token_id
    out = []
    for image, question in workload:
        inputs = processor(text=[render_prompt(processor, question)], images=[image], return_tensors="pt").to(device)
        with torch.inference_mode():
            ids = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
        completion = ids[0, inputs["input_ids"].shape[1]:].tolist()
        out.append(completion[:-1] if completion and completion[-1] == eos else completion)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def engine_greedy(model_dir: Path, workload, dtype: torch.dtype, device: str = "cuda",
                  **config) -> list[list[int]]:
    engine = Engine.from_model_dir(model_dir, device, dtype=dtype, **config)
    try:
        outputs = engine.generate([Request(img, q, MAX_NEW) for img, q in workload], prepare_all_first=True)
    finally:
        engine.close()
    assert all(o.error is None for o in outputs)
    return [o.token_ids for o in outputs]


def match_rate(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def cuda_block_size() -> int:
    return default_block_size("cuda", flash_attn_installed())


# default: the CUDA defaults (256-token blocks with flash-attn's paged prefill where installed, else 16), graphs on
# other_block: 16 where the default is 256 (same-image decodes share whole cached blocks: the cascade kernel), else
#   256 (the Triton decode kernel over large blocks; torch-path prefill)
# no_graphs: the eager decode path
CONFIGS = {"default": {}, "other_block": {"block_size": 16 if cuda_block_size() == 256 else 256},
           "no_graphs": {"cuda_graph_max_seqs": 0}}


def sized(name: str) -> dict:
    block_size = CONFIGS[name].get("block_size", cuda_block_size())
    return dict(CONFIGS[name], block_size=block_size, num_blocks=65536 // block_size)  # 64 Ki tokens of KV
