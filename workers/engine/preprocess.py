"""Fast Qwen2-VL image preprocessing, bit for bit equal to transformers' `Qwen2VLImageProcessor`.

The reference (`Qwen2VLImageProcessorPil`) resizes with PIL bicubic to `smart_resize`'s size, then rescales
in float64 (`uint8 * 1/255`, cast to float32), normalises in float32 (`(x - mean) / std`) and patchifies.
The per-pixel part depends only on (channel, byte value), so we tabulate it once: a 3×256 float32 table built
with exactly those numpy operations. Per image we then do the same PIL resize, look every pixel up in the table
(float32 planes) and move the planes into patch order with one strided copy. The resize (PIL's own C code) is
the floor: bit-exact output needs PIL's fixed-point bicubic, and it is most of our time on large images.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlmq.cost import ResolutionPolicy, smart_resize

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # transformers' OPENAI_CLIP_MEAN / _STD, the class defaults
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True, slots=True)
class ImagePreprocessor:
    """Settings of a Qwen2-VL-style image processor; `__call__` turns RGB images into model inputs."""

    policy: ResolutionPolicy = ResolutionPolicy()
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    rescale_factor: float = 1 / 255
    _table: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError("image_mean and image_std need one value per RGB channel")
        object.__setattr__(self, "_table", _value_table(self.rescale_factor, self.image_mean, self.image_std))

    @classmethod
    def from_preprocessor_config(cls, config: Mapping[str, Any]) -> ImagePreprocessor:
        """From a `preprocessor_config.json` dict (resize, rescale and normalise settings; others ignored)."""
        for key, default in (("do_resize", True), ("do_rescale", True), ("do_normalize", True)):
            if config.get(key, default) is not True:
                raise ValueError(f"{key}=false is not supported by the fast preprocessor")
        if config.get("resample", 3) != 3:
            raise ValueError(f"resample {config['resample']} is not supported; Qwen2-VL uses bicubic (3)")
        kw: dict[str, Any] = {"policy": ResolutionPolicy.from_preprocessor_config(config)}
        for key in ("image_mean", "image_std"):
            if config.get(key) is not None:
                kw[key] = tuple(float(v) for v in config[key])
        if config.get("rescale_factor") is not None:
            kw["rescale_factor"] = float(config["rescale_factor"])
        return cls(**kw)

    def __call__(
        self, images: Sequence[Image.Image | np.ndarray], executor: Executor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RGB images (PIL mode "RGB" or uint8 arrays [H, W, 3]) -> pixel_values [P, 3*Tp*p*p] float32 and
        image_grid_thw [N, 3] int64, as the transformers processor returns them for the same images.

        With an executor, images are processed in parallel (PIL's resize and numpy release the GIL)."""
        per_image = list(executor.map(self.one, images) if executor is not None else map(self.one, images))
        patches = [x for x, _ in per_image]
        pixel_values = torch.from_numpy(np.concatenate(patches) if len(patches) != 1 else patches[0])
        return pixel_values, torch.tensor([g for _, g in per_image], dtype=torch.int64).view(-1, 3)

    def one(self, image: Image.Image | np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """One image -> (patches [gh*gw, 3*Tp*p*p] float32, (1, gh, gw))."""
        rgb = self.resize(image)
        grid = (1, rgb.shape[0] // self.policy.patch_size, rgb.shape[1] // self.policy.patch_size)
        return self.patchify(rgb), grid

    def resize(self, image: Image.Image | np.ndarray) -> np.ndarray:
        """The reference's resize: PIL bicubic to smart_resize's (height, width). -> uint8 [h, w, 3]."""
        pil = _as_rgb_pil(image)
        height, width = smart_resize(pil.height, pil.width, self.policy)
        if (height, width) != (pil.height, pil.width):
            pil = pil.resize((width, height), resample=Image.Resampling.BICUBIC)
        return np.asarray(pil)

    def patchify(self, rgb: np.ndarray) -> np.ndarray:
        """uint8 [h, w, 3] (sides multiples of patch*merge) -> float32 [gh*gw, 3*Tp*p*p], rows in the
        processor's order: merge×merge blocks row-major, patches row-major inside a block; each patch's values
        channel-major, the frame repeated Tp times."""
        p, m, tp = self.policy.patch_size, self.policy.merge_size, self.policy.temporal_patch_size
        h, w, _ = rgb.shape
        gh, gw = h // p, w // p
        planes = np.empty((3, h, w), dtype=np.float32)
        for c in range(3):  # table lookup = the reference's rescale + normalise of every pixel value
            np.take(self._table[c], rgb[..., c], out=planes[c], mode="clip")
        # [3, gh/m, m, p, gw/m, m, p] -> [gh/m, gw/m, m, m, 3, Tp, p, p] in one strided copy (frame broadcast).
        # torch's copy kernel does this permutation ~2x faster than numpy's; numpy allocates (cheap page reuse)
        out = np.empty((gh // m, gw // m, m, m, 3, tp, p, p), dtype=np.float32)
        src = torch.from_numpy(planes).view(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        torch.from_numpy(out).copy_(src.unsqueeze(5).expand(-1, -1, -1, -1, -1, tp, -1, -1))
        return out.reshape(gh * gw, 3 * tp * p * p)


def _value_table(scale: float, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    # the reference's arithmetic on every byte value: float64 rescale, cast, float32 (x - mean) / std
    x = (np.arange(256, dtype=np.uint8).astype(np.float64) * scale).astype(np.float32)  # [256]
    table = (x[None, :] - np.array(mean, dtype=np.float32)[:, None]) / np.array(std, dtype=np.float32)[:, None]
    assert table.dtype == np.float32
    return np.ascontiguousarray(table)  # [3, 256]


def _as_rgb_pil(image: Image.Image | np.ndarray) -> Image.Image:
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"expected a uint8 [H, W, 3] RGB array, got {image.dtype} {image.shape}")
        return Image.fromarray(image)
    if image.mode != "RGB":
        raise ValueError(f"expected an RGB image, got mode {image.mode!r}; canonicalise with vlmq.images.decode")
    return image


def preprocess_images(
    images: Sequence[Image.Image | np.ndarray], preprocessor: ImagePreprocessor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(pixel_values [P, 3*Tp*p*p] float32, image_grid_thw [N, 3] int64)` with default or given settings."""
    return (preprocessor or ImagePreprocessor())(images)
