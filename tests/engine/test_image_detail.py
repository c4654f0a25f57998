"""Resolution per image (issue 29 item 3): ``detail`` and ``min_pixels`` / ``max_pixels`` give each image the pixels
transformers' processor gives it when configured with the bounds ``vlmq.resolution.image_policy`` names, priced
at submit with those same bounds; several images of one call each keep their own bounds; an image resized to other
bounds is another entry of the encoder cache. For the tiling families (InternVL, LLaVA-NeXT) ``detail: "low"`` is
their smallest layout, equal to their processors configured with it."""
from __future__ import annotations

import pytest
import torch
from test_preprocess import photo
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vlmq.cost import ResolutionPolicy, estimate
from vlmq.errors import InvalidRequest
from vlmq.families import InternVLPolicy, LlavaNextPolicy
from vlmq.resolution import LOW_DETAIL_TOKENS, image_policy
from vlmq.workers.engine.preprocess import ImagePreprocessor
from vlmq.workers.engine.tiling import TilingPreprocessor, image_preprocessor_for

QWEN2_VL = dict(patch_size=14, temporal_patch_size=2, merge_size=2, size={"shortest_edge": 56 * 56,
                                                                         "longest_edge": 28 * 28 * 1280})
QWEN3_VL = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                size={"shortest_edge": 65536, "longest_edge": 32 * 32 * 1024})
PARTS = [{"detail": "low"}, {"max_pixels": 300_000}, {"min_pixels": 400_000}, {"min_pixels": 50_000,
                                                                              "max_pixels": 120_000},
         {"detail": "low", "min_pixels": 100_000}, {"detail": "low", "max_pixels": 150_000}]
SIZES = [(37, 41), (480, 640), (1200, 900), (1500, 160), (700, 700)]


def reference(settings: dict, policy: ResolutionPolicy) -> Qwen2VLImageProcessorPil:
    """transformers' processor configured with the bounds one image is resized with."""
    return Qwen2VLImageProcessorPil(**settings | {"size": {"shortest_edge": policy.min_pixels,
                                                           "longest_edge": policy.max_pixels}})


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_vl"])
def test_each_images_bounds_give_the_processors_pixels_and_the_price(name: str) -> None:
    settings = {"qwen2_vl": QWEN2_VL, "qwen3_vl": QWEN3_VL}[name]
    ours = ImagePreprocessor.from_preprocessor_config(Qwen2VLImageProcessorPil(**settings).to_dict())
    base = ours.policy
    for part in PARTS:
        policy = image_policy(base, part)
        if part.get("detail") == "low":
            assert policy.max_pixels <= LOW_DETAIL_TOKENS * base.factor ** 2
        images = [photo(h, w, seed=h + w) for h, w in SIZES]
        pixels, grid = ours(images, policies=[policy] * len(images))
        processor = reference(settings, policy)
        expected = processor(images, return_tensors="pt")
        assert torch.equal(grid, expected["image_grid_thw"]), part
        assert torch.equal(pixels, expected["pixel_values"]), part
        for (h, w), (_, gh, gw) in zip(SIZES, grid.tolist(), strict=True):  # the SDK's price of each image
            assert estimate(w, h, policy).vision_tokens == gh * gw // 4, (part, h, w)
    low = image_policy(base, {"detail": "low"})
    assert estimate(1500, 1200, low).vision_tokens <= LOW_DETAIL_TOKENS < estimate(1500, 1200, base).vision_tokens


def test_images_of_one_call_keep_their_own_bounds() -> None:
    ours = ImagePreprocessor.from_preprocessor_config(Qwen2VLImageProcessorPil(**QWEN2_VL).to_dict())
    images = [photo(900, 1200, seed=1), photo(900, 1200, seed=2), photo(300, 200, seed=3)]
    policies = [image_policy(ours.policy, p) for p in ({"detail": "low"}, {}, {"min_pixels": 200_000})]
    pixels, grid = ours(images, policies=policies)
    rows = [reference(QWEN2_VL, p)([image], return_tensors="pt") for image, p in zip(images, policies, strict=True)]
    assert torch.equal(grid, torch.cat([r["image_grid_thw"] for r in rows]))
    assert torch.equal(pixels, torch.cat([r["pixel_values"] for r in rows]))
    assert grid[0].prod() < grid[1].prod()  # the same size, the low one fewer patches


