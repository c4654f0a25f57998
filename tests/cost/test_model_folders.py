"""VLMQ_MODELS folders are priced by their own family's rule, read from the files transformers writes.

Folders are written locally with transformers' own ``save_pretrained`` (config and processor; no weights,
no hub). An unknown model type is refused at submit, before anything reaches Redis or storage.
"""
from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hf_reference import internvl_context_tokens, internvl_processor, llava_next_processor, qwen3_vl_processor
from PIL import Image
from transformers import InternVLConfig, LlavaNextConfig, Qwen3VLConfig

from vlmq.cli import main
from vlmq.client import Client
from vlmq.cost import ResolutionPolicy, estimate
from vlmq.errors import InvalidRequest
from vlmq.families import InternVLPolicy, LlavaNextPolicy, read_model_folder
from vlmq.models import class_cost, resolve_model
from vlmq.settings import Settings

SIZES = [(1, 1), (480, 640), (1080, 1920), (37, 4000), (3000, 200), (448, 448), (900, 901)]
TEXT = {"model_type": "qwen2", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}


def _internvl(folder: Path) -> Any:
    vision = {"image_size": 64, "patch_size": 8, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    InternVLConfig(vision_config=vision, text_config=TEXT, downsample_ratio=0.5).save_pretrained(folder)
    processor = internvl_processor({"size": {"height": 64, "width": 64}, "max_patches": 6}, image_seq_length=16)
    processor.save_pretrained(folder)
    return processor


def _llava_next(folder: Path) -> Any:
    pinpoints = [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]]
    LlavaNextConfig(vision_config={"model_type": "clip_vision_model", "image_size": 32, "patch_size": 8},
                    text_config={"model_type": "llama", "hidden_size": 32}, image_grid_pinpoints=pinpoints,
                    ).save_pretrained(folder)
    processor = llava_next_processor(
        {"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}, "image_grid_pinpoints": pinpoints},
        patch_size=8, vision_feature_select_strategy="default", num_additional_image_tokens=1)
    processor.save_pretrained(folder)
    return processor


def _qwen3_vl(folder: Path) -> Any:
    Qwen3VLConfig().save_pretrained(folder)
    processor = qwen3_vl_processor({"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2,
                                    "size": {"shortest_edge": 65536, "longest_edge": 16777216}})
    processor.save_pretrained(folder)
    return processor


WRITERS = {"internvl": _internvl, "llava_next": _llava_next, "qwen3_vl": _qwen3_vl}
POLICY_TYPES = {"internvl": InternVLPolicy, "llava_next": LlavaNextPolicy, "qwen3_vl": ResolutionPolicy}


def _tokens(processor: Any, family: str, sizes: list[tuple[int, int]]) -> list[int]:
    """The processor's image tokens of each (height, width), in one call."""
    if family == "internvl":
        return internvl_context_tokens(processor, sizes)
    return [int(n) for n in processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]]


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_a_folder_written_by_transformers_is_priced_by_its_family(tmp_path: Path, family: str) -> None:
    processor = WRITERS[family](tmp_path)
    assert json.loads((tmp_path / "processor_config.json").read_text())["image_processor"]  # transformers 5 layout
    assert not (tmp_path / "preprocessor_config.json").exists()
    model_type, policy = read_model_folder(tmp_path)
    assert model_type == family and isinstance(policy, POLICY_TYPES[family])
    sizes = [(h, w) for h, w in SIZES if family != "qwen3_vl" or max(h, w) <= 200 * min(h, w)]
    assert [estimate(w, h, policy).vision_tokens for h, w in sizes] == _tokens(processor, family, sizes)


def test_the_hub_layout_with_preprocessor_config_json(tmp_path: Path) -> None:
    # InternVL3-hf as published: image processor settings in preprocessor_config.json (crop_to_patches false,
    # which InternVLProcessor overrides), image_seq_length alone in processor_config.json
    config = {"model_type": "internvl", "downsample_ratio": 0.5,
              "vision_config": {"image_size": [448, 448], "patch_size": [14, 14]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"crop_to_patches": False, "max_patches": 12, "min_patches": 1, "size": {"height": 448, "width": 448},
         "image_processor_type": "GotOcr2ImageProcessorFast"}))
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_length": 256}))
    _, policy = read_model_folder(tmp_path)
    assert policy == InternVLPolicy()
    cost = estimate(1920, 1080, policy)  # a 4x2 grid and the thumbnail
    assert (cost.grid_w, cost.grid_h, cost.num_tiles, cost.vision_tokens) == (4, 2, 9, 9 * 256)
    assert cost.encoder_patches == 9 * 32 * 32 and cost.cost_class == "m"


