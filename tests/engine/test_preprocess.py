"""Our image preprocessing against transformers' Qwen2-VL image processor, bit for bit."""

import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from vlmq.workers.engine.preprocess import ImagePreprocessor

from vlmq.cost import ResolutionPolicy
from vlmq.images import decode

SIZES = [  # (width, height): tiny, odd, extreme aspect ratios, exact multiples (no resize), up- and downscales
    (1, 1), (13, 97), (33, 71), (56, 56), (28, 1400), (1500, 30), (101, 103), (448, 448), (640, 480),
    (777, 333), (1000, 1000), (1344, 1008), (1920, 1080),
]  # fmt: skip
SETTINGS = [  # (min_pixels, max_pixels): the class defaults, then smaller and larger budgets
    (56 * 56, 28 * 28 * 1280),
    (28 * 28 * 4, 28 * 28 * 64),
    (28 * 28 * 256, 28 * 28 * 2048),
]


def photo(w: int, h: int, seed: int) -> Image.Image:
    # smooth gradients plus noise: resize filters see both flat areas and edges, values cover 0..255
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / max(w - 1, 1), yy * 255 / max(h - 1, 1), (xx + yy) % 256], axis=-1)
    return Image.fromarray(np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8))


def reference(images, min_pixels: int, max_pixels: int) -> tuple[torch.Tensor, torch.Tensor]:
    proc = Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
    out = proc(images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def ours(min_pixels: int, max_pixels: int) -> ImagePreprocessor:
    return ImagePreprocessor(ResolutionPolicy(min_pixels=min_pixels, max_pixels=max_pixels))


@pytest.mark.parametrize(
    ("min_pixels", "max_pixels", "sizes"), [(*SETTINGS[0], SIZES), *[(*s, SIZES[::2]) for s in SETTINGS[1:]]]
)
def test_bit_for_bit_over_sizes(min_pixels, max_pixels, sizes):
    pre = ours(min_pixels, max_pixels)
    for i, (w, h) in enumerate(sizes):
        img = photo(w, h, seed=i)
        pixels, grid = pre([img])
        ref_pixels, ref_grid = reference([img], min_pixels, max_pixels)
        assert torch.equal(grid, ref_grid), (w, h)
        assert pixels.dtype == torch.float32 and torch.equal(pixels, ref_pixels), (w, h)


def test_batch_numpy_input_and_threads_match():
    images = [photo(w, h, seed=10 + i) for i, (w, h) in enumerate([(640, 480), (33, 71), (1000, 1000), (300, 500)])]
    ref_pixels, ref_grid = reference(images, 56 * 56, 28 * 28 * 1280)
    pre = ImagePreprocessor()
    for got in (pre(images), pre([np.asarray(im) for im in images])):
        assert torch.equal(got[0], ref_pixels) and torch.equal(got[1], ref_grid)
    with ThreadPoolExecutor(2) as pool:
        pixels, grid = pre(images, executor=pool)
    assert torch.equal(pixels, ref_pixels) and torch.equal(grid, ref_grid)


@pytest.mark.parametrize("mode", ["L", "LA", "RGBA", "P", "I;16", "CMYK", "1"])
def test_other_modes_after_intake_canonicalisation(mode):
    """Every mode reaches the engine as canonical RGB (vlmq.images.decode); on that we match transformers."""
    src = photo(150, 110, seed=3)
    img = src.convert("L").convert("I;16") if mode == "I;16" else src.convert(mode)
    buf = io.BytesIO()
    img.save(buf, format="JPEG" if mode == "CMYK" else "PNG")
    rgb = decode(buf.getvalue())
    assert rgb.mode == "RGB"
    pixels, grid = ImagePreprocessor()([rgb])
    ref_pixels, ref_grid = reference([rgb], 56 * 56, 28 * 28 * 1280)
    assert torch.equal(pixels, ref_pixels) and torch.equal(grid, ref_grid)


def test_settings_from_preprocessor_config_and_bad_input():
    pre = ImagePreprocessor.from_preprocessor_config(
        {"size": {"shortest_edge": 3136, "longest_edge": 50176}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    )
    img = photo(500, 400, seed=4)
    proc = Qwen2VLImageProcessorPil(size={"shortest_edge": 3136, "longest_edge": 50176}, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3)  # fmt: skip
    ref = proc([img], return_tensors="pt")
    pixels, grid = pre([img])
    assert torch.equal(pixels, ref["pixel_values"]) and torch.equal(grid, ref["image_grid_thw"])
    with pytest.raises(ValueError, match="RGB"):
        pre([img.convert("L")])
    with pytest.raises(ValueError, match="do_normalize"):
        ImagePreprocessor.from_preprocessor_config({"do_normalize": False})
