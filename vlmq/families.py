"""Each model family's resolution and tiling policy, read from a Hugging Face model folder's JSON files.

The family comes from ``config.json``'s ``model_type``; the policy from the image processor's settings
(``processor_config.json``'s nested ``image_processor``, else ``preprocessor_config.json``, the order
transformers reads them in) and, for the tile's token count, from the processor and model configs.

- ``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``: :class:`vlmq.cost.ResolutionPolicy` (resize, no tiles).
- ``internvl``: :class:`InternVLPolicy`. The image is cut into ``columns x rows`` tiles of the processor's
  ``size`` (the grid whose aspect ratio is closest to the image's, ``min_patches <= tiles <= max_patches``),
  plus a thumbnail when there are two tiles or more; each tile costs ``image_seq_length`` tokens,
  ``(image_size / patch_size)**2 * downsample_ratio**2`` after the pixel-shuffle projector.
- ``llava_next``: :class:`LlavaNextPolicy`. The image is fitted into the best of ``image_grid_pinpoints``
  (:func:`select_best_resolution`), cut into tiles of ``crop_size`` plus one base tile of the whole image;
  the LM sees the unpadded feature rows each followed by an ``image_newline`` token, then the base features.

Any other ``model_type`` is refused (``InvalidRequest``, code ``unsupported_model``), never priced by another
family's rule. Only JSON is read: no torch, no transformers.
"""
from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmq.cost import ImagePolicy, ImageShape, ResolutionPolicy, check_side, positive_int
from vlmq.errors import InvalidRequest

__all__ = [
    "FAMILIES", "InternVLPolicy", "LlavaNextPolicy", "internvl_tile_grid", "llava_next_num_features",
    "read_model_folder", "select_best_resolution",
]

JsonDict = Mapping[str, Any]


# --- InternVL -------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _tile_grids(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    # (columns, rows) with min_tiles <= columns * rows <= max_tiles, fewest tiles first; the sort is
    # stable, so grids of equal size keep columns-major order (transformers' candidate order)
    sides = range(1, max_tiles + 1)
    grids = [(c, r) for c in sides for r in sides if min_tiles <= c * r <= max_tiles]
    return tuple(sorted(grids, key=lambda grid: grid[0] * grid[1]))


def internvl_tile_grid(height: int, width: int, tile_height: int, tile_width: int, min_tiles: int,
                       max_tiles: int) -> tuple[int, int]:
    """The ``(columns, rows)`` tile grid InternVL's processor cuts a ``height x width`` image into.

    The grid whose ``columns / rows`` is closest to ``width / height`` wins. On an exact tie the later
    (larger) grid wins while the image's area is over half the area its tiles cover, so a big image gets
    more tiles and a small one does not. The float arithmetic is transformers', so ties fall the same way.

    Args:
        height: image height in pixels.
        width: image width in pixels.
        tile_height: tile height in pixels (the image processor's ``size["height"]``).
        tile_width: tile width in pixels.
        min_tiles: fewest tiles in the grid (``min_patches``).
        max_tiles: most tiles in the grid (``max_patches``).

    Returns:
        Tile columns and rows.
    """
    aspect_ratio = width / height
    area = width * height
    best, best_diff = (1, 1), math.inf
    for columns, rows in _tile_grids(min_tiles, max_tiles):
        diff = abs(aspect_ratio - columns / rows)
        if diff < best_diff:
            best, best_diff = (columns, rows), diff
        elif diff == best_diff and area > 0.5 * tile_height * tile_width * columns * rows:
            best = (columns, rows)
    return best


