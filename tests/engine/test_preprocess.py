"""Our image preprocessing against transformers' Qwen2-VL image processor, bit for bit, on both paths: the C
resampler (native) and PIL's resize (the fallback where the extension is not built)."""

import dataclasses
import functools
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vlmq.cost import ResolutionPolicy
from vlmq.images import decode
from vlmq.workers.engine import resample
from vlmq.workers.engine.preprocess import NATIVE, ImagePreprocessor

PATHS = [  # the `native` argument of ImagePreprocessor
    pytest.param(True, id="native", marks=pytest.mark.skipif(not NATIVE, reason=f"no C resampler: {resample.REASON}")),
    pytest.param(False, id="pil"),
]
SIZES = [  # (width, height): tiny, odd, extreme aspect ratios, exact multiples (no resize), up- and downscales,
    # multiples of 28 that are still resized (over max_pixels), heights that shrink far more than widths
    # (Pillow 13 runs its vertical pass first there)
    (1, 1), (2, 1), (1, 3), (13, 97), (33, 71), (56, 56), (28, 1400), (1500, 30), (101, 103), (448, 448),
    (640, 480), (777, 333), (1000, 1000), (1344, 1008), (1120, 1120), (1920, 1080), (200, 3000), (700, 2900),
    (4032, 3024),
]  # fmt: skip
RANDOM_SIZES = [tuple(int(v) for v in s) for s in np.random.default_rng(7).integers(2, 2600, size=(8, 2))]
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


def reference(images, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 1280):
    proc = Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
    out = proc(images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


@functools.lru_cache(maxsize=1)  # the two paths of one case run back to back and share it
def photo_reference(w: int, h: int, seed: int, min_pixels: int, max_pixels: int):
    return reference([photo(w, h, seed)], min_pixels, max_pixels)


def ours(min_pixels: int, max_pixels: int, native: bool) -> ImagePreprocessor:
    return ImagePreprocessor(ResolutionPolicy(min_pixels=min_pixels, max_pixels=max_pixels), native=native)


def assert_same(got: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor], what) -> None:
    assert torch.equal(got[1], expected[1]), what
    assert got[0].dtype == torch.float32 and torch.equal(got[0], expected[0]), what


CASES = [(*SETTINGS[0], size) for size in SIZES + RANDOM_SIZES]
CASES += [(*setting, size) for setting in SETTINGS[1:] for size in SIZES[::2] + RANDOM_SIZES[::2]]
CASE_IDS = [f"{a}-{b}-{w}x{h}" for a, b, (w, h) in CASES]


@pytest.mark.parametrize("native", PATHS)  # innermost: both paths of a case run one after the other
@pytest.mark.parametrize(("min_pixels", "max_pixels", "size"), CASES, ids=CASE_IDS)
def test_bit_for_bit_over_sizes(min_pixels, max_pixels, size, native):
    w, h = size
    seed = w * 7 + h
    expected = photo_reference(w, h, seed, min_pixels, max_pixels)
    assert_same(ours(min_pixels, max_pixels, native)([photo(w, h, seed)]), expected, size)


@pytest.mark.skipif(not NATIVE, reason=f"no C resampler: {resample.REASON}")
@pytest.mark.parametrize("kernels", ["avx2", "portable"])
def test_native_resize_equals_pil_resize_over_random_sizes(kernels):
    """The C resize alone against PIL's, on random sizes from 1 pixel up: both pass orders, every span width,
    with each set of kernels."""
    default = resample.kernels()
    if kernels == "avx2" and default != "avx2":
        pytest.skip("this CPU has no AVX2")
    rng = np.random.default_rng(11)
    sizes = [((w, h), (ow, oh)) for w, h, ow, oh in rng.integers(1, 160, size=(400, 4)).tolist()]
    sizes += [((40, 30), (80, 15)), ((82, 93), (67, 62)), ((50, 60), (40, 40)), ((3, 900), (2, 30))]
    sizes += [((1500, 9), (37, 300)), ((9, 1500), (300, 37)), ((640, 480), (644, 476)), ((1920, 1080), (1316, 728))]
    try:
        resample.kernels(kernels)
        for (w, h), (ow, oh) in sizes:
            rgb = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            expected = np.asarray(Image.fromarray(rgb).resize((ow, oh), Image.Resampling.BICUBIC))
            assert np.array_equal(resample.resize(rgb, (oh, ow)), expected), ((w, h), (ow, oh))
    finally:
        resample.kernels(default)


