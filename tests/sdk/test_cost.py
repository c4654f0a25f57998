"""The cost model matches transformers' Qwen2-VL image processor exactly."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from vlmq.cost import (
    CostClasses,
    CostEstimate,
    ResolutionPolicy,
    cost_report,
    estimate,
    estimate_image,
    smart_resize,
)
from vlmq.errors import InvalidRequest
from vlmq.images import ImageInfo, probe

POLICIES = {
    "default": ResolutionPolicy(),
    "qwen2.5-vl-config": ResolutionPolicy(max_pixels=12845056),  # what the released checkpoints ship
    "narrow": ResolutionPolicy(min_pixels=100 * 100, max_pixels=300 * 300),
    "patch16": ResolutionPolicy(patch_size=16, merge_size=2, min_pixels=64 * 64, max_pixels=16384 * 32 * 32),
    "below-one-token": ResolutionPolicy(min_pixels=1, max_pixels=500),  # max_pixels < factor**2: clamps to factor
}


def _sizes() -> Iterator[tuple[int, int]]:
    """(height, width) pairs: tiny, random, huge, aspect ratio around 200, exact rounding ties."""
    rng = random.Random(20260401)
    yield from ((h, w) for h in range(1, 28) for w in range(1, 28))
    yield from ((rng.randint(1, 4000), rng.randint(1, 4000)) for _ in range(200))
    yield from ((rng.randint(5000, 60000), rng.randint(5000, 60000)) for _ in range(60))
    yield (20000, 15000)
    yield (15000, 20000)
    for _ in range(60):
        short = rng.randint(1, 300)
        for long in (200 * short - 1, 200 * short, 200 * short + 1, 201 * short):
            yield (short, long)
            yield (long, short)
    for k in range(0, 60):  # h / factor is exactly k + 0.5 for factors 28 and 32
        for factor in (28, 32):
            tie = factor * k + factor // 2
            yield (tie, rng.randint(1, 3000))
            yield (rng.randint(1, 3000), tie)
            yield (tie, tie)


SIZES = list(_sizes())


def _reference(hf: ModuleType, height: int, width: int, policy: ResolutionPolicy) -> tuple[int, int] | None:
    try:
        result: tuple[int, int] = hf.smart_resize(
            height, width, factor=policy.factor, min_pixels=policy.min_pixels, max_pixels=policy.max_pixels
        )
    except ValueError:
        return None
    return result


def _ours(height: int, width: int, policy: ResolutionPolicy) -> tuple[int, int] | None:
    try:
        return smart_resize(height, width, policy)
    except InvalidRequest as e:
        assert e.code == "aspect_ratio"
        return None


def test_parity_set_covers_the_hard_cases() -> None:
    assert len(SIZES) >= 500
    assert any(h % 28 == 14 for h, _ in SIZES) and any(h % 32 == 16 for h, _ in SIZES)
    assert (1, 1) in SIZES and (20000, 15000) in SIZES
    assert any(max(h, w) == 200 * min(h, w) for h, w in SIZES)
    assert any(200 * min(h, w) < max(h, w) for h, w in SIZES)


@pytest.mark.parametrize("policy_name", sorted(POLICIES))
def test_smart_resize_matches_transformers(hf_qwen2vl: ModuleType, policy_name: str) -> None:
    policy = POLICIES[policy_name]
    mismatches = [
        (h, w, _ours(h, w, policy), _reference(hf_qwen2vl, h, w, policy))
        for h, w in SIZES
        if _ours(h, w, policy) != _reference(hf_qwen2vl, h, w, policy)
    ]
    assert mismatches == []
    rejected = sum(_ours(h, w, policy) is None for h, w in SIZES)
    assert 0 < rejected < len(SIZES)  # both branches of the aspect-ratio rule were exercised


@settings(max_examples=300, deadline=None)
@given(
    height=st.integers(1, 100_000), width=st.integers(1, 100_000),
    patch_size=st.integers(1, 32), merge_size=st.integers(1, 4),
    min_pixels=st.integers(1, 2_000_000), extra_pixels=st.integers(0, 20_000_000),
)
def test_smart_resize_matches_transformers_for_any_policy(
    hf_qwen2vl: ModuleType, height: int, width: int, patch_size: int, merge_size: int,
    min_pixels: int, extra_pixels: int,
) -> None:
    policy = ResolutionPolicy(
        patch_size=patch_size, merge_size=merge_size, min_pixels=min_pixels, max_pixels=min_pixels + extra_pixels
    )
    assert _ours(height, width, policy) == _reference(hf_qwen2vl, height, width, policy)


def test_rounding_is_half_to_even() -> None:
    wide_open = ResolutionPolicy(min_pixels=1, max_pixels=10**9)
    assert smart_resize(42, 42, wide_open) == (56, 56)  # 1.5 -> 2
    assert smart_resize(70, 70, wide_open) == (56, 56)  # 2.5 -> 2, not 3
    assert smart_resize(98, 126, wide_open) == (112, 112)  # 3.5 -> 4, 4.5 -> 4


def test_downscale_floors_and_upscale_ceils() -> None:
    down = smart_resize(3000, 4000)
    assert down[0] * down[1] <= ResolutionPolicy().max_pixels
    assert down == (840, 1148)
    up = smart_resize(10, 10)  # 10x10 rounds to 0x0, scaled up past min_pixels
    assert up == (56, 56)


def _processor(hf: ModuleType, policy: ResolutionPolicy) -> object:
    return hf.Qwen2VLImageProcessorPil(
        size={"shortest_edge": policy.min_pixels, "longest_edge": policy.max_pixels},
        patch_size=policy.patch_size, merge_size=policy.merge_size, temporal_patch_size=policy.temporal_patch_size,
    )


def _processor_cases() -> list[tuple[str, int, int]]:
    rng = random.Random(7)
    sizes = [(1, 1), (27, 13), (28, 28), (56, 56), (14, 14), (42, 70), (448, 448), (480, 640), (3, 600)]
    sizes += [(rng.randint(1, 700), rng.randint(1, 700)) for _ in range(22)]
    cases = [("default", h, w) for h, w in sizes]
    cases += [("narrow", rng.randint(20, 900), rng.randint(20, 900)) for _ in range(6)]
    cases += [("patch16", rng.randint(1, 600), rng.randint(1, 600)) for _ in range(5)]
    return cases


@pytest.mark.parametrize(("policy_name", "height", "width"), _processor_cases())
def test_estimate_matches_the_real_image_processor(
    hf_qwen2vl: ModuleType, policy_name: str, height: int, width: int
) -> None:
    policy = POLICIES[policy_name]
    image = Image.new("RGB", (width, height), (200, 100, 50))
    out = _processor(hf_qwen2vl, policy)(images=image, return_tensors="np", input_data_format="channels_last")
    cost = estimate(width, height, policy)
    assert out["image_grid_thw"].tolist() == [[cost.grid_t, cost.grid_h, cost.grid_w]]
    assert out["pixel_values"].shape[0] == cost.encoder_patches
    assert cost.vision_tokens * policy.merge_size**2 == cost.encoder_patches


@pytest.mark.parametrize(("height", "width"), [(1, 201), (402, 2)])
def test_aspect_ratio_rejection_matches_the_real_image_processor(
    hf_qwen2vl: ModuleType, height: int, width: int
) -> None:
    image = Image.new("RGB", (width, height))
    with pytest.raises(ValueError, match="aspect ratio"):
        _processor(hf_qwen2vl, ResolutionPolicy())(images=image, input_data_format="channels_last")
    with pytest.raises(InvalidRequest) as info:
        estimate(width, height)
    assert info.value.code == "aspect_ratio"


@pytest.mark.parametrize(
    ("width", "height", "tokens"),
    [(256, 256, 81), (448, 448, 256), (640, 480, 391), (1280, 960, 1230), (1920, 1080, 1222), (2560, 1440, 1222)],
)
def test_known_token_counts(width: int, height: int, tokens: int) -> None:
    cost = estimate(width, height)
    assert cost.vision_tokens == tokens
    assert cost.encoder_patches == 4 * tokens == cost.grid_h * cost.grid_w
    assert (cost.width, cost.height, cost.grid_t) == (width, height, 1)


def test_estimate_fields_and_dict() -> None:
    cost = estimate(640, 480)
    assert cost == CostEstimate(
        width=640, height=480, resized_height=476, resized_width=644, grid_t=1, grid_h=34, grid_w=46,
        encoder_patches=1564, vision_tokens=391, cost_class="s",
    )
    assert json.loads(json.dumps(cost.to_dict()))["vision_tokens"] == 391


def test_estimate_image_uses_the_displayed_size() -> None:
    info = ImageInfo(format="JPEG", width=480, height=640, orientation=6, mode="RGB", n_frames=1)
    cost = estimate_image(info)
    assert (cost.width, cost.height, cost.resized_width, cost.resized_height) == (480, 640, 476, 644)


@pytest.mark.parametrize("bad", [0, -5, True, 2.0, "640"])
def test_invalid_sizes_are_refused(bad: object) -> None:
    with pytest.raises(InvalidRequest) as info:
        estimate(bad, 100)  # type: ignore[arg-type]
    assert info.value.code == "invalid_size"


# --- policy -------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "config",
    [
        {},
        {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2},
        {"size": {"shortest_edge": 4096, "longest_edge": 200704}},
        {"size": {"shortest_edge": 4096, "longest_edge": 200704}, "max_pixels": 50176, "min_pixels": 1024},
        {"size": {"shortest_edge": 1000, "longest_edge": 500000}, "patch_size": 16, "merge_size": 2,
         "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessor"},
    ],
)
def test_policy_from_preprocessor_config_matches_transformers(
    hf_qwen2vl: ModuleType, config: dict[str, object]
) -> None:
    policy = ResolutionPolicy.from_preprocessor_config(config)
    reference = hf_qwen2vl.Qwen2VLImageProcessorPil(**config)
    assert (policy.min_pixels, policy.max_pixels) == (reference.size.shortest_edge, reference.size.longest_edge)
    assert (policy.patch_size, policy.merge_size) == (reference.patch_size, reference.merge_size)
    for height, width in [(480, 640), (1080, 1920), (33, 7), (4000, 3000)]:
        assert estimate(width, height, policy).encoder_patches == reference.get_number_of_image_patches(height, width)


def test_policy_from_legacy_size_keys() -> None:
    policy = ResolutionPolicy.from_preprocessor_config({"size": {"min_pixels": 1024, "max_pixels": 65536}})
    assert (policy.min_pixels, policy.max_pixels) == (1024, 65536)


@pytest.mark.parametrize(
    "config",
    [
        {"size": [224, 224]},
        {"size": {"shortest_edge": 3136}},
        {"patch_size": 0},
        {"merge_size": True},
        {"min_pixels": 10_000, "max_pixels": 100},
        {"max_pixels": 12.5},
    ],
)
def test_bad_preprocessor_configs_are_refused(config: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ResolutionPolicy.from_preprocessor_config(config)


def test_policy_validation() -> None:
    assert ResolutionPolicy().factor == 28
    with pytest.raises(ValueError, match="min_pixels"):
        ResolutionPolicy(min_pixels=0)
    with pytest.raises(ValueError, match="must not exceed"):
        ResolutionPolicy(min_pixels=1000, max_pixels=999)


# --- classes ------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("tokens", "name"), [(0, "xs"), (256, "xs"), (257, "s"), (1024, "s"), (4096, "m"), (16384, "l"), (16385, "xl")]
)
def test_classify_uses_inclusive_upper_bounds(tokens: int, name: str) -> None:
    assert CostClasses().classify(tokens) == name


def test_class_bounds_and_names() -> None:
    classes = CostClasses()
    assert classes.names == ("xs", "s", "m", "l", "xl")
    assert classes.bound("m") == 4096 and classes.bound("xl") is None
    with pytest.raises(KeyError):
        classes.bound("xxl")
    with pytest.raises(ValueError):
        classes.classify(-1)
    assert estimate(448, 448).cost_class == "xs" and estimate(1920, 1080).cost_class == "m"


def test_classes_from_string_round_trip() -> None:
    spec = "xs=256,s=1024,m=4096,l=16384,xl"
    assert CostClasses.from_string(spec) == CostClasses()
    assert CostClasses.from_string(" small = 500 , big ").bounds == (("small", 500),)
    assert CostClasses.from_string("all").names == ("all",)
    assert CostClasses.from_string(CostClasses().to_string()) == CostClasses()


@pytest.mark.parametrize(
    "spec",
    ["", "xs=256,s=1024", "xs=256,,xl", "xs=abc,xl", "xs=-1,xl", "xs=0,xl", "s=1024,xs=256,xl", "a=1,a=2,b",
     "a=1,a", "XS=256,xl", "x s=1,xl", "xs=1:2,xl"],
)
def test_bad_class_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        CostClasses.from_string(spec)


# --- report and import hygiene ------------------------------------------------------------------

def test_cost_report(tmp_path: Path, encode: Callable[..., bytes]) -> None:
    files = {
        "photo.png": encode(Image.new("RGB", (640, 480)), "PNG"),
        "sideways.jpg": encode(Image.new("RGB", (1920, 1080)), "JPEG", exif=_orientation_exif(6)),
        "strip.png": encode(Image.new("RGB", (300, 1)), "PNG"),
        "notes.txt": b"not an image\n",
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    paths = [str(tmp_path / name) for name in files] + [str(tmp_path / "missing.png")]
    lines = cost_report(paths).splitlines()
    assert lines[0].split() == ["file", "format", "size", "resized", "tiles", "vision_tokens", "patches", "class"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert rows["photo.png"] == ["PNG", "640x480", "644x476", "1", "391", "1564", "s"]
    assert rows["sideways.jpg"] == ["JPEG", "1080x1920", "728x1316", "1", "1222", "4888", "m"]
    assert rows["strip.png"][:2] == ["PNG", "300x1"] and rows["strip.png"][-2:] == ["error:", "aspect_ratio"]
    assert rows["notes.txt"][-2:] == ["error:", "not_an_image"]
    assert rows["missing.png"][-2:] == ["error:", "image_not_found"]
    assert estimate_image(probe(files["photo.png"]), POLICIES["narrow"]).vision_tokens < 391


def _orientation_exif(value: int) -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = value
    return exif


def test_sdk_imports_no_torch() -> None:
    code = (
        "import sys, vlmq, vlmq.cost, vlmq.images, vlmq.errors\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == ""