def test_bounds_the_model_cannot_take_are_refused_by_name() -> None:
    base = ResolutionPolicy(patch_size=14, merge_size=2, min_pixels=3136, max_pixels=1_003_520)
    assert image_policy(base, {}) is base and image_policy(base, {"type": "image"}) is base
    for part, code in (({"max_pixels": 2_000_000}, "bad_pixels"), ({"max_pixels": 100}, "bad_pixels"),
                       ({"min_pixels": 900_000, "max_pixels": 500_000}, "bad_pixels"),
                       ({"detail": "low", "min_pixels": 250_000}, "bad_pixels")):
        with pytest.raises(InvalidRequest) as err:
            image_policy(base, part)
        assert err.value.code == code, part
    for tiling in (InternVLPolicy(), LlavaNextPolicy()):  # fixed tiles: pixel bounds refused, never ignored
        assert image_policy(tiling, {}) is tiling
        for part in ({"max_pixels": 200_000}, {"detail": "low", "min_pixels": 50_000}):
            with pytest.raises(InvalidRequest) as err:
                image_policy(tiling, part)
            assert err.value.code == "unsupported_field"


TILE_SIZES = [(37, 41), (480, 640), (1200, 900), (1500, 160), (700, 700)]


def test_internvl_low_detail_is_one_tile_as_the_processor_gives_with_max_patches_1() -> None:
    settings = dict(size={"height": 56, "width": 56}, crop_to_patches=True, max_patches=6,
                    image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    ours = TilingPreprocessor.from_preprocessor_config({**GotOcr2ImageProcessorPil(**settings).to_dict(),
                                                        "crop_to_patches": False})
    low = image_policy(ours.policy, {"detail": "low"})
    images = [photo(h, w, seed=h + w) for h, w in TILE_SIZES]
    pixels, grid = ours(images, policies=[low, ours.policy] * 2 + [low])
    one_tile = GotOcr2ImageProcessorPil(**settings | {"max_patches": 1})
    full = GotOcr2ImageProcessorPil(**settings)
    expected = [(one_tile if i % 2 == 0 else full)(images=[img], crop_to_patches=True, return_tensors="pt")
                for i, img in enumerate(images)]
    assert torch.equal(pixels, torch.cat([e["pixel_values"] for e in expected]))
    assert grid[:, 0].tolist() == [int(e["num_patches"][0]) for e in expected]
    assert grid[0::2, 0].tolist() == [1, 1, 1] and grid[1, 0] > 1  # low: one tile, whatever the size
    price = image_policy(InternVLPolicy(tile_height=56, tile_width=56, max_tiles=6), {"detail": "low"})
    assert [price.measure(h, w).vision_tokens for h, w in TILE_SIZES] == [256] * len(TILE_SIZES)


def test_llava_next_low_detail_is_the_base_tile_and_one_canvas_tile() -> None:
    settings = dict(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    ours = image_preprocessor_for(LlavaNextImageProcessorPil(**settings).to_dict())
    low = image_policy(ours.policy, {"detail": "low"})
    assert low.grid_pinpoints == ((336, 336),)
    images = [photo(h, w, seed=h + w) for h, w in TILE_SIZES]
    pixels, grid = ours(images, policies=[low] * len(images))
    ref = LlavaNextImageProcessorPil(**settings | {"image_grid_pinpoints": [[336, 336]]})
    assert torch.equal(pixels, torch.cat([ref(images=[img], return_tensors="pt")["pixel_values"][0]
                                          for img in images]))
    assert grid[:, :3].tolist() == [[2, 1, 1]] * len(images)
    full, price = LlavaNextPolicy(), image_policy(LlavaNextPolicy(), {"detail": "low"})
    for h, w in TILE_SIZES:  # the SDK's price: the one-tile layout, at most the full layout's
        assert price.measure(h, w).vision_tokens <= full.measure(h, w).vision_tokens
        assert price.measure(h, w).num_tiles == 2