@dataclass(frozen=True, slots=True)
class InternVLPolicy:
    """InternVL's dynamic tiling (transformers' GotOcr2 image processor with ``crop_to_patches``).

    Attributes:
        tile_height: tile height in pixels (image processor ``size["height"]``).
        tile_width: tile width in pixels.
        min_tiles: fewest grid tiles (``min_patches``).
        max_tiles: most grid tiles (``max_patches``); 1 turns tiling off (one resized tile).
        tokens_per_tile: LM tokens per tile (``image_seq_length``).
        patches_per_tile: vision-encoder patches per tile (``(image_size / patch_size)**2``, no CLS).
    """

    tile_height: int = 448
    tile_width: int = 448
    min_tiles: int = 1
    max_tiles: int = 12
    tokens_per_tile: int = 256
    patches_per_tile: int = 1024

    def __post_init__(self) -> None:
        for name in ("tile_height", "tile_width", "min_tiles", "max_tiles", "tokens_per_tile", "patches_per_tile"):
            positive_int(name, getattr(self, name))
        if self.min_tiles > self.max_tiles:
            raise ValueError(f"min_patches ({self.min_tiles}) must not exceed max_patches ({self.max_tiles})")

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """The ``(columns, rows)`` grid of a ``height x width`` image (``(1, 1)`` when tiling is off: max_tiles 1)."""
        return internvl_tile_grid(height, width, self.tile_height, self.tile_width, self.min_tiles, self.max_tiles)

    def measure(self, height: int, width: int) -> ImageShape:
        """Tiles, patches and tokens of a ``height x width`` image; any aspect ratio is taken."""
        check_side("height", height)
        check_side("width", width)
        columns, rows = self.grid(height, width)
        num_tiles = columns * rows + 1 if columns * rows > 1 else 1  # the thumbnail joins a grid of 2+ tiles
        return ImageShape(
            resized_height=rows * self.tile_height, resized_width=columns * self.tile_width, grid_h=rows,
            grid_w=columns, num_tiles=num_tiles, encoder_patches=num_tiles * self.patches_per_tile,
            vision_tokens=num_tiles * self.tokens_per_tile,
        )

    def max_vision_tokens(self) -> int:
        """``max_patches`` tiles and the thumbnail."""
        return (self.max_tiles + 1 if self.max_tiles > 1 else 1) * self.tokens_per_tile


def _pair(name: str, value: object) -> tuple[int, int]:
    # config values given as an int or as [height, width]
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return positive_int(name, value[0]), positive_int(name, value[1])
    side = positive_int(name, value)
    return side, side


def _internvl(config: JsonDict, image_processor: JsonDict, processor: JsonDict) -> InternVLPolicy:
    vision = config.get("vision_config") or {}
    image_h, image_w = _pair("vision_config.image_size", vision.get("image_size", 448))
    patch_h, patch_w = _pair("vision_config.patch_size", vision.get("patch_size", 14))
    ratio = config.get("downsample_ratio", 0.5)
    grid_h, grid_w = image_h // patch_h, image_w // patch_w
    tokens = int(grid_h * ratio) * int(grid_w * ratio)  # the pixel shuffle's output size
    seq_length = processor.get("image_seq_length", 256)
    if seq_length != tokens:
        raise ValueError(f"processor image_seq_length is {seq_length!r} but config.json's vision tower gives {tokens} "
                         f"tokens per tile ((image_size / patch_size)**2 * downsample_ratio**2); fix one of them")
    size = image_processor.get("size") or {"height": 384, "width": 384}  # GotOcr2ImageProcessor's default
    if not isinstance(size, Mapping) or "height" not in size or "width" not in size:
        raise ValueError(f"InternVL image processor size must be {{'height', 'width'}}, got {size!r}")
    # InternVLProcessor passes crop_to_patches=True whatever the image processor's own setting says
    return InternVLPolicy(
        tile_height=size["height"], tile_width=size["width"], min_tiles=image_processor.get("min_patches", 1),
        max_tiles=image_processor.get("max_patches", 12), tokens_per_tile=tokens, patches_per_tile=grid_h * grid_w,
    )


# --- LLaVA-NeXT -----------------------------------------------------------------------------------

_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))  # transformers' default


