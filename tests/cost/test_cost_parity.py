"""Each family's cost model gives the token and tile counts of transformers' own processors.

For every family: >= 500 sizes (tiny, ordinary, huge, extreme aspect ratios and the family's exact ties)
against the processor's own count (``_get_num_multimodal_tokens``, what it uses to expand the image
token), and a few blank images run through the whole processor (image tokens in ``input_ids``, tiles in
``pixel_values``).
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from hf_reference import (
    INTERNVL_TOKENS,
    InternVLImageProcessor,
    internvl_context_tokens,
    internvl_processor,
    llava_next_processor,
    parity_sizes,
    qwen3_vl_processor,
)
from PIL import Image
from transformers.image_processing_utils import select_best_resolution as hf_select_best_resolution

from vlmq.cost import ResolutionPolicy, estimate
from vlmq.errors import InvalidRequest
from vlmq.families import InternVLPolicy, LlavaNextPolicy, internvl_tile_grid, select_best_resolution

# --- InternVL -------------------------------------------------------------------------------------

# (image processor settings, image_seq_length): InternVL 2.5/3's, a 6-tile one, a tiny one with a floor of
# 3 tiles, a non-square tile whose thumbnail threshold lands on whole pixels, and tiling turned off
INTERNVL = {
    "internvl3": ({"size": {"height": 448, "width": 448}, "min_patches": 1, "max_patches": 12}, 256),
    "six-tiles": ({"size": {"height": 448, "width": 448}, "min_patches": 1, "max_patches": 6}, 256),
    "tiny-min3": ({"size": {"height": 64, "width": 64}, "min_patches": 3, "max_patches": 9}, 16),
    "oblong": ({"size": {"height": 50, "width": 64}, "min_patches": 1, "max_patches": 12}, 4),
    "no-tiles": ({"size": {"height": 448, "width": 448}, "min_patches": 1, "max_patches": 1}, 256),
}


def _internvl_policy(name: str) -> InternVLPolicy:
    settings, seq_length = INTERNVL[name]
    return InternVLPolicy(tile_height=settings["size"]["height"], tile_width=settings["size"]["width"],
                          min_tiles=settings["min_patches"], max_tiles=settings["max_patches"],
                          tokens_per_tile=seq_length, patches_per_tile=7 * seq_length)


def _grid_ratios(max_tiles: int) -> list[Fraction]:
    return sorted({Fraction(c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1) if c * r <= 12})


def _internvl_ties(tile_h: int, tile_w: int) -> list[tuple[int, int]]:
    """Sizes on the two kinds of tie: an aspect ratio shared by several grids (2x2 and 1x1 for a square), at
    areas on both sides of the thumbnail threshold; and an aspect ratio halfway between two grids' ratios."""
    sizes = []
    for ratio in _grid_ratios(12):
        for k in (1, 3, 50, 151, 300, 317, 318, 449, 450, 700):
            sizes.append((ratio.denominator * k, ratio.numerator * k))
        for m in (2, 3):  # k where r*c*k*k crosses 0.5 * tile area * m*m*c*r (the m-times larger grid)
            k = math.sqrt(0.5 * tile_h * tile_w) * m / math.sqrt(ratio.numerator * ratio.denominator)
            sizes += [(ratio.denominator * j, ratio.numerator * j) for j in (math.floor(k), math.ceil(k))]
    ratios = _grid_ratios(12)
    for low, high in zip(ratios, ratios[1:], strict=False):
        mid = (low + high) / 2
        sizes += [(mid.denominator * k, mid.numerator * k) for k in (1, 7, 40)]
    return sizes


INTERNVL_SIZES = parity_sizes(11, _internvl_ties(448, 448) + _internvl_ties(50, 64) + [(80, 80), (79, 81)])


def _tie_kinds(height: int, width: int, policy: InternVLPolicy) -> set[str]:
    """Which tie rules decide this image: several grids at the best ratio distance, and whether the area sat
    exactly on the thumbnail threshold."""
    from vlmq.families import _tile_grids

    grids = _tile_grids(policy.min_tiles, policy.max_tiles)
    diffs = [abs(width / height - c / r) for c, r in grids]
    best = min(diffs)
    kinds = set()
    tied = [g for g, d in zip(grids, diffs, strict=True) if d == best]
    if len(tied) > 1:
        kinds.add("tie")
        if any(height * width == 0.5 * policy.tile_height * policy.tile_width * c * r for c, r in tied[1:]):
            kinds.add("on-threshold")
    return kinds


def test_internvl_parity_set_covers_the_ties() -> None:
    assert len(INTERNVL_SIZES) >= 500
    kinds = [_tie_kinds(h, w, _internvl_policy("internvl3")) for h, w in INTERNVL_SIZES]
    assert sum("tie" in k for k in kinds) >= 100
    oblong = [_tie_kinds(h, w, _internvl_policy("oblong")) for h, w in INTERNVL_SIZES]
    assert any("on-threshold" in k for k in oblong)  # 80x80 against a 2x2 grid of 50x64 tiles: 6400 == 6400


