"""LLaVA-NeXT's anyres tiling, bit for bit equal to transformers' `LlavaNextImageProcessorPil`.

An image is fitted into the best of `image_grid_pinpoints` (`vlmq.families.select_best_resolution`, the SDK's
pricing rule): resized with PIL bicubic so that it fits (the fitted side exactly, the other ceil'd), centred on a
zero canvas of the pinpoint's size and cut into S×S tiles row by row; the base tile is the whole image resized to
S×S and comes first. The reference's later per-tile resize and centre crop are to S×S already, so no-ops. Rescale
and normalise are the value table of preprocess.py (a zero pad byte becomes the table's value for 0, as in the
reference, which pads before normalising).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlmq.families import LlavaNextPolicy, select_best_resolution

from .preprocess import _checked_rgb, _height_width, pixel_settings
from .tiling import TilingPreprocessor


def fitted_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """(height, width) of the image resized to fit `target` (transformers' get_patch_output_size)."""
    target_h, target_w = target
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_h), target_w
    return target_h, min(math.ceil(width * scale_h), target_w)


def anyres_grid(height: int, width: int, policy: LlavaNextPolicy) -> tuple[int, int]:
    """(rows, cols) of S×S tiles of the image's best-fit canvas."""
    best_h, best_w = select_best_resolution(height, width, policy.grid_pinpoints)
    return best_h // policy.tile_size, best_w // policy.tile_size


@dataclass(frozen=True, slots=True)
class AnyresPreprocessor(TilingPreprocessor):
    """Settings of a LLaVA-NeXT image processor; `__call__` turns RGB images into the base tile and canvas tiles.
    Pixel settings, the value table, `normalize` and `resize` are the tiling preprocessor's."""

    policy: LlavaNextPolicy = LlavaNextPolicy()  # type: ignore[assignment]

    @classmethod
    def from_preprocessor_config(cls, config: Mapping[str, Any]) -> AnyresPreprocessor:
        """From a LlavaNext `preprocessor_config.json` dict: square crop_size tiles, shortest_edge the same."""
        crop = config.get("crop_size") or {"height": 224, "width": 224}
        size = config.get("size") or {"shortest_edge": 224}
        tile = crop.get("height")
        if not tile or crop.get("width") != tile or size.get("shortest_edge", size.get("height")) != tile:
            raise ValueError(f"LLaVA-NeXT tiles must be square with size {size} equal to crop_size {crop}")
        if config.get("do_pad", True) is not True or config.get("do_center_crop", True) is not True:
            raise ValueError("do_pad=false or do_center_crop=false is not supported by the fast preprocessor")
        pinpoints = config.get("image_grid_pinpoints", LlavaNextPolicy.grid_pinpoints)
        pinpoints = tuple((int(h), int(w)) for h, w in pinpoints)
        return cls(policy=LlavaNextPolicy(tile_size=int(tile), grid_pinpoints=pinpoints), **pixel_settings(config))

    def __call__(
        self, images: Sequence[Image.Image | np.ndarray], executor: Executor | None = None,
        policies: Sequence[LlavaNextPolicy] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RGB images -> pixel_values [T, 3, S, S] float32 (every image's base tile, then its canvas tiles; images
        back to back) and grid [N, 5] int64: (tiles, rows, cols, height, width) per image. ``policies``: each
        image's own pinpoints (``detail: "low"``: one tile's canvas; the same tile size), else ``policy``'s."""
        checked = [_checked_rgb(image) for image in images]
        sizes = [_height_width(image) for image in checked]
        each = policies if policies is not None else [self.policy] * len(checked)
        grids = [anyres_grid(h, w, pol) for (h, w), pol in zip(sizes, each, strict=True)]
        counts = [r * c + 1 for r, c in grids]
        rows = [(n, r, c, h, w) for n, (r, c), (h, w) in zip(counts, grids, sizes, strict=True)]
        grid = torch.tensor(rows, dtype=torch.int64).view(-1, 5)
        return self._tiles(checked, grids, counts, executor), grid

    def largest_grid(self) -> torch.Tensor:
        """The grid row [1, 5] of an image with the most tiles: the largest pinpoint, nothing unpadded."""
        s = self.policy.tile_size
        h, w = max(self.policy.grid_pinpoints, key=lambda p: (p[0] // s) * (p[1] // s))
        return torch.tensor([[(h // s) * (w // s) + 1, h // s, w // s, h, w]])

    def _fill(self, job: tuple[Image.Image | np.ndarray, tuple[int, int], np.ndarray]) -> None:
        image, (rows, cols), tiles = job  # tiles: [1 + rows*cols, 3, S, S]
        s = self.policy.tile_size
        height, width = _height_width(image)
        fit_h, fit_w = fitted_size(height, width, (rows * s, cols * s))
        fitted = np.asarray(image) if (fit_h, fit_w) == (height, width) else self.resize(image, (fit_h, fit_w))
        canvas = np.zeros((rows * s, cols * s, 3), dtype=np.uint8)
        top, left = (rows * s - fit_h) // 2, (cols * s - fit_w) // 2
        canvas[top:top + fit_h, left:left + fit_w] = fitted
        base = np.asarray(image) if (height, width) == (s, s) else self.resize(image)
        self.normalize(base, out=tiles[0])
        for i in range(rows * cols):
            r, c = divmod(i, cols)
            self.normalize(canvas[r * s:(r + 1) * s, c * s:(c + 1) * s], out=tiles[1 + i])
