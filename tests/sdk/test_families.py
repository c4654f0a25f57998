"""Model folders as published on the hub are priced by their family; bad ones are refused with a code.

Parity with transformers' processors is in ``tests/cost``; these run without transformers.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from vlmq.cost import ResolutionPolicy, estimate
from vlmq.errors import InvalidRequest
from vlmq.families import FAMILIES, InternVLPolicy, LlavaNextPolicy, read_model_folder
from vlmq.models import class_cost, resolve_model
from vlmq.settings import Settings

PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
HUB = {  # config.json, preprocessor_config.json, processor_config.json, trimmed to what pricing reads
    "qwen2_5_vl": ({"model_type": "qwen2_5_vl", "vision_config": {"patch_size": 14, "spatial_merge_size": 2}},
                   {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2,
                    "temporal_patch_size": 2}, None),
    "qwen3_vl": ({"model_type": "qwen3_vl", "vision_config": {"patch_size": 16, "spatial_merge_size": 2}},
                 {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "merge_size": 2,
                  "temporal_patch_size": 2}, None),
    "internvl": ({"model_type": "internvl", "downsample_ratio": 0.5,
                  "vision_config": {"image_size": [448, 448], "patch_size": [14, 14]}},
                 {"crop_to_patches": False, "min_patches": 1, "max_patches": 12, "size": {"height": 448, "width": 448}},
                 {"image_seq_length": 256}),
    "llava_next": ({"model_type": "llava_next", "image_grid_pinpoints": PINPOINTS, "vision_feature_select_strategy":
                    "default", "vision_config": {"image_size": 336, "patch_size": 14}},
                   {"crop_size": {"height": 336, "width": 336}, "size": {"shortest_edge": 336},
                    "image_grid_pinpoints": PINPOINTS},
                   {"num_additional_image_tokens": 1, "patch_size": 14, "vision_feature_select_strategy": "default"}),
}


def _folder(path: Path, config: Any, preprocessor: Any = None, processor: Any = None) -> str:
    path.mkdir(parents=True, exist_ok=True)
    for name, data in (("config.json", config), ("preprocessor_config.json", preprocessor),
                       ("processor_config.json", processor)):
        if data is not None:
            (path / name).write_text(json.dumps(data))
    return str(path)


# (family, width, height) -> (tiles, vision tokens, encoder patches, class) with the released settings
KNOWN = {
    ("qwen2_5_vl", 1920, 1080): (1, 2691, 10764, "m"),
    ("qwen3_vl", 1920, 1080): (1, 2040, 8160, "m"),
    ("qwen3_vl", 100, 100): (1, 64, 256, "xs"),  # scaled up to the 256x256 minimum
    ("internvl", 1920, 1080): (9, 9 * 256, 9 * 1024, "m"),  # 4x2 grid and the thumbnail
    ("internvl", 640, 480): (13, 13 * 256, 13 * 1024, "m"),  # 4:3 exactly: a 4x3 grid and the thumbnail
    ("internvl", 448, 448): (1, 256, 1024, "xs"),  # 1x1 beats 2x2 and 3x3 (a small image's tie)
    ("internvl", 800, 800): (5, 5 * 256, 5 * 1024, "m"),  # big enough for the 2x2 grid, not for 3x3
    ("internvl", 1000, 1000): (10, 10 * 256, 10 * 1024, "m"),  # and now for 3x3
    ("llava_next", 1920, 1080): (5, 48 * 28 + 28 + 576, 5 * 576, "m"),  # 672x672: 20 padded rows go
    ("llava_next", 448, 448): (5, 48 * 48 + 48 + 576, 5 * 576, "m"),
    ("llava_next", 300, 1000): (4, 72 * 22 + 72 + 576, 4 * 576, "m"),  # 1008x336 canvas, 2 padded columns go
}


@pytest.mark.parametrize(("family", "width", "height"), sorted(KNOWN))
def test_hub_folders_price_known_sizes(tmp_path: Path, family: str, width: int, height: int) -> None:
    model_type, policy = read_model_folder(_folder(tmp_path, *HUB[family]))
    assert model_type == family
    cost = estimate(width, height, policy)
    assert (cost.num_tiles, cost.vision_tokens, cost.encoder_patches, cost.cost_class) == KNOWN[family, width, height]


def test_released_settings_are_the_policy_defaults(tmp_path: Path) -> None:
    assert read_model_folder(_folder(tmp_path / "i", *HUB["internvl"]))[1] == InternVLPolicy()
    assert read_model_folder(_folder(tmp_path / "l", *HUB["llava_next"]))[1] == LlavaNextPolicy()
    assert read_model_folder(_folder(tmp_path / "q", *HUB["qwen3_vl"]))[1] == \
        ResolutionPolicy(patch_size=16, min_pixels=65536, max_pixels=16777216)


def test_top_class_bound_is_the_largest_image_of_the_family(tmp_path: Path) -> None:
    paths = {family: _folder(tmp_path / family, *HUB[family]) for family in HUB}
    settings = Settings(models=paths)
    tops = {family: class_cost(resolve_model(family, settings), "xl", settings) - settings.text_token_bound
            for family in HUB}
    # InternVL: 12 tiles and the thumbnail; LLaVA-NeXT: the 672x672 canvas unpadded, its newlines, the base tile
    assert tops == {"qwen2_5_vl": 12845056 // 28**2, "qwen3_vl": 16777216 // 32**2, "internvl": 13 * 256,
                    "llava_next": 48 * 48 + 48 + 576}
    assert all(resolve_model(f, settings).family == f for f in HUB)


@pytest.mark.parametrize("config", [{"model_type": "idefics3"}, {"model_type": "internvl_chat"}, {"model": 1},
                                    {"model_type": ["qwen2_vl"]}, [1, 2]])
def test_unknown_model_types_are_refused(tmp_path: Path, config: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        read_model_folder(_folder(tmp_path, config))
    assert info.value.code == "unsupported_model"
    assert "vlmq prices and serves" in str(info.value) or "config.json" in str(info.value)


def test_a_folder_without_config_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="no config.json") as info:
        resolve_model("m", Settings(models={"m": _folder(tmp_path, None, {"patch_size": 14})}))
    assert info.value.code == "unsupported_model"


LLAVA_CROP = {"crop_size": {"height": 336, "width": 336}, "size": {"shortest_edge": 336}}
BAD = [  # (family, preprocessor_config, processor_config, config.json changes, what the message says)
    ("qwen3_vl", {"size": {"shortest_edge": 65536}}, None, {}, "size has no max_pixels"),
    ("qwen2_5_vl", {"min_pixels": 10_000, "max_pixels": 100}, None, {}, "must not exceed"),
    ("internvl", {"size": {"height": 448, "width": 448}}, {"image_seq_length": 64}, {}, "image_seq_length is 64"),
    ("internvl", HUB["internvl"][1], {}, {"downsample_ratio": 0.25}, "gives 64 tokens per tile"),
    ("internvl", {"size": {"height": 448, "width": 448}, "min_patches": 6, "max_patches": 2}, {}, {},
     "min_patches (6) must not exceed max_patches (2)"),
    ("internvl", {"size": [448, 448]}, {}, {}, "size must be {'height', 'width'}"),
    ("llava_next", {**LLAVA_CROP, "crop_size": {"height": 336, "width": 224}}, {}, {}, "crop_size must be square"),
    ("llava_next", {**LLAVA_CROP, "size": {"shortest_edge": 224}}, {}, {}, "must give 336-px tiles"),
    ("llava_next", {**LLAVA_CROP, "image_grid_pinpoints": [[336, 500]]}, {}, {"image_grid_pinpoints": None},
     "not a multiple of the 336-px tile"),
    ("llava_next", {**LLAVA_CROP, "image_grid_pinpoints": PINPOINTS[:2]}, {}, {}, "disagree on image_grid_pinpoints"),
    ("llava_next", {**LLAVA_CROP, "image_grid_pinpoints": 336}, {}, {"image_grid_pinpoints": None},
     "must be a list of [height, width] pairs"),
    ("llava_next", HUB["llava_next"][1], {"vision_feature_select_strategy": "cls"}, {}, "must be 'default' or 'full'"),
]


@pytest.mark.parametrize(("family", "preprocessor", "processor", "changes", "says"), BAD)
def test_bad_processor_settings_are_refused(tmp_path: Path, family: str, preprocessor: Any, processor: Any,
                                            changes: dict[str, Any], says: str) -> None:
    config = {**HUB[family][0], **changes}
    with pytest.raises(InvalidRequest) as info:
        read_model_folder(_folder(tmp_path, config, preprocessor, processor))
    assert info.value.code == "bad_model_config" and family in str(info.value) and says in str(info.value)


def test_nested_image_processor_settings_win_over_preprocessor_config(tmp_path: Path) -> None:
    config, preprocessor, processor = HUB["internvl"]
    nested = {**processor, "image_processor": {**preprocessor, "max_patches": 6}}
    _, policy = read_model_folder(_folder(tmp_path, config, preprocessor, nested))
    assert policy == InternVLPolicy(max_tiles=6)


def test_every_family_is_covered() -> None:
    assert set(FAMILIES) == {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl", "llava_next"}