@pytest.mark.parametrize("name", sorted(INTERNVL))
def test_internvl_matches_the_processor(name: str) -> None:
    settings, seq_length = INTERNVL[name]
    processor = internvl_processor(settings, seq_length)
    reference = processor._get_num_multimodal_tokens(image_sizes=INTERNVL_SIZES)
    policy = _internvl_policy(name)
    ours = [estimate(w, h, policy) for h, w in INTERNVL_SIZES]
    assert [c.vision_tokens for c in ours] == internvl_context_tokens(processor, INTERNVL_SIZES)
    assert [c.num_tiles for c in ours] == reference["num_image_patches"]
    assert all(c.encoder_patches == c.num_tiles * policy.patches_per_tile for c in ours)


def test_internvl_tile_grid_matches_transformers() -> None:
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    for height, width in INTERNVL_SIZES[::3]:
        for tile, low, high in ((448, 1, 12), (64, 3, 9), (336, 1, 6)):
            assert internvl_tile_grid(height, width, tile, tile, low, high) == \
                get_optimal_tiled_canvas((height, width), (tile, tile), low, high)


def test_internvl_processor_tiles_whatever_the_image_processor_says() -> None:
    # InternVL checkpoints ship crop_to_patches=false in their image processor settings; the processor
    # turns it on for every call, and the cost model relies on that
    assert InternVLImageProcessor.images_kwargs == {"crop_to_patches": True}
    settings = {**INTERNVL["tiny-min3"][0], "crop_to_patches": False}
    processor = internvl_processor(settings, 16)
    assert processor._get_num_multimodal_tokens(image_sizes=[(100, 300)])["num_image_patches"] == [3 + 1]


# --- LLaVA-NeXT ----------------------------------------------------------------------------------

_TILE_GRIDS_3x3 = [[336 * r, 336 * c] for r in (1, 2, 3) for c in (1, 2, 3)]
# (image processor settings, processor settings): llava-v1.6's, a 3x3 anyres grid, a tiny tile with the full
# feature strategy (no CLS dropped, none added)
LLAVA_NEXT: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "llava-v1.6": ({"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}},
                   {"patch_size": 14, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}),
    "grid-3x3": ({"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336},
                  "image_grid_pinpoints": _TILE_GRIDS_3x3},
                 {"patch_size": 14, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}),
    "tiny-full": ({"size": {"height": 32, "width": 32}, "crop_size": {"height": 32, "width": 32},
                   "image_grid_pinpoints": [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]]},
                  {"patch_size": 8, "vision_feature_select_strategy": "full", "num_additional_image_tokens": 0}),
}


def _llava_next_policy(name: str) -> LlavaNextPolicy:
    settings, processor = LLAVA_NEXT[name]
    pinpoints = settings.get("image_grid_pinpoints", [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]])
    return LlavaNextPolicy(tile_size=settings["crop_size"]["height"], patch_size=processor["patch_size"],
                           grid_pinpoints=tuple((h, w) for h, w in pinpoints),
                           num_additional_image_tokens=processor["num_additional_image_tokens"],
                           drop_first_feature=processor["vision_feature_select_strategy"] == "default")


def _llava_next_ties() -> list[tuple[int, int]]:
    """Aspect ratios equal to a grid's (the unpadding's else branch, nothing cut), small images where every
    pinpoint keeps all pixels (least waste decides, then the first pinpoint), and odd padding."""
    sizes = []
    for ratio in (Fraction(1), Fraction(2), Fraction(3), Fraction(1, 2), Fraction(1, 3), Fraction(3, 2)):
        sizes += [(ratio.denominator * k, ratio.numerator * k) for k in (1, 5, 16, 33, 112, 168, 336, 500, 1008)]
    sizes += [(s, s) for s in range(20, 340, 16)]
    sizes += [(h, 1000) for h in range(301, 340, 2)] + [(1000, w) for w in range(651, 700, 3)]
    # the resized short side lands a hair under a whole feature row in float: rounding to 7 places decides
    near_whole = [(h, w) for w in range(2, 400) for h in range(1, w) for side in (24, 48, 72)
                  if int(h * (side / w)) != int(round(h * (side / w), 7))]
    sizes += near_whole[::8] + [(w, h) for h, w in near_whole[::8]]
    return sizes


LLAVA_NEXT_SIZES = parity_sizes(12, _llava_next_ties())