def _internvl_chat(folder: Path) -> None:
    # the original remote-code InternVL layout: InternVL-shaped, but not a model type vlmq knows
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "internvl_chat", "force_image_size": 448, "downsample_ratio": 0.5, "max_dynamic_patch": 12}))
    (folder / "preprocessor_config.json").write_text(json.dumps({"crop_size": 448, "image_mean": [0.485]}))


def _png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buffer, "PNG")
    return buffer.getvalue()


def test_an_unknown_model_type_is_refused_at_submit(tmp_path: Path, redis_client: Any, redis_url: str) -> None:
    for name in ("chat", "empty"):
        (tmp_path / name).mkdir()
    _internvl_chat(tmp_path / "chat")
    settings = Settings(models={"chat": str(tmp_path / "chat"), "empty": str(tmp_path / "empty")})
    with Client(redis_url, f"file://{tmp_path / 'store'}", settings=settings) as client:
        for model, says in (("chat", "model type 'internvl_chat'"), ("empty", "has no config.json")):
            with pytest.raises(InvalidRequest, match=says) as info:
                client.submit(_png(1920, 1080), "Describe the image.", model=model)
            assert info.value.code == "unsupported_model"
    assert redis_client.dbsize() == 0  # nothing enqueued, no record
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*"))


def test_inconsistent_processor_settings_are_refused(tmp_path: Path) -> None:
    _internvl(tmp_path)
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    (tmp_path / "processor_config.json").write_text(json.dumps({**saved, "image_seq_length": 256}))
    with pytest.raises(InvalidRequest, match="image_seq_length is 256 but config.json's vision tower gives 16") as e:
        resolve_model("m", Settings(models={"m": str(tmp_path)}))
    assert e.value.code == "bad_model_config"


def test_submit_prices_a_registered_folder_by_its_own_rule(tmp_path: Path, redis_client: Any, redis_url: str) -> None:
    _internvl(tmp_path / "internvl")
    settings = Settings(models={"tiny-internvl": str(tmp_path / "internvl")})
    with Client(redis_url, f"file://{tmp_path / 'store'}", settings=settings) as client:
        info = client.submit(_png(1920, 1080), "Describe the image.", model="tiny-internvl").info()
    # 64-px tiles, at most 6: 16:9 is nearest 2:1, so a 2x1 grid and the thumbnail, 16 tokens and 64 patches
    # each (Qwen's rule would say 1222 tokens)
    assert (int(info["vision_tokens"]), int(info["encoder_patches"])) == (3 * 16, 3 * 64)
    assert info["cost_class"] == "xs" and info["queue"] == "vlmq.tiny-internvl.xs"
    spec = resolve_model("tiny-internvl", settings)
    assert spec.family == "internvl"
    assert class_cost(spec, "xl", settings) == (6 + 1) * 16 + settings.text_token_bound


def test_vlmq_cost_command_uses_the_models_family(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    _llava_next(tmp_path / "llava")
    image = tmp_path / "wide.png"
    image.write_bytes(_png(300, 70))
    monkeypatch.setenv("VLMQ_MODELS", f"tiny-llava={tmp_path / 'llava'}")
    assert main(["cost", "--model", "tiny-llava", str(image)]) == 0
    header, row = capsys.readouterr().out.strip().splitlines()
    assert header.split() == ["file", "format", "size", "resized", "tiles", "vision_tokens", "patches", "class"]
    # best fit 32x96: 3 tiles and the base; 4x12 features of which the image fills 2.8 rows, so one padded row
    # goes off each side: 2x12 features, 2 newlines, and the base tile's 4x4
    assert row.split() == ["wide.png", "PNG", "300x70", "96x32", "4", str(2 * 12 + 2 + 16), str(4 * 16), "xs"]
    monkeypatch.setenv("VLMQ_MODELS", f"chat={tmp_path}")
    _internvl_chat(tmp_path)
    assert main(["cost", "--model", "chat", str(image)]) == 1
    assert "not supported" in capsys.readouterr().err


def test_an_edited_folder_is_read_again(tmp_path: Path) -> None:
    _internvl(tmp_path)
    assert estimate(1920, 1080, read_model_folder(tmp_path)[1]).num_tiles == 3
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    saved["image_processor"]["max_patches"] = 1
    (tmp_path / "processor_config.json").write_text(json.dumps(saved))
    os.utime(tmp_path / "processor_config.json", ns=(1, 1))  # a new mtime even on a coarse clock
    assert estimate(1920, 1080, read_model_folder(tmp_path)[1]).num_tiles == 1