@pytest.mark.parametrize("native", PATHS)
def test_batch_numpy_input_and_threads_match(native):
    images = [photo(w, h, seed=10 + i) for i, (w, h) in enumerate([(640, 480), (33, 71), (1000, 1000), (300, 500)])]
    expected = reference(images)
    pre = ImagePreprocessor(native=native)
    assert_same(pre(images), expected, "PIL")
    assert_same(pre([np.asarray(im) for im in images]), expected, "numpy")
    assert_same(pre([np.asarray(im.convert("RGBA"))[..., :3] for im in images]), expected, "strided numpy")
    with ThreadPoolExecutor(3) as pool:
        assert_same(pre(images, executor=pool), expected, "threads")
    pixels, grid = pre([])
    assert pixels.shape == (0, 3 * 2 * 14 * 14) and grid.shape == (0, 3)


def encoded(img: Image.Image, fmt: str, **save) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save)
    return buf.getvalue()


def with_transparency(src: Image.Image) -> Image.Image:
    p = src.convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    p.info["transparency"] = 3
    return p


MODES = {  # mode -> (image in that mode, format): transformers converts these to RGB the way vlmq.images.decode does
    "L": (lambda s: s.convert("L"), "PNG"),
    "LA": (lambda s: s.convert("LA"), "PNG"),
    "RGBA": (lambda s: s.convert("RGBA"), "PNG"),
    "P": (lambda s: s.convert("P"), "PNG"),
    "P+transparency": (with_transparency, "PNG"),
    "CMYK": (lambda s: s.convert("CMYK"), "JPEG"),
    "1": (lambda s: s.convert("1"), "PNG"),
    "RGB JPEG": (lambda s: s, "JPEG"),
}


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("mode", list(MODES))
def test_modes_decoded_by_us_match_transformers_on_the_raw_image(mode, native):
    """Bytes in: our decode + preprocess gives what transformers gives when handed the opened image."""
    make, fmt = MODES[mode]
    src = photo(150, 110, seed=3)
    alpha = Image.fromarray(np.linspace(0, 255, 150 * 110).reshape(110, 150).astype(np.uint8))
    if mode in ("LA", "RGBA"):
        src.putalpha(alpha)  # a real alpha ramp, so compositing on white matters
    data = encoded(make(src), fmt)
    rgb = decode(data)
    assert rgb.mode == "RGB"
    assert_same(ImagePreprocessor(native=native)([rgb]), reference([Image.open(io.BytesIO(data))]), mode)


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_rotated_jpeg_matches_transformers_on_the_upright_image(orientation, native):
    """transformers ignores EXIF orientation; we apply it at decode, so we match it on the transposed image."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encoded(photo(160, 90, seed=5), "JPEG", exif=exif)
    rgb = decode(data)
    assert rgb.size == ((90, 160) if orientation in (6, 8) else (160, 90))
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    assert_same(ImagePreprocessor(native=native)([rgb]), reference([upright]), orientation)


@pytest.mark.parametrize("native", PATHS)
def test_16_bit_grey_is_scaled_at_decode_then_matches_transformers(native):
    """16-bit grey is scaled v/257 at decode (transformers would clip it); on that RGB image we match exactly."""
    grey = (np.linspace(0, 65535, 130 * 90).reshape(90, 130)).astype(np.uint16)
    rgb = decode(encoded(Image.fromarray(grey), "PNG"))
    assert rgb.mode == "RGB" and np.asarray(rgb)[-1, -1, 0] == 255
    assert_same(ImagePreprocessor(native=native)([rgb]), reference([rgb]), "I;16")


@pytest.mark.parametrize("native", PATHS)
def test_settings_from_preprocessor_config_and_bad_input(native):
    pre = ImagePreprocessor.from_preprocessor_config(
        {"size": {"shortest_edge": 3136, "longest_edge": 50176}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
         "rescale_factor": 1 / 127.5}
    )
    img = photo(500, 400, seed=4)
    proc = Qwen2VLImageProcessorPil(size={"shortest_edge": 3136, "longest_edge": 50176}, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, rescale_factor=1 / 127.5)  # fmt: skip
    ref = proc([img], return_tensors="pt")
    pre = dataclasses.replace(pre, native=native)
    assert_same(pre([img]), (ref["pixel_values"], ref["image_grid_thw"]), "config")
    with pytest.raises(ValueError, match="RGB"):
        pre([img, img.convert("L")])
    with pytest.raises(ValueError, match="uint8"):
        pre([np.zeros((10, 10, 4), dtype=np.uint8)])
    with pytest.raises(ValueError, match="do_normalize"):
        ImagePreprocessor.from_preprocessor_config({"do_normalize": False})