def _llava_next_reference(processor: Any, sizes: list[tuple[int, int]]) -> list[int]:
    return list(processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"])


def _ours_or_none(policy: Any, height: int, width: int) -> Any:
    try:
        return estimate(width, height, policy)
    except InvalidRequest as e:
        assert e.code == "aspect_ratio"
        return None


@pytest.mark.parametrize("name", sorted(LLAVA_NEXT))
def test_llava_next_matches_the_processor(name: str) -> None:
    assert len(LLAVA_NEXT_SIZES) >= 500
    settings, processor_settings = LLAVA_NEXT[name]
    processor = llava_next_processor(settings, **processor_settings)
    policy = _llava_next_policy(name)
    # like the processor, it takes any aspect ratio (a 1:5000 strip is all base tile and padding)
    ours = [estimate(w, h, policy) for h, w in LLAVA_NEXT_SIZES]
    assert [c.vision_tokens for c in ours] == _llava_next_reference(processor, LLAVA_NEXT_SIZES)
    for (height, width), cost in zip(LLAVA_NEXT_SIZES, ours, strict=True):
        best = hf_select_best_resolution((height, width), processor.image_processor.image_grid_pinpoints)
        assert (cost.resized_height, cost.resized_width) == tuple(best)
        assert cost.num_tiles == (best[0] // policy.tile_size) * (best[1] // policy.tile_size) + 1


def test_select_best_resolution_matches_transformers() -> None:
    pinpoints = [(h, w) for h, w in _TILE_GRIDS_3x3]
    for height, width in LLAVA_NEXT_SIZES[::2]:
        assert select_best_resolution(height, width, pinpoints) == hf_select_best_resolution((height, width), pinpoints)


# --- Qwen3-VL ------------------------------------------------------------------------------------

QWEN3_VL = {
    "qwen3-vl": {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2,
                 "size": {"shortest_edge": 65536, "longest_edge": 16777216}},
    "narrow": {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2,
               "size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 256}},
}
QWEN3_VL_SIZES = parity_sizes(13, [(32 * k + 16, w) for k in range(60) for w in (16, 48, 1000)] +
                              [(32 * k + 16, 32 * k + 16) for k in range(60)])


@pytest.mark.parametrize("name", sorted(QWEN3_VL))
def test_qwen3_vl_matches_the_processor(name: str) -> None:
    assert len(QWEN3_VL_SIZES) >= 500
    processor = qwen3_vl_processor(QWEN3_VL[name])
    policy = ResolutionPolicy.from_preprocessor_config(QWEN3_VL[name])
    ours = {size: _ours_or_none(policy, *size) for size in QWEN3_VL_SIZES}
    taken = [size for size, cost in ours.items() if cost is not None]
    reference = processor._get_num_multimodal_tokens(image_sizes=taken)
    assert [ours[s].vision_tokens for s in taken] == reference["num_image_tokens"]
    assert [ours[s].encoder_patches for s in taken] == [
        processor.image_processor.get_number_of_image_patches(h, w, {}) for h, w in taken
    ]
    refused = [size for size, cost in ours.items() if cost is None]
    assert refused
    for height, width in refused:
        with pytest.raises(ValueError, match="aspect ratio"):
            processor.image_processor.get_number_of_image_patches(height, width, {})


# --- whole processors on blank images --------------------------------------------------------------

BLANK_SIZES = [(1, 1), (30, 200), (200, 30), (64, 64), (100, 300), (333, 250), (17, 900)]


def _blank(height: int, width: int) -> Image.Image:
    return Image.new("RGB", (width, height), (90, 120, 30))


@pytest.mark.parametrize(("height", "width"), BLANK_SIZES)
def test_internvl_processor_output(height: int, width: int) -> None:
    processor = internvl_processor(INTERNVL["tiny-min3"][0], 16)
    out = processor(images=_blank(height, width), text="describe <IMG_CONTEXT>", return_tensors="np")
    cost = estimate(width, height, _internvl_policy("tiny-min3"))
    context_id = processor.tokenizer.convert_tokens_to_ids(INTERNVL_TOKENS["context_image_token"])
    assert int(np.sum(out["input_ids"] == context_id)) == cost.vision_tokens
    assert out["pixel_values"].shape == (cost.num_tiles, 3, 64, 64)


@pytest.mark.parametrize(("height", "width"), [*BLANK_SIZES, (700, 500)])
def test_llava_next_processor_output(height: int, width: int) -> None:
    name = "tiny-full" if height < 700 else "llava-v1.6"
    settings, processor_settings = LLAVA_NEXT[name]
    processor = llava_next_processor(settings, **processor_settings)
    out = processor(images=_blank(height, width), text="describe <image>", return_tensors="np")
    cost = estimate(width, height, _llava_next_policy(name))
    assert int(np.sum(out["input_ids"] == processor.image_token_id)) == cost.vision_tokens
    assert out["pixel_values"].shape[:2] == (1, cost.num_tiles)


@pytest.mark.parametrize(("height", "width"), [(1, 1), (30, 200), (333, 250), (17, 900), (2000, 1500)])
def test_qwen3_vl_processor_output(height: int, width: int) -> None:
    processor = qwen3_vl_processor(QWEN3_VL["narrow"])
    out = processor(images=_blank(height, width), text="describe <|image_pad|>", return_tensors="np")
    cost = estimate(width, height, ResolutionPolicy.from_preprocessor_config(QWEN3_VL["narrow"]))
    assert int(np.sum(out["input_ids"] == processor.image_token_id)) == cost.vision_tokens
    assert out["image_grid_thw"].tolist() == [[1, cost.grid_h, cost.grid_w]]
