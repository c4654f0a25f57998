"""Dynamic tiling (InternVL), bit for bit equal to transformers' `GotOcr2ImageProcessorPil` with crop_to_patches.

An image becomes a grid of `cols × rows` square tiles (the grid whose aspect ratio is closest to the image's, among
grids of `min_tiles..max_tiles` tiles), plus a thumbnail of the whole image when the grid has more than one tile.
The reference resizes the whole image with PIL bicubic to (rows·S, cols·S) and cuts it into S×S tiles, resizes the
original to S×S for the thumbnail, then rescales (float64, cast to float32) and normalises (float32) every tile.
The per-pixel arithmetic depends only on (channel, byte value), so it is one table lookup (preprocess.py's table);
the resizes are the C resampler's (exactly Pillow's) where it is built, else PIL's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlmq.families import internvl_tile_grid

from . import resample
from .preprocess import ImagePreprocessor, _checked_rgb, _height_width, pixel_settings


@dataclass(frozen=True, slots=True)
class TilePolicy:
    tile_size: int = 448  # S: tile side in pixels (the processor's size.height == size.width)
    min_tiles: int = 1
    max_tiles: int = 12  # 1: every image is one S×S tile

    def __post_init__(self) -> None:
        if self.tile_size < 1 or self.min_tiles < 1 or self.max_tiles < self.min_tiles:
            raise ValueError(f"invalid tile policy {self!r}")


def tile_grid(height: int, width: int, policy: TilePolicy) -> tuple[int, int]:
    """(cols, rows) of the tile grid for an image: the SDK's pricing rule (``vlmq.families``), so the tiles the engine
    cuts are the tiles the job was priced for."""
    return internvl_tile_grid(height, width, policy.tile_size, policy.tile_size, policy.min_tiles, policy.max_tiles)


@dataclass(frozen=True, slots=True)
class TilingPreprocessor(ImagePreprocessor):
    """Settings of a GotOcr2-style (InternVL) image processor; `__call__` turns RGB images into tiles. Pixel settings,
    the value table and `normalize` are ImagePreprocessor's; its patch methods do not apply to tiles."""

    policy: TilePolicy = TilePolicy()  # type: ignore[assignment]

    @classmethod
    def from_preprocessor_config(cls, config: Mapping[str, Any]) -> TilingPreprocessor:
        """From a GotOcr2 `preprocessor_config.json` dict. The file's crop_to_patches is ignored: InternVLProcessor
        passes crop_to_patches=True on every call, and that is what the model was trained on."""
        size = config.get("size") or {"height": 448, "width": 448}
        if size.get("height") != size.get("width") or not size.get("height"):
            raise ValueError(f"tiles must be square with size.height == size.width, got {size}")
        policy = TilePolicy(int(size["height"]), int(config.get("min_patches", 1)), int(config.get("max_patches", 12)))
        return cls(policy=policy, **pixel_settings(config))

    def __call__(
        self, images: Sequence[Image.Image | np.ndarray], executor: Executor | None = None,
        policies: Sequence[TilePolicy] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RGB images -> pixel_values [T, 3, S, S] float32 (every image's tiles, thumbnail last, images back to back)
        and grid [N, 3] int64: (tiles, rows, cols) per image. ``policies``: each image's own tile counts (``detail:
        "low"`` is one tile: ``vlmq.resolution.image_policy``; the same tile size), else ``policy``'s."""
        checked = [_checked_rgb(image) for image in images]
        each = policies if policies is not None else [self.policy] * len(checked)
        grids = [tile_grid(*_height_width(image), pol) for image, pol in zip(checked, each, strict=True)]
        counts = [c * r + (c * r > 1) for c, r in grids]
        grid = torch.tensor([(n, r, c) for n, (c, r) in zip(counts, grids, strict=True)], dtype=torch.int64)
        return self._tiles(checked, grids, counts, executor), grid.view(-1, 3)

    def _tiles(self, images: list, grids: list[tuple[int, int]], counts: list[int],
               executor: Executor | None) -> torch.Tensor:
        """Every image's `counts[i]` tiles, filled by `_fill` (in parallel with an executor), back to back in one
        float32 buffer [T, 3, S, S] (no concatenation copy)."""
        s = self.policy.tile_size
        out = np.empty((sum(counts), 3, s, s), dtype=np.float32)
        ends = np.cumsum([0, *counts]).tolist()
        jobs = [(image, grid, out[a:b]) for image, grid, a, b in zip(images, grids, ends[:-1], ends[1:], strict=True)]
        if executor is None:
            for job in jobs:
                self._fill(job)
        else:
            list(executor.map(self._fill, jobs))  # list() waits for all and re-raises the first error
        return torch.from_numpy(out)

    def largest_grid(self) -> torch.Tensor:
        """The grid row [1, 3] of an image with the most tiles: (max_tiles + thumbnail, 1, max_tiles)."""
        p = self.policy
        return torch.tensor([[p.max_tiles + (p.max_tiles > 1), 1, p.max_tiles]])

    def _fill(self, job: tuple[Image.Image | np.ndarray, tuple[int, int], np.ndarray]) -> None:
        image, (cols, rows), tiles = job  # tiles: [cols*rows (+1), 3, S, S]
        s = self.policy.tile_size
        canvas = self.resize(image, (rows * s, cols * s))  # uint8 [rows*S, cols*S, 3]
        for i in range(cols * rows):
            r, c = divmod(i, cols)
            self.normalize(canvas[r * s:(r + 1) * s, c * s:(c + 1) * s], out=tiles[i])
        if cols * rows > 1:
            self.normalize(self.resize(image), out=tiles[-1])

    def resize(self, image: Image.Image | np.ndarray, size: tuple[int, int] | None = None) -> np.ndarray:
        """PIL bicubic to (height, width), by default one tile -> uint8 [h, w, 3]."""
        height, width = size or (self.policy.tile_size, self.policy.tile_size)
        if self.native:
            return resample.resize(np.asarray(image), (height, width))
        pil = image if isinstance(image, Image.Image) else Image.fromarray(image)
        return np.asarray(pil.resize((width, height), resample=Image.Resampling.BICUBIC))


def image_preprocessor_for(config: Mapping[str, Any]) -> ImagePreprocessor | TilingPreprocessor:
    """The fast preprocessor for a `preprocessor_config.json` dict: tiles for GotOcr2's processor (InternVL), anyres
    tiles for LlavaNext's, native resolution (Qwen2-VL's rule) for every other."""
    if str(config.get("image_processor_type", "")).startswith("LlavaNext"):
        from .anyres import AnyresPreprocessor  # anyres.py builds on this module

        return AnyresPreprocessor.from_preprocessor_config(config)
    if str(config.get("image_processor_type", "")).startswith("GotOcr2"):
        return TilingPreprocessor.from_preprocessor_config(config)
    return ImagePreprocessor.from_preprocessor_config(config)