def select_best_resolution(height: int, width: int, pinpoints: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The ``(height, width)`` of ``pinpoints`` a ``height x width`` image fits best (LLaVA-NeXT's anyres).

    The image is scaled to fit each candidate; the one keeping the most of the image's pixels wins, and
    among those the one wasting the least area; the first candidate wins an exact tie. (A strip so thin
    that it keeps no whole pixel row anywhere gets the first candidate, as in transformers.)

    Args:
        height: image height in pixels.
        width: image width in pixels.
        pinpoints: candidate ``(height, width)`` resolutions, at least one.

    Returns:
        The best resolution.
    """
    best, most_kept, least_wasted = pinpoints[0], 0, math.inf
    for pin_h, pin_w in pinpoints:
        scale = min(pin_w / width, pin_h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = pin_h * pin_w - kept
        if kept > most_kept or (kept == most_kept and wasted < least_wasted):
            best, most_kept, least_wasted = (pin_h, pin_w), kept, wasted
    return best


def llava_next_num_features(height: int, width: int, rows: int, columns: int) -> tuple[int, int]:
    """Unpadded feature count and newline count of a ``height x width`` image on a ``rows x columns`` feature grid.

    The image was resized to fit the grid and padded on the short side; the padded feature rows (or
    columns) are dropped, and each remaining row ends with one ``image_newline`` token.

    Returns:
        ``(unpadded_features, newline_features)``.
    """
    if width / height > columns / rows:  # wider than the grid: padded above and below
        new_height = int(round(height * (columns / width), 7))
        rows -= (rows - new_height) // 2 * 2
    else:
        new_width = int(round(width * (rows / height), 7))
        columns -= (columns - new_width) // 2 * 2
    return rows * columns, rows


@dataclass(frozen=True, slots=True)
class LlavaNextPolicy:
    """LLaVA-NeXT's anyres tiling (transformers' LlavaNext image processor and processor).

    Attributes:
        tile_size: side of a square tile in pixels (``crop_size``).
        patch_size: vision-encoder patch side (the processor's ``patch_size``).
        grid_pinpoints: candidate ``(height, width)`` canvases, each a multiple of ``tile_size``.
        num_additional_image_tokens: tokens the vision tower adds per tile (1 for CLIP's CLS).
        drop_first_feature: ``vision_feature_select_strategy == "default"``: the first feature (CLS) is dropped.
    """

    tile_size: int = 336
    patch_size: int = 14
    grid_pinpoints: tuple[tuple[int, int], ...] = _PINPOINTS
    num_additional_image_tokens: int = 1
    drop_first_feature: bool = True

    def __post_init__(self) -> None:
        positive_int("tile_size", self.tile_size)
        positive_int("patch_size", self.patch_size)
        if not self.grid_pinpoints:
            raise ValueError("image_grid_pinpoints must not be empty")
        for pin in self.grid_pinpoints:
            if pin[0] % self.tile_size or pin[1] % self.tile_size:
                raise ValueError(f"image_grid_pinpoints {list(pin)} is not a multiple of the {self.tile_size}-px tile")
        if self.num_additional_image_tokens < 0:
            raise ValueError("num_additional_image_tokens must be >= 0")

    @property
    def patches_per_side(self) -> int:
        """Feature rows (and columns) of one tile."""
        return self.tile_size // self.patch_size

    def _tokens(self, height: int, width: int, rows: int, columns: int) -> int:
        side = self.patches_per_side
        unpadded, newlines = llava_next_num_features(height, width, rows * side, columns * side)
        base = side * side + self.num_additional_image_tokens - (1 if self.drop_first_feature else 0)
        return unpadded + newlines + base

    def measure(self, height: int, width: int) -> ImageShape:
        """Tiles, patches and tokens of a ``height x width`` image; any aspect ratio is taken."""
        check_side("height", height)
        check_side("width", width)
        best = select_best_resolution(height, width, self.grid_pinpoints)
        rows, columns = best[0] // self.tile_size, best[1] // self.tile_size
        num_tiles = rows * columns + 1  # the grid and the base image
        return ImageShape(
            resized_height=best[0], resized_width=best[1], grid_h=rows, grid_w=columns, num_tiles=num_tiles,
            encoder_patches=num_tiles * self.patches_per_side**2,
            vision_tokens=self._tokens(height, width, rows, columns),
        )

    def max_vision_tokens(self) -> int:
        """The largest canvas with nothing unpadded, its newlines and the base tile."""
        return max(self._tokens(h, w, h // self.tile_size, w // self.tile_size) for h, w in self.grid_pinpoints)


def _pinpoints(value: object) -> tuple[tuple[int, int], ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        raise ValueError(f"image_grid_pinpoints must be a list of [height, width] pairs, got {value!r}")
    return tuple(_pair("image_grid_pinpoints item", p) for p in value)


def _llava_next(config: JsonDict, image_processor: JsonDict, processor: JsonDict) -> LlavaNextPolicy:
    crop = image_processor.get("crop_size") or {"height": 224, "width": 224}
    size = image_processor.get("size") or {"shortest_edge": 224}
    if not isinstance(crop, Mapping) or crop.get("height") != crop.get("width"):
        raise ValueError(f"LLaVA-NeXT crop_size must be square {{'height', 'width'}}, got {crop!r}")
    tile = crop["height"]
    if not isinstance(size, Mapping) or (size.get("shortest_edge") != tile and
                                         (size.get("height"), size.get("width")) != (tile, tile)):
        raise ValueError(f"LLaVA-NeXT size {size!r} must give {tile}-px tiles like crop_size {crop!r}")
    pinpoints = image_processor.get("image_grid_pinpoints", _PINPOINTS)
    model_pinpoints = config.get("image_grid_pinpoints")
    if model_pinpoints is not None and [list(p) for p in model_pinpoints] != [list(p) for p in pinpoints]:
        raise ValueError("config.json and the image processor disagree on image_grid_pinpoints")
    vision = config.get("vision_config") or {}
    strategy = processor.get("vision_feature_select_strategy", config.get("vision_feature_select_strategy", "default"))
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy must be 'default' or 'full', got {strategy!r}")
    return LlavaNextPolicy(
        tile_size=tile, patch_size=processor.get("patch_size", vision.get("patch_size", 14)),
        grid_pinpoints=_pinpoints(pinpoints),
        num_additional_image_tokens=processor.get("num_additional_image_tokens", 0),
        drop_first_feature=strategy == "default",
    )


# --- reading a model folder -----------------------------------------------------------------------

def _qwen(config: JsonDict, image_processor: JsonDict, processor: JsonDict) -> ResolutionPolicy:
    return ResolutionPolicy.from_preprocessor_config(image_processor)


FAMILIES: dict[str, Callable[[JsonDict, JsonDict, JsonDict], ImagePolicy]] = {
    "qwen2_vl": _qwen, "qwen2_5_vl": _qwen, "qwen3_vl": _qwen, "internvl": _internvl, "llava_next": _llava_next,
}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} must hold a JSON object")
    return data


def _stamp(folder: Path) -> tuple[tuple[str, int, int], ...]:
    # the files read, with their modification times: an edited folder is read again
    stamps = []
    for name in ("config.json", "processor_config.json", "preprocessor_config.json"):
        try:
            st = (folder / name).stat()
        except OSError:
            continue
        stamps.append((name, st.st_mtime_ns, st.st_size))
    return tuple(stamps)


@functools.lru_cache(maxsize=32)
def _read_folder(folder: Path, stamp: tuple[tuple[str, int, int], ...]) -> tuple[str, ImagePolicy]:
    try:
        config = _read_json(folder / "config.json")
    except (OSError, ValueError) as e:
        raise InvalidRequest(f"{folder}/config.json cannot be read: {e}", code="unsupported_model") from e
    if config is None:
        raise InvalidRequest(f"{folder} has no config.json, so its model family is unknown; point VLMQ_MODELS "
                             "at a Hugging Face checkpoint folder", code="unsupported_model")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise InvalidRequest(f"model type {model_type!r} in {folder}/config.json is not supported; vlmq prices and "
                             f"serves {', '.join(FAMILIES)}", code="unsupported_model")
    try:
        processor = _read_json(folder / "processor_config.json") or {}
        nested = processor.get("image_processor")
        image_processor = nested if isinstance(nested, dict) else _read_json(folder / "preprocessor_config.json") or {}
        return model_type, FAMILIES[model_type](config, image_processor, processor)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise InvalidRequest(f"{folder}: bad {model_type} processor settings: {e}", code="bad_model_config") from e


def read_model_folder(path: str | Path) -> tuple[str, ImagePolicy]:
    """The family (``model_type``) and resolution policy of a local Hugging Face checkpoint folder.

    Reads ``config.json``, ``processor_config.json`` and ``preprocessor_config.json`` (JSON only; the
    answer is cached until one of them changes).

    Args:
        path: the checkpoint folder.

    Returns:
        ``(model_type, policy)``; ``policy.measure(height, width).vision_tokens`` is the image's token count.

    Raises:
        InvalidRequest: code ``unsupported_model`` when config.json is missing or its ``model_type`` is not
            one of :data:`FAMILIES`; code ``bad_model_config`` when the processor settings are invalid.
    """
    folder = Path(path)
    return _read_folder(folder, _stamp(folder))
