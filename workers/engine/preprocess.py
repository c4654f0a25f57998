"""Fast Qwen2-VL image preprocessing, bit for bit equal to transformers' `Qwen2VLImageProcessor`.

The reference (`Qwen2VLImageProcessorPil`) copies the image to numpy and back to PIL, resizes with PIL bicubic to
`smart_resize`'s size, rescales in float64 (`uint8 * 1/255`, cast to float32), normalises in float32
(`(x - mean) / std`, on a transposed view), patchifies with a numpy reshape copy and concatenates. The per-pixel
arithmetic depends only on (channel, byte value), so we tabulate it once: a 3×256 float32 table built with exactly
those numpy operations.

Two paths give the same bits. The native one (the default where the C extension is built; `NATIVE` says which is
active, resample.py why) does an image in one C call with the GIL released: Pillow's two-pass bicubic resize
redone exactly (same 22-bit fixed-point weights, same 8-bit intermediate, same choice of first pass; AVX2 where
the CPU has it), then, one band of patch*merge output rows at a time, the table lookup and the patch order,
written straight into the batch's output buffer. The fallback (`native=False`) does PIL's resize, then per band
the lookup with numpy (float32 planes that stay in cache) and a strided copy into patch order.

Where the time goes (scripts/bench_preprocess.py measures it against transformers; figures in docs/benchmarks.md):
in the native path the C call dominates (the resize about half of it, most of the rest writing the float32 output
into fresh pages); allocating that output and copying the PIL image out are the rest. The fallback is capped by
PIL's scalar resize (the bench prints that ceiling). More throughput comes from images in parallel (an executor):
the C call, PIL's resize and numpy's take and copyto all release the GIL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlmq.cost import ResolutionPolicy, smart_resize

from . import resample

NATIVE = resample.AVAILABLE  # the path ImagePreprocessor takes by default: C resampler (True) or PIL's resize
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # transformers' OPENAI_CLIP_MEAN / _STD, the class defaults
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True, slots=True)
class ImagePreprocessor:
    """Settings of a Qwen2-VL-style image processor; `__call__` turns RGB images into model inputs."""

    policy: ResolutionPolicy = ResolutionPolicy()
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    rescale_factor: float = 1 / 255
    native: bool = NATIVE  # resize, lookup and patchify in one C pass; False: PIL's resize, then numpy
    _table: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError("image_mean and image_std need one value per RGB channel")
        if self.native and not resample.AVAILABLE:
            raise ValueError(f"the C resampler is unavailable ({resample.REASON}); pass native=False")
        object.__setattr__(self, "_table", _value_table(self.rescale_factor, self.image_mean, self.image_std))

    @classmethod
    def from_preprocessor_config(cls, config: Mapping[str, Any]) -> ImagePreprocessor:
        """From a `preprocessor_config.json` dict (resize, rescale and normalise settings; others ignored)."""
        return cls(policy=ResolutionPolicy.from_preprocessor_config(config), **pixel_settings(config))

    @property
    def patch_dim(self) -> int:
        """Values per patch row: 3 channels × temporal_patch_size frames × patch_size²."""
        return 3 * self.policy.temporal_patch_size * self.policy.patch_size**2

    def __call__(
        self, images: Sequence[Image.Image | np.ndarray], executor: Executor | None = None,
        policies: Sequence[ResolutionPolicy] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RGB images (PIL mode "RGB" or uint8 arrays [H, W, 3]) -> pixel_values [P, 3*Tp*p*p] float32 and
        image_grid_thw [N, 3] int64, as the transformers processor returns them for the same images.

        Every image is checked before any work starts. With an executor, images are processed in parallel, each
        writing its own rows of one output buffer (no concatenation copy). ``policies``: each image's own pixel
        bounds (``vlmq.resolution.image_policy``; the same patch sizes as ``policy``), else ``policy``'s."""
        checked = [_checked_rgb(image) for image in images]
        each = policies if policies is not None else [self.policy] * len(checked)
        sizes = [smart_resize(*_height_width(image), pol) for image, pol in zip(checked, each, strict=True)]
        p = self.policy.patch_size
        grid = torch.tensor([(1, h // p, w // p) for h, w in sizes], dtype=torch.int64).view(-1, 3)
        ends = np.cumsum([0] + [h * w // (p * p) for h, w in sizes]).tolist()
        out = np.empty((ends[-1], self.patch_dim), dtype=np.float32)
        jobs = list(zip(checked, sizes, [out[a:b] for a, b in pairwise(ends)], strict=True))
        if executor is None:
            for job in jobs:
                self._fill(job)
        else:
            list(executor.map(self._fill, jobs))  # list() waits for all and re-raises the first error
        return torch.from_numpy(out), grid

    def _fill(self, job: tuple[Image.Image | np.ndarray, tuple[int, int], np.ndarray]) -> None:
        image, size, rows = job
        if self.native:  # one C pass, GIL released: resize, table lookup, patch order
            p = self.policy
            resample.resize_patches(np.asarray(image), size, self._table, rows, p.patch_size, p.merge_size,
                                    p.temporal_patch_size)  # fmt: skip
        else:
            self.to_patches(self.resize(image, size), out=rows)

    def resize(self, image: Image.Image | np.ndarray, size: tuple[int, int] | None = None) -> np.ndarray:
        """The reference's resize: PIL bicubic to (height, width), by default smart_resize's. -> uint8 [h, w, 3]."""
        image = _checked_rgb(image)
        height, width = size or smart_resize(*_height_width(image), self.policy)
        if (height, width) == _height_width(image):  # PIL would return a copy; the reference resizes anyway
            return np.asarray(image)
        if self.native:
            return resample.resize(np.asarray(image), (height, width))
        pil = image if isinstance(image, Image.Image) else Image.fromarray(image)
        return np.asarray(pil.resize((width, height), resample=Image.Resampling.BICUBIC))

    def to_patches(self, rgb: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """uint8 [h, w, 3] (sides multiples of patch*merge) -> float32 [gh*gw, 3*Tp*p*p] (written into `out` if
        given): `normalize` then `patchify`, one band of patch*merge rows at a time, so the band's float planes
        stay in cache between the two and memory traffic is about the output alone."""
        band = self.policy.patch_size * self.policy.merge_size
        h, w, _ = rgb.shape
        out = self._output(h, w) if out is None else out
        planes = np.empty((3, band, w), dtype=np.float32)  # reused for every band
        src = self._in_patch_order(planes)[0]  # [gw/m, m, m, 3, Tp, p, p], a view of planes
        dst = out.reshape(h // band, *src.shape)
        for i in range(h // band):
            self.normalize(rgb[i * band : (i + 1) * band], out=planes)
            np.copyto(dst[i], src)
        return out

    def normalize(self, rgb: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """uint8 [h, w, 3] -> float32 planes [3, h, w]: the reference's rescale and normalise, by table lookup."""
        out = np.empty((3, *rgb.shape[:2]), dtype=np.float32) if out is None else out
        for c in range(3):
            np.take(self._table[c], rgb[..., c], out=out[c], mode="clip")
        return out

    def patchify(self, planes: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """float32 planes [3, h, w] (sides multiples of patch*merge) -> [gh*gw, 3*Tp*p*p] in one strided copy
        (written into `out` if given)."""
        _, h, w = planes.shape
        out = self._output(h, w) if out is None else out
        src = self._in_patch_order(planes)
        np.copyto(out.reshape(src.shape), src)
        return out

    def _in_patch_order(self, planes: np.ndarray) -> np.ndarray:
        """[3, h, w] -> a view [gh/m, gw/m, m, m, 3, Tp, p, p] (frame broadcast, nothing copied): the processor's
        row order (merge×merge blocks row-major, patches row-major inside a block), each patch's values
        channel-major, the frame repeated Tp times."""
        p, m, tp = self.policy.patch_size, self.policy.merge_size, self.policy.temporal_patch_size
        _, h, w = planes.shape
        src = planes.reshape(3, h // (m * p), m, p, w // (m * p), m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        return np.broadcast_to(src[:, :, :, :, :, None], (*src.shape[:5], tp, p, p))

    def _output(self, h: int, w: int) -> np.ndarray:
        return np.empty((h * w // self.policy.patch_size**2, self.patch_dim), dtype=np.float32)


def pixel_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """image_mean, image_std and rescale_factor of a `preprocessor_config.json` dict (those it sets), after checking
    that it resizes bicubic, rescales and normalises, the only pipeline the fast preprocessors reproduce."""
    for key, default in (("do_resize", True), ("do_rescale", True), ("do_normalize", True)):
        if config.get(key, default) is not True:
            raise ValueError(f"{key}=false is not supported by the fast preprocessor")
    if config.get("resample", 3) != 3:
        raise ValueError(f"resample {config['resample']} is not supported; the fast preprocessors are bicubic (3)")
    kw: dict[str, Any] = {}
    for key in ("image_mean", "image_std"):
        if config.get(key) is not None:
            kw[key] = tuple(float(v) for v in config[key])
    if config.get("rescale_factor") is not None:
        kw["rescale_factor"] = float(config["rescale_factor"])
    return kw


def _value_table(scale: float, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    # the reference's arithmetic on every byte value: float64 rescale, cast, float32 (x - mean) / std
    x = (np.arange(256, dtype=np.uint8).astype(np.float64) * scale).astype(np.float32)  # [256]
    table = (x[None, :] - np.array(mean, dtype=np.float32)[:, None]) / np.array(std, dtype=np.float32)[:, None]
    assert table.dtype == np.float32
    return np.ascontiguousarray(table)  # [3, 256]


def _checked_rgb(image: Image.Image | np.ndarray) -> Image.Image | np.ndarray:
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"expected a uint8 [H, W, 3] RGB array, got {image.dtype} {image.shape}")
    elif image.mode != "RGB":
        raise ValueError(f"expected an RGB image, got mode {image.mode!r}; canonicalise with vlmq.images.decode")
    return image


def _height_width(image: Image.Image | np.ndarray) -> tuple[int, int]:
    return (image.height, image.width) if isinstance(image, Image.Image) else image.shape[:2]
