"""Qwen3-VL image preprocessing (16-px patches, merge 2, temporal 2, mean/std 0.5) bit for bit against transformers'
PIL image processor, built the way the engine builds it: from the processor's own settings (`to_dict()`)."""

import functools

import numpy as np
import pytest
import torch
from test_preprocess import PATHS, photo
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vlmq.workers.engine.preprocess import ImagePreprocessor

# preprocessor_config.json of the Qwen3-VL checkpoints, then a smaller budget that makes most sizes downscale
QWEN3_VL = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                size={"shortest_edge": 65536, "longest_edge": 16777216})
SMALL = dict(QWEN3_VL, size={"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 256})
SIZES = [(1, 1), (3, 1), (31, 33), (32, 32), (64, 480), (255, 257), (1000, 37), (33, 2000), (640, 480)]
BIG = [(1280, 720), (1920, 1080)]  # downscaled in the small budget only (the reference takes seconds at full size)
RANDOM_SIZES = [tuple(int(v) for v in s) for s in np.random.default_rng(21).integers(2, 1600, size=(4, 2))]
CASES = [("qwen3_vl", size) for size in SIZES] + [("small", size) for size in SIZES + BIG + RANDOM_SIZES]


@functools.lru_cache(maxsize=1)  # the two paths of one case run back to back and share it
def reference(settings: str, size: tuple[int, int]):
    processor = Qwen2VLImageProcessorPil(**{"qwen3_vl": QWEN3_VL, "small": SMALL}[settings])
    image = photo(*size, seed=size[0] * 5 + size[1])
    return processor, image, processor([image], return_tensors="pt")


@pytest.mark.parametrize("native", PATHS)  # innermost
@pytest.mark.parametrize(("settings", "size"), CASES, ids=[f"{n}-{w}x{h}" for n, (w, h) in CASES])
def test_bit_for_bit(settings, size, native):
    processor, image, expected = reference(settings, size)
    ours = ImagePreprocessor.from_preprocessor_config(processor.to_dict())
    ours = ImagePreprocessor(ours.policy, ours.image_mean, ours.image_std, ours.rescale_factor, native=native)
    assert ours.policy.patch_size == 16 and ours.patch_dim == 3 * 2 * 16 * 16
    pixels, grid = ours([image])
    assert torch.equal(grid, expected["image_grid_thw"]), size
    assert pixels.dtype == torch.float32 and torch.equal(pixels, expected["pixel_values"]), size
